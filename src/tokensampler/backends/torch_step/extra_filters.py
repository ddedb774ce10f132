"""The full-row samplers in torch: dynamic temperature (step 7) and steps 10.1-10.6 of docs/semantics.md
(top-n-sigma, typical-p, epsilon, eta, XTC, Mirostat), for the sampled rows whose parameters turn one on.

Their kept sets are not a threshold of `z / T` (typical-p, XTC) or need quantities of the whole kept
set (entropy, standard deviation), so these rows take a route of their own, `draw_rows`:

1. `T_dyn` per row from the entropy of `softmax(z)` over its kept ids (`dynamic_temperatures`: the
   entropy summed in any order, with a bound on its distance to the definition's canonical sum;
   where T_dyn is the same float32 across that interval it is the definition's, else the row gets
   the canonical sum, `dynamic_temperature`); a row whose `T_dyn` is 0, or whose ids all underflow
   at `z / T_dyn`, is greedy from there;
2. min-p, top-k and top-p as the torch step computes them (`stages.filter_and_draw`, on `T_dyn`),
   which divides the rows in place; a row with no step 10.1-10.6 is drawn there;
3. the six filters, one row at a time, on the ids step 10 kept, in the canonical order (`z`
   descending, lower id first), every quantity float64 and every sum a sequential float64 sum in
   that order (`_sequential_sum`: a cumulative sum, which adds one term after the other); Mirostat
   reads the slot's mu (`SamplerState.mirostat`);
4. the Gumbel argmax of step 11 over the ids they kept, with the definition's exact noise, for all
   these rows at once; a Mirostat row leaves the surprise of its token in the state (`surprise`),
   which step 13 (`SamplerState.record_tokens`) turns into the new mu.

Each filtered row's kept ids are computed as one 1-d vector laid out as the definition orders it,
so that every element goes through the same torch kernels as in `reference.py` (a vectorised float64
`exp` treats a block's tail elements with another code path): the route is exact, bit for bit, on
the same device. Only the ids step 10 kept are sorted (a few hundred on an LLM row, top-p 0.95).
"""

from __future__ import annotations

import math
import struct
from dataclasses import replace
from typing import Sequence

import torch

from ...core import rng
from ...core.constants import NEG_INF
from ...core.params import SamplingParams
from ...core.plan import full_row_stages
from ...state import SamplerState
from ...state.slots import MU
from . import stages
from .argmax import first_argmax
from .config import DEFAULT, TorchStepConfig


def needed(params: Sequence[SamplingParams]) -> bool:
    """Whether some of these rows runs a full-row stage (`core.plan.FULL_ROW_STAGES`)."""
    return any(full_row_stages(p) for p in params)


# ------------------------------------------------------------------ the float64 quantities of one row
def _sequential_sum(terms: torch.Tensor) -> torch.Tensor:
    """float64 0-d: the terms added one after the other, in their order (a cumulative sum's end)."""
    return torch.cumsum(terms, 0)[-1]


def _ordered(row: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The kept ids of one row (float32 [V], bool [V]) in the canonical order: z descending, the
    lower id first among equal values (a stable sort of the ascending ids)."""
    ids = kept.nonzero().squeeze(-1)
    return ids[torch.sort(row[ids], descending=True, stable=True).indices]


def _weights(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e, S, H) of values x (float64, canonical order, x[0] the max): e = exp(x - max), S their
    sequential sum, H = -sum q log q over q = e / S > 0."""
    e = torch.exp(x - x[0])
    total = _sequential_sum(e)
    q = e / total
    entropy = -_sequential_sum(torch.where(q > 0, q * torch.log(q), torch.zeros_like(q)))
    return e, total, entropy


def dynamic_temperature(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Step 7's float32 T_dyn of one row (z after step 5, float32 [V]): T_min + (T_max - T_min)
    (H / log n)^exponent over its n kept ids; the request's T when n = 1."""
    ids = _ordered(row, row > NEG_INF)
    n = ids.numel()
    if n == 1:
        return torch.tensor(p.temperature, dtype=torch.float32, device=row.device)
    _, _, entropy = _weights(row[ids].to(torch.float64))
    return _temperature_of(entropy, n, p).to(torch.float32)


def _temperature_of(entropy: torch.Tensor | float, n: int, p: SamplingParams) -> torch.Tensor | float:
    """T_min + (T_max - T_min) (H / log n)^exponent in float64, H a float64 0-d tensor or a float
    (the same operations in the same order either way)."""
    t_min = max(0.0, p.temperature - p.dynatemp_range)
    t_max = p.temperature + p.dynatemp_range
    return t_min + (t_max - t_min) * (entropy / math.log(n)) ** p.dynatemp_exponent


_ROUNDING = 2.0 ** -53  # float64's unit roundoff
_LOWEST = torch.finfo(torch.float32).min
_REMOVED = -1e300  # a removed id's distance to the max: exp gives 0, and 0 * it gives 0 (not NaN)


def dynamic_temperatures(zs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Step 7's float32 T_dyn of each row of zs (float32 [R, V] after step 5, finite maxima), equal to
    `dynamic_temperature` row by row, without sorting the rows.

    The entropy is computed in any order, in float64, as `H = log S - sum(e d) / S` (d = z - max,
    e = exp(d), S = sum e: two sums of terms of one sign, no cancellation). It differs from the
    canonical sequential sum's H by at most `entropy_error(H, n)`; T_dyn is evaluated at both ends of
    that interval, and where both round to the same float32 that is the row's T_dyn (any H inside
    gives it). A row where they differ (about one in 10^3 or fewer) gets `dynamic_temperature`'s
    exact canonical sum. One row at a time (its float64 work, 8 V bytes, stays in cache)."""
    out = torch.empty(zs.shape[0], dtype=torch.float32, device=zs.device)
    for j, p in enumerate(params):
        entropy, n = row_entropy(zs[j])
        t_dyn = bracketed_temperature(entropy, n, p)
        out[j] = dynamic_temperature(zs[j], p) if t_dyn is None else t_dyn
    return out


def row_entropy(row: torch.Tensor) -> tuple[float, int]:
    """(H, n): the entropy of softmax(z) over the n kept ids (> -inf) of one row (float32 [V]), in
    float64 summed in any order: `H = log S - sum(e d) / S`. H is NaN where the row's maximum is not
    finite."""
    top = row.max()
    n = int((row > NEG_INF).sum())
    if not math.isfinite(float(top)):
        return math.nan, n
    d = row.to(torch.float64).sub_(top.to(torch.float64)).clamp_(min=_REMOVED)
    e = torch.exp(d)
    total = e.sum()
    return float(torch.log(total) - e.mul_(d).sum() / total), n


def entropy_error(entropy: float, n: int) -> float:
    """A bound on |H_a - H_b| for two float64 evaluations of the entropy of one row's n kept ids (the
    canonical sequential sum, and `dynamic_temperatures`' sum in any order) from the same distances
    d = z - max: each is within (2n + 8)(H + 1) u of the exact entropy of softmax(d) (u = 2^-53; exp
    and log within one ulp, S and the sums within the sequential-sum bound (n - 1) u), times 4 for
    safety, plus an absolute term for subnormal probabilities."""
    return 4.0 * (4 * n + 16) * (entropy + 1.0) * _ROUNDING + 1e-290


def bracketed_temperature(entropy: float, n: int, p: SamplingParams) -> float | None:
    """The float32 T_dyn of a row of n kept ids whose float64 entropy (any summation order) is
    `entropy`: the one every entropy within `entropy_error` of it gives, or None if they differ (or
    the entropy is not finite)."""
    if n <= 1 or not math.isfinite(entropy):
        return None if n > 1 else float(torch.tensor(p.temperature, dtype=torch.float32))
    error = entropy_error(entropy, n)
    margin = 2.0 ** -40  # the float64 evaluation's own few roundings, on either end
    try:  # a power or a T past float32's range: left to the canonical sum (which gives inf)
        ends = [_temperature_of(max(h, 0.0), n, p) for h in (entropy - error, entropy + error)]
        low, high = (_float32(min(ends) * (1 - margin)), _float32(max(ends) * (1 + margin)))
    except OverflowError:
        return None
    return low if low == high else None


def _float32(value: float) -> float:
    """value rounded to float32 (to nearest, ties to even); OverflowError past float32's range."""
    return struct.unpack("f", struct.pack("f", value))[0]


# ------------------------------------------------------------------ steps 10.1-10.5 on one row
def _top_n_sigma(x: torch.Tensor, n_sigma: float) -> torch.Tensor:
    """10.1: keep x >= max - n sigma (population standard deviation of x)."""
    count = x.numel()
    mean = _sequential_sum(x) / count
    deviation = x - mean
    sigma = torch.sqrt(_sequential_sum(deviation * deviation) / count)
    return x >= x[0] - n_sigma * sigma


def _typical(x: torch.Tensor, mass: float) -> torch.Tensor:
    """10.2: by |-log q - H| ascending (ties in the canonical order), keep while the mass before the
    first id of the score's tie is < mass * S: ids of equal score stay or go together."""
    e, total, entropy = _weights(x)
    score = torch.abs(-torch.log(e / total) - entropy)
    order = torch.sort(score, stable=True).indices
    sorted_score = score[order]
    cumulative = torch.cumsum(e[order], 0)
    before = torch.cat([cumulative.new_zeros(1), cumulative[:-1]])
    place = torch.arange(x.numel(), device=x.device)
    starts = torch.ones_like(sorted_score, dtype=torch.bool)
    starts[1:] = sorted_score[1:] != sorted_score[:-1]
    first = torch.cummax(torch.where(starts, place, 0), 0).values  # each place's tie start
    keep = torch.empty_like(starts)
    keep[order] = before[first] < mass * total
    return keep


def _cutoff(x: torch.Tensor, cutoff: float, eta: bool) -> torch.Tensor:
    """10.3 (epsilon) / 10.4 (eta, bound min(c, sqrt(c) exp(-H))): keep q >= bound, and the maxima."""
    e, total, entropy = _weights(x)
    bound = torch.minimum(torch.tensor(cutoff, dtype=torch.float64, device=x.device),
                          math.sqrt(cutoff) * torch.exp(-entropy)) if eta else cutoff
    return (e / total >= bound) | (x == x[0])


def _xtc(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """10.5 once the coin said yes: with a >= 2 ids of q >= threshold (a prefix of the canonical
    order), the first a - 1 of them go."""
    e, total, _ = _weights(x)
    above = int((e / total >= threshold).sum())
    keep = torch.ones_like(x, dtype=torch.bool)
    if above >= 2:
        keep[:above - 1] = False
    return keep


def _mirostat(x: torch.Tensor, mu: float) -> torch.Tensor:
    """10.6: keep the ids of surprise -log2 q <= mu; if none, the ids tied at the maximum."""
    e = torch.exp(x - x[0])
    keep = -torch.log2(e / _sequential_sum(e)) <= mu
    return keep if bool(keep.any()) else x == x[0]


def surprise(row: torch.Tensor, ids: torch.Tensor, token: int) -> torch.Tensor:
    """float64 0-d: -log2 q'_t, q' the softmax of one row's values (float32 [V]) over its kept `ids`
    (canonical order), t = `token` (one of them): the surprise step 13 updates Mirostat's mu with."""
    x = row[ids].to(torch.float64)
    e = torch.exp(x - x[0])
    q = e / _sequential_sum(e)
    return -torch.log2(q[int((ids == token).nonzero())])


def record_surprise(state: SamplerState, slots: torch.Tensor, final: torch.Tensor, tokens: torch.Tensor,
                    rows: Sequence[int]) -> None:
    """Leave in the state the surprise of `tokens[b]` among the kept ids of `final[b]` (z / T, -inf
    elsewhere) for the rows `rows` (speculative verification: the emitted token, not the drawn one)."""
    for b in rows:
        ids = _ordered(final[b], final[b] > NEG_INF)
        state.mirostat_surprise[slots[b]] = surprise(final[b], ids, int(tokens[b]))


def filter_row(row: torch.Tensor, kept: torch.Tensor, p: SamplingParams, coin: float, mu: float = 0.0
               ) -> torch.Tensor:
    """Steps 10.1-10.6 on one row (z / T float32 [V]; `kept`: the ids step 10 kept, int64
    ascending), each filter on what the previous left; coin: the row's XTC coin; mu: its Mirostat
    mu. Returns the kept ids, canonical order."""
    ids = kept[torch.sort(row[kept], descending=True, stable=True).indices]
    steps = []
    if p.top_n_sigma is not None:
        steps.append(lambda x: _top_n_sigma(x, p.top_n_sigma))
    if p.typical_p < 1.0:
        steps.append(lambda x: _typical(x, p.typical_p))
    if p.epsilon_cutoff > 0:
        steps.append(lambda x: _cutoff(x, p.epsilon_cutoff, eta=False))
    if p.eta_cutoff > 0:
        steps.append(lambda x: _cutoff(x, p.eta_cutoff, eta=True))
    if p.xtc_probability > 0 and coin < p.xtc_probability:
        steps.append(lambda x: _xtc(x, p.xtc_threshold))
    if p.mirostat_tau is not None:
        steps.append(lambda x: _mirostat(x, mu))
    for keep_of in steps:
        ids = ids[keep_of(row[ids].to(torch.float64))]
    return ids


def _gumbel_argmaxes(z: torch.Tensor, rows: Sequence[int], ids: Sequence[torch.Tensor], keys: torch.Tensor
                     ) -> torch.Tensor:
    """Step 11 over given ids of given rows of z (ids[k]: int64 ids of row rows[k]; keys[k] its noise
    key): per row the largest fl(z + g), the lowest id on ties. int64 [len(rows)]."""
    counts = torch.tensor([len(i) for i in ids], device=z.device)
    owner = torch.repeat_interleave(torch.arange(len(rows), device=z.device), counts)
    flat = torch.cat(list(ids))
    scores = z[torch.tensor(rows, device=z.device)[owner], flat] + rng.gumbel_from_bits(
        rng.random_bits(keys[owner], flat))
    best = scores.new_full((len(rows),), NEG_INF).scatter_reduce_(0, owner, scores, "amax")
    winners = torch.where(scores == best[owner], flat, torch.iinfo(torch.int64).max)
    return flat.new_empty(len(rows)).scatter_reduce_(0, owner, winners, "amin", include_self=False)


# ------------------------------------------------------------------ the route
def draw_rows(z: torch.Tensor, z_max: torch.Tensor, slots: torch.Tensor, params: Sequence[SamplingParams],
              rows: Sequence[int], state: SamplerState, config: TorchStepConfig = DEFAULT,
              compiled: bool = False, final: bool = True) -> tuple[torch.Tensor, list[bool]]:
    """Steps 7-11 for the sampled rows `rows` of z (float32 [R, V] after step 5, +inf rule applied;
    z_max [R] its finite row maxima; slots int64 [R]; params one per row of z), none of them left
    empty by the request's T. With `final`, each row of z is overwritten with its final z (z / T_dyn
    over the kept ids, -inf elsewhere; unchanged where the row turned greedy); without, the rows'
    values are left in any state (the caller does not read them: no processed logprobs).

    Returns (tokens int64 [len(rows)], greedy): greedy[i] is True where T_dyn made row i greedy
    (its token is the first maximum of z)."""
    rows = list(rows)
    whole = rows == list(range(z.shape[0]))
    zs, row_max, row_slots = (z, z_max, slots) if whole else (z[rows], z_max[rows], slots[rows])
    row_params = [params[r] for r in rows]
    temperature = state.temperature[row_slots].clone()
    dynamic = [i for i, p in enumerate(row_params) if p.dynatemp_range > 0]
    if dynamic:
        temperature[dynamic] = dynamic_temperatures(zs if len(dynamic) == len(rows) else zs[dynamic],
                                                    [row_params[i] for i in dynamic])
    greedy = ((temperature == 0) | torch.isneginf(row_max / temperature)).tolist()
    tokens = torch.zeros(len(rows), dtype=torch.int64, device=z.device)
    flat = [i for i, g in enumerate(greedy) if g]
    if flat:
        tokens[flat] = first_argmax(zs[flat])
    sampled = [i for i, g in enumerate(greedy) if not g]
    if sampled:
        tokens[sampled] = _filter_and_draw(zs, row_max, row_slots, row_params, temperature, sampled, state,
                                           config, compiled, final)
    if not whole and final:
        z[rows] = zs
    return tokens, greedy


def _filter_and_draw(zs: torch.Tensor, row_max: torch.Tensor, row_slots: torch.Tensor,
                     row_params: list[SamplingParams], temperature: torch.Tensor, sampled: list[int],
                     state: SamplerState, config: TorchStepConfig, compiled: bool, final: bool) -> torch.Tensor:
    """Steps 7 (division by T_dyn) to 11 for the rows `sampled` of zs, written back into zs as their
    final z where `final`. Returns their tokens."""
    whole = len(sampled) == zs.shape[0]
    part = zs if whole else zs[sampled]
    cols = stages.filter_columns(state, row_slots[sampled], [row_params[i] for i in sampled], config,
                                 compiled=compiled)
    cols = replace(cols, temperature=temperature[sampled])
    filtered = [j for j, i in enumerate(sampled) if full_row_stages(row_params[i]) not in ((), ("dynatemp",))]
    # the filters 10.1-10.6 start from the exact kept set of step 10, and so does the final z
    drawn, tau = stages.filter_and_draw(part, row_max[sampled], cols, exact_threshold=final or bool(filtered))
    if not final and not filtered:
        return drawn  # no step 10.1-10.6: the threshold's draw is the token
    floor = tau.clamp(min=_LOWEST)[:, None]  # a tau of -inf keeps the finite ids only
    listed = [(part[j] >= floor[j]).nonzero().squeeze(-1) for j in filtered]
    if filtered:
        st, slots = state, row_slots[sampled][filtered]
        coins = rng.xtc_coin(st.seed[slots], st.position[slots], st.stream[slots]).tolist()
        mus = [0.0] * len(filtered) if st.mirostat is None else st.mirostat[slots, MU].tolist()
        finals = [filter_row(part[j], ids, row_params[sampled[j]], coin, mu)
                  for j, ids, coin, mu in zip(filtered, listed, coins, mus)]
        drawn[filtered] = _gumbel_argmaxes(part, filtered, finals, cols.keys[filtered])
        for j, s, ids in zip(filtered, slots.tolist(), finals):
            if row_params[sampled[j]].mirostat_tau is not None:  # step 13 turns it into the new mu
                st.mirostat_surprise[s] = surprise(part[j], ids, int(drawn[j]))
    if final:
        part.masked_fill_(part < floor, NEG_INF)
        for j, ids, kept in zip(filtered, listed, finals if filtered else []):
            part[j, ids[~torch.isin(ids, kept)]] = NEG_INF
        if not whole:
            zs[sampled] = part
    return drawn
