"""The math of a vocabulary split: per-rank summaries of a row slice and their exact merge.

Each rank holds the columns `[offset, offset + width)` of every row. The functions here compute
what one rank sends (a few numbers per row, never the slice) and how every rank merges the
gathered summaries `[W, B, ...]` (rank order) into the same global answer:

- max with the lowest global id on ties (greedy, the Gumbel winner, the raw argmax of bad rows);
- log-sum-exp from per-rank (max, sum of exp) pairs;
- the k-th largest value from per-rank top-k candidates;
- the top-p threshold by a bisection on the order keys of float32 (`core.order`): every round evaluates the
  float64 mass above a set of pivots on each rank, so after `rounds` rounds the pivot interval
  holds exactly one float32 value, the threshold of the reference's definition;
- the top-N of a row from per-rank top-N lists (value desc, then id asc).
"""

from __future__ import annotations

import torch

from ...core.constants import NEG_INF, POS_INF

# An id no real token has: sorts after every real id on ties; never returned.
SENTINEL_ID = 2**52


# ------------------------------------------------------------------ max with lowest id
def local_max_and_id(z: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row the local max (float32) and the global id of its first occurrence (int64)."""
    values, local = z.max(dim=-1)
    return values, local + offset


def merge_max_lowest_id(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values, ids: [W, B] per-rank maxima and their global ids. Returns the global max [B] and
    the lowest id attaining it [B] (int64), and which rank holds it."""
    best = values.amax(dim=0)
    candidate = torch.where(values == best[None, :], ids, torch.full_like(ids, SENTINEL_ID))
    return best, candidate.amin(dim=0)


def owner_of(ids: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """ids: [W, B] per-rank reported ids; chosen: [B]. The rank whose report is `chosen` [B]."""
    return (ids == chosen[None, :]).to(torch.int64).argmax(dim=0)


def pick_rank(values: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """values [W, B], rank [B] -> values[rank[b], b]."""
    return values.gather(0, rank[None, :]).squeeze(0)


# ------------------------------------------------------------------ log-sum-exp
def local_sumexp(z: torch.Tensor) -> torch.Tensor:
    """Per row: (max, sum exp(z - max), number of +inf) as float64 [B, 3]; sum 0 if max is +-inf."""
    z64 = z.to(torch.float64)
    m = z64.amax(dim=-1)
    finite_m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    s = torch.exp(z64 - finite_m[:, None]).sum(dim=-1)
    s = torch.where(torch.isinf(m), torch.zeros_like(s), s)
    posinf = (z64 == POS_INF).sum(dim=-1).to(torch.float64)
    return torch.stack([m, s, posinf], dim=-1)


def merge_logsumexp(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """stats [W, B, 3] from `local_sumexp` of the unsaturated row -> (shift, log_total) float64 [B]
    such that log_softmax(x) = (x - shift) - log_total for the row after the +inf rule (shift 0 and
    log_total = log(#+inf) if any id is +inf). Kept apart so a huge shift does not absorb log_total."""
    m, s, posinf = stats[..., 0], stats[..., 1], stats[..., 2]
    big = m.amax(dim=0)
    shift = torch.where(torch.isinf(big), torch.zeros_like(big), big)
    total = (s * torch.exp(m - shift[None, :]).nan_to_num(0.0)).sum(dim=0)
    total = torch.where(big == POS_INF, posinf.sum(dim=0), total)
    return shift, torch.log(total)


def log_softmax_from(key: torch.Tensor, shift: torch.Tensor, log_total: torch.Tensor) -> torch.Tensor:
    """float32 log-probs of scores `key` ([B] or [B, N], any float dtype) with `merge_logsumexp`'s
    (shift, log_total) [B]; -inf scores stay -inf."""
    shape = (-1,) + (1,) * (key.dim() - 1)
    value = ((key.to(torch.float64) - shift.reshape(shape)) - log_total.reshape(shape)).to(torch.float32)
    return torch.where(torch.isneginf(key), torch.full_like(value, NEG_INF), value)


# ------------------------------------------------------------------ top-k
def local_top_values(z: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` largest values of each local row (count <= width), descending."""
    return torch.topk(z, count, dim=-1, sorted=True).values


def merge_kth_largest(candidates: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """candidates [W, B, c] per-rank top-c values; k int64 [B] (0 = off). The k-th largest value
    of the row [B] (-inf when off or when the row has fewer than k candidates, i.e. keep all)."""
    pooled = candidates.permute(1, 0, 2).reshape(candidates.shape[1], -1)
    ordered = torch.sort(pooled, dim=-1, descending=True).values
    usable = (k > 0) & (k <= ordered.shape[-1])
    index = torch.where(usable, k - 1, torch.zeros_like(k))
    kth = ordered.gather(-1, index[:, None]).squeeze(-1)
    return torch.where(usable, kth, torch.full_like(kth, NEG_INF))


# ------------------------------------------------------------------ top-p by bisection
class MassAbove:
    """A rank's float64 mass of kept ids strictly above any pivot: its kept values sorted
    ascending and the suffix sums of their float32 p, largest first (as the reference sums)."""

    def __init__(self, z: torch.Tensor, p: torch.Tensor) -> None:
        self.sorted_z, order = torch.sort(z, dim=-1)
        p_sorted = p.gather(-1, order).to(torch.float64)
        suffix = torch.flip(torch.cumsum(torch.flip(p_sorted, [-1]), -1), [-1])
        self.suffix = torch.nn.functional.pad(suffix, (0, 1))  # suffix[:, width] = 0

    def total(self) -> torch.Tensor:
        return self.suffix[:, 0]

    def at(self, pivots: torch.Tensor) -> torch.Tensor:
        """pivots float32 [B, P] -> float64 [B, P]: mass of local ids with z > pivot."""
        index = torch.searchsorted(self.sorted_z, pivots.contiguous(), right=True)
        return self.suffix.gather(-1, index)


class CandidateMass:
    """A rank's float64 mass of kept ids strictly above any pivot, from its `count` largest values
    only (a top-k pass instead of a sort of the slice): exact for a pivot at or above `floor`, the
    smallest candidate (every other id is at most `floor`, so not above such a pivot); below
    `floor` the value given is the candidates' total, a lower bound (every candidate is above the
    pivot). `total` is the float64 sum of every kept p of the slice."""

    def __init__(self, z: torch.Tensor, p: torch.Tensor, count: int) -> None:
        values, order = torch.topk(z, count, dim=-1)  # descending
        self.sorted_z = values.flip(-1)
        p_sorted = p.gather(-1, order.flip(-1)).to(torch.float64)
        suffix = torch.flip(torch.cumsum(torch.flip(p_sorted, [-1]), -1), [-1])
        self.suffix = torch.nn.functional.pad(suffix, (0, 1))
        self.floor = self.sorted_z[:, 0]
        self.total_mass = p.to(torch.float64).sum(dim=-1)

    def total(self) -> torch.Tensor:
        return self.total_mass

    def at(self, pivots: torch.Tensor) -> torch.Tensor:
        """pivots float32 [B, P] -> float64 [B, P]: the mass above each pivot (exact at or above
        `floor`, the candidates' total below it)."""
        index = torch.searchsorted(self.sorted_z, pivots.contiguous(), right=True)
        return self.suffix.gather(-1, index)


def bisection_below(mass: torch.Tensor, bound: torch.Tensor, pivots: torch.Tensor,
                    floors: torch.Tensor | None) -> torch.Tensor | None:
    """Per (row, pivot): is the global mass above the pivot `< bound`? `mass` [B, P] is the sum of
    the ranks' values; `floors` [W, B] the ranks' candidate floors (None: every value exact). A
    pivot below some rank's floor has a lower bound only: it decides "not below" when the bound
    is reached anyway. Returns None when some comparison is left undecided (the exact masses are
    then needed)."""
    below = mass < bound[:, None]
    if floors is None:
        return below
    inexact = (pivots.to(torch.float64)[None, :, :] < floors[:, :, None]).any(dim=0)
    return None if bool((below & inexact).any()) else below


def bisection_rounds(pivots: int) -> int:
    """Rounds after which a key interval of width < 2^32 is down to width 1 with `pivots` per round."""
    rounds, width = 0, 2**32
    while width > 1:
        width = -(-width // (pivots + 1))
        rounds += 1
    return rounds


def bisection_pivots(lo: torch.Tensor, hi: torch.Tensor, pivots: int) -> torch.Tensor:
    """`pivots` keys [B, P] splitting (lo, hi) in pivots + 1 near-equal parts."""
    j = torch.arange(1, pivots + 1, dtype=torch.int64, device=lo.device)[None, :]
    return lo[:, None] + ((hi - lo)[:, None] * j) // (pivots + 1)


def bisection_step(lo: torch.Tensor, hi: torch.Tensor, pivots: torch.Tensor,
                   below: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Narrow (lo, hi] to the part where the mass above first drops below the bound.

    Invariant: mass_above(lo) >= bound > mass_above(hi); `below` [B, P] is mass_above(pivot) < bound
    (False..False True..True along a row, since the mass above falls as the pivot rises)."""
    big = torch.full_like(pivots, 2**62)
    new_hi = torch.where(below, pivots, big).amin(dim=-1)
    new_lo = torch.where(below, torch.full_like(pivots, -(2**62)), pivots).amax(dim=-1)
    return torch.maximum(lo, new_lo), torch.minimum(hi, new_hi)


# ------------------------------------------------------------------ top-N for logprobs
def local_top_n(keys: torch.Tensor, real_width: int, offset: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` best real local ids (key desc, id asc) as (keys float32 [B, count], global ids
    int64 [B, count]), padded with (-inf, SENTINEL_ID) where the rank holds fewer real ids."""
    batch = keys.shape[0]
    out_keys = torch.full((batch, count), NEG_INF, dtype=torch.float32, device=keys.device)
    out_ids = torch.full((batch, count), SENTINEL_ID, dtype=torch.int64, device=keys.device)
    take = min(count, real_width)
    if take > 0:
        order = torch.sort(keys[:, :real_width], dim=-1, descending=True, stable=True).indices[:, :take]
        out_keys[:, :take] = keys.gather(-1, order)
        out_ids[:, :take] = order + offset
    return out_keys, out_ids


def merge_top_n(keys: torch.Tensor, ids: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys, ids [W, B, c] per-rank lists -> the global best `count` (key desc, id asc) [B, count]."""
    batch = keys.shape[1]
    keys = keys.permute(1, 0, 2).reshape(batch, -1)
    ids = ids.permute(1, 0, 2).reshape(batch, -1)
    by_id = torch.sort(ids, dim=-1, stable=True).indices
    keys, ids = keys.gather(-1, by_id), ids.gather(-1, by_id)
    by_key = torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :count]
    return keys.gather(-1, by_key), ids.gather(-1, by_key)
