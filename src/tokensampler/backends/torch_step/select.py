"""Sort-free kept sets (steps 8-10) as one threshold per row: kept = {i : z_i >= tau, z_i > -inf}.

min-p, top-k and top-p each keep a prefix of the ids ordered by post-temperature `z`, so their
intersection is also a prefix and one float32 threshold per row describes it exactly:

- min-p: tau = the smallest z with p = exp(z - z_max) >= min_p (float32, as the reference);
- top-k: tau = the k-th largest z of the row (ties at the border stay);
- top-p: over the ids kept so far, tau = the largest z value v whose mass of ids with z >= v
  reaches top_p * total, where masses are float64 sums of the float32 p. It is found from a
  sorted candidate list when the bound is reached inside it, else from a histogram of the masses
  over value bins (one pass) and an exact scan of the single bin where the bound is crossed.

`win_floor` gives the z below which an id cannot win the Gumbel argmax whatever its noise.
Float64 masses are summed in a different order than the reference's; the sets can only differ
when a mass lies within a float64 rounding of the bound (docs/cpu-fast-path.md).
"""

from __future__ import annotations

import torch

from ...core import rng
from ...core.constants import NEG_INF, POS_INF
from . import native
from .config import DEFAULT, TorchStepConfig
from .indexing import column_chunks, nonzero_ids, read_at
from .row_stats import winnable_count


def relative_probs(z: torch.Tensor, z_max: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """p = exp(z - z_max) (float32 [R, V], z_max [R]: the reference's eager ops), written into `out`
    (a float32 buffer of at least R x V elements the caller keeps across calls: a fresh block-sized
    tensor would page-fault on every step) or a new tensor."""
    p = torch.empty_like(z) if out is None else out.view(-1)[:z.numel()].view(z.shape)
    torch.sub(z, z_max[:, None], out=p)
    return p.exp_()


def min_p_threshold(z: torch.Tensor, z_max: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The smallest z of the row with exp(z - z_max) >= min_p (float32 [R]); min_p 0 -> -inf."""
    keep = relative_probs(z, z_max) >= min_p[:, None]
    tau = torch.where(keep, z, POS_INF).amin(dim=-1)
    return tau.masked_fill_(min_p <= 0, NEG_INF)


def min_p_floor(z_max: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """float32 [R]: a value below every z with fl(exp(fl(z - z_max))) >= min_p (min_p 0 -> -inf).
    log(min_p) with a safety of 1e-3 plus a relative 2^-16: far more than exp's and the
    subtraction's rounding, so no kept id is below it."""
    log_min_p = torch.log(min_p.to(torch.float64))
    bound = z_max.to(torch.float64) + log_min_p - 1e-3 - z_max.abs().to(torch.float64) * 2.0**-16
    return bound.to(torch.float32).masked_fill_(min_p <= 0, NEG_INF)


def top_k_threshold(z: torch.Tensor, top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tau, values, ids): the k-th largest z per row (-inf where k = 0 or k exceeds the finite
    ids), and the k_max largest values and their ids (sorted descending) as a candidate list."""
    vocab = z.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    values, ids = torch.topk(z, int(k.max()), dim=-1, sorted=True)
    tau = values.gather(-1, (k - 1)[:, None]).squeeze(-1)
    return tau.masked_fill_(top_k <= 0, NEG_INF), values, ids


def head_floor(z: torch.Tensor, chunks: int, chunk: int = 64) -> torch.Tensor:
    """float32 [R]: the `chunks`-th largest of the maxima of each run of `chunk` ids (the last run may
    be shorter). At least `chunks` ids lie at or above it and, barring ties, at most `chunks` x
    `chunk`. z: float32 [R, V], finite maxima."""
    rows, vocab = z.shape
    main = vocab - vocab % chunk
    maxima = z[:, :main].unflatten(-1, (main // chunk, chunk)).amax(dim=-1)
    if main < vocab:
        maxima = torch.cat([maxima, z[:, main:].amax(dim=-1, keepdim=True)], dim=-1)
    return torch.topk(maxima, min(chunks, maxima.shape[1]), dim=-1).values[:, -1]


def gather_candidates(z: torch.Tensor, lower: torch.Tensor, cap: int, *,
                      count: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                      config: TorchStepConfig = DEFAULT, compiled: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The candidate list: every id with z >= lower[r], without sorting the row (one count, one
    compare, one compaction).

    Parameters
    ----------
    z: float32 [R, V]. lower: float32 [R], finite. cap: the longest list allowed.
    count: int64 [R], the ids per row with z >= lower if already counted.
    scale: float32 [R]: the listed values are z / scale (the caller's undivided logits).
    compiled: count with the compiled `winnable_count` (the sampler's choice).

    Returns
    -------
    (values float32 [R, W], ids int64 [R, W], count int64 [R]), W = the longest row's count, in id
    order (callers sort only the prefix they read), padded with -inf / id 0; None if a row has more
    than `cap` ids."""
    if count is None:
        count = winnable_count(z, lower, config, compiled)
    width = int(count.max()) if count.numel() else 0
    if width > cap:  # checked before the compaction, which would be as large as the row
        return None
    op = native.gather_op() if compiled and _native_layout(z, lower, scale) else None
    if op is not None:
        values, ids, listed = op(z, lower, scale, width)
        if torch.equal(listed, count):  # always, unless `count` was not z >= lower's: then torch's way
            return values, ids, count
    mask = z >= lower[:, None]
    hits = nonzero_ids(mask.view(-1), int(count.sum()))  # flat, row-major: a row's hits are consecutive
    del mask
    if z.shape[0] == 1 and hits.numel():  # one row: its hits are the list, no placement to compute
        picked = z[0, hits]
        if scale is not None:
            picked.div_(scale[0])
        return picked[None], hits[None], count
    rows = torch.div(hits, z.shape[1], rounding_mode="floor")
    cols = hits.sub_(rows * z.shape[1])
    width = max(width, 1)
    # the i-th hit goes to flat position i + (row * width - first hit of the row) of the list
    offset = torch.arange(z.shape[0], device=z.device) * width - (torch.cumsum(count, dim=0) - count)
    dest = torch.arange(rows.numel(), device=z.device).add_(offset[rows])
    picked = read_at(z, rows, cols)
    if scale is not None:
        picked.div_(scale[rows])
    del rows
    values = torch.full((z.shape[0], width), NEG_INF, dtype=z.dtype, device=z.device)
    ids = torch.zeros((z.shape[0], width), dtype=torch.int64, device=z.device)
    values.view(-1)[dest] = picked
    ids.view(-1)[dest] = cols
    return values, ids, count


def _native_layout(z: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether the C++ pass takes these tensors: float32 on the CPU, rows of z contiguous."""
    return (native.rows_layout(z, torch.float32) and native.vector_layout(lower, torch.float32)
            and (scale is None or native.vector_layout(scale, torch.float32)))


def kept_mass(z: torch.Tensor, z_max: torch.Tensor, tau: torch.Tensor, scale: torch.Tensor | None = None,
              config: TorchStepConfig = DEFAULT) -> torch.Tensor:
    """float64 [R]: the sum of the float32 p over the ids with z >= tau (column chunk by chunk).
    With `scale` (float32 [R]) the row holds z * scale: each chunk is divided first (exactly the
    values an in-place division would give)."""
    restricted = not bool(torch.isneginf(tau).all())
    total = torch.zeros(z.shape[0], dtype=torch.float64, device=z.device)
    for start, stop in column_chunks(z, config.column_chunk):
        zc = z[:, start:stop] if scale is None else z[:, start:stop] / scale[:, None]
        p = (zc - z_max[:, None]).exp_()
        if restricted:
            p.masked_fill_(zc < tau[:, None], 0.0)
        total += p.sum(dim=-1, dtype=torch.float64)
    return total


def top_p_from_candidates(values: torch.Tensor, z_max: torch.Tensor, tau: torch.Tensor,
                          bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values: float32 [R, m], the m largest z of each row, descending; tau: the threshold so far;
    bound: float64 [R] = top_p * kept mass. Returns (tau_p, found): the largest value whose mass of
    ids with z >= it reaches the bound, and whether the bound was reached inside the list."""
    return top_p_at(values, masses_from_top(values, z_max, tau), bound)


def masses_from_top(values: torch.Tensor, z_max: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """float64 [R, m]: for descending `values`, the mass of the kept ids (z >= tau) up to each one."""
    p = torch.exp(values - z_max[:, None]).masked_fill_(values < tau[:, None], 0.0).to(torch.float64)
    return torch.cumsum(p, dim=-1)


def top_p_at(values: torch.Tensor, mass_ge: torch.Tensor, bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_p_from_candidates` given `masses_from_top` (so that several bounds share one cumsum)."""
    found = mass_ge[:, -1] >= bound
    position = (mass_ge < bound[:, None]).sum(dim=-1).clamp_(max=values.shape[-1] - 1)
    return values.gather(-1, position[:, None]).squeeze(-1), found


def top_p_by_histogram(z: torch.Tensor, z_max: torch.Tensor, tau: torch.Tensor,
                       bound: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                       config: TorchStepConfig = DEFAULT) -> torch.Tensor:
    """tau_p for rows whose crossing point lies deep in the row (flat logits).

    Bins of equal width in z over [low, z_max], low = max(tau, z_max - 64) (p < e^-64 below it);
    lower values are clamped into bin 0, so each bin still holds one value interval (the map is
    monotone). One pass gives the float64 mass per bin (and the total, when `bound` is None:
    bound = top_p * total); the mass from the top locates the bin where it reaches the bound, and
    an exact scan of that bin's ids, in descending order, gives the threshold."""
    bins = config.histogram_bins
    rows = z.shape[0]
    restricted = bool((tau > NEG_INF).any())
    low = torch.maximum(tau, z_max - 64.0)
    span = z_max - low
    # bins / span overflows to inf below span ~ bins / 3.4e38 (e.g. z / T with a huge T): then the
    # value at `low` would map to 0 * inf = NaN, no bin; a finite scale keeps the map monotone
    scale = torch.where(span > 0, bins / span, torch.zeros_like(span)).clamp_(max=torch.finfo(span.dtype).max)
    offsets = (torch.arange(rows, device=z.device, dtype=torch.int32) * bins)[:, None]
    fix_nan = bool((scale == 0).any())

    def bin_index(zc: torch.Tensor) -> torch.Tensor:
        index = (zc - low[:, None]).mul_(scale[:, None])
        if fix_nan:
            index.nan_to_num_(nan=0.0)  # -inf * 0 on rows whose only kept value is z_max
        return index.floor_().clamp_(0, bins - 1).to(torch.int32).add_(offsets)

    chunks = column_chunks(z, config.column_chunk)
    masses = torch.zeros(rows * bins, dtype=torch.float64, device=z.device)
    for start, stop in chunks:
        zc = z[:, start:stop]
        p = (zc - z_max[:, None]).exp_()
        if restricted:
            p.masked_fill_(zc < tau[:, None], 0.0)
        masses += torch.bincount(bin_index(zc).flatten(), weights=p.flatten().to(torch.float64),
                                 minlength=rows * bins)
    masses = masses.view(rows, bins)
    if bound is None:
        bound = top_p * masses.sum(dim=-1)
    mass_from_bin = torch.flip(torch.cumsum(torch.flip(masses, [1]), dim=1), [1])  # bins >= j
    crossing = ((mass_from_bin >= bound[:, None]).sum(dim=-1) - 1).clamp_(min=0)
    above = torch.cat([mass_from_bin[:, 1:], torch.zeros_like(mass_from_bin[:, :1])], dim=1)
    above = above.gather(-1, crossing[:, None]).squeeze(-1)
    target = crossing.to(torch.int32)[:, None] + offsets
    found_rows, found_values = [], []
    for start, stop in chunks:  # the crossing bin's ids, chunk by chunk
        zc = z[:, start:stop]
        r, c = torch.nonzero(bin_index(zc) == target, as_tuple=True)
        found_rows.append(r)
        found_values.append(zc[r, c])
    bin_rows, order = torch.sort(torch.cat(found_rows), stable=True)
    bin_values = torch.cat(found_values)[order]
    starts = torch.searchsorted(bin_rows, torch.arange(rows + 1, device=z.device)).tolist()
    result = low.clone()
    for r in range(rows):
        values = bin_values[starts[r]:starts[r + 1]]
        values = values[(values >= tau[r]) & (values > NEG_INF)]
        if values.numel() == 0:
            continue
        values = torch.sort(values, descending=True).values
        mass_ge = above[r] + torch.cumsum(torch.exp(values - z_max[r]).to(torch.float64), dim=0)
        position = int((mass_ge < bound[r]).sum().clamp(max=values.numel() - 1))
        result[r] = values[position]
    return result


def win_floor(z_max: torch.Tensor) -> torch.Tensor:
    """float32 [R]: a value L such that every id with z < L has fl(z + GUMBEL_MAX) <
    fl(z_max + GUMBEL_MIN), so it loses to the best kept id whatever the noise (z_max is kept)."""
    target = z_max + torch.tensor(rng.GUMBEL_MIN, dtype=torch.float32)
    gmax = torch.tensor(rng.GUMBEL_MAX, dtype=torch.float32)
    floor = target - gmax
    floor = floor - (floor.abs() * 2.0**-20 + 2.0**-20)
    for _ in range(64):  # step down until provably below: fl(floor + GUMBEL_MAX) < target
        bad = ((floor + gmax) >= target) & torch.isfinite(target)
        if not bool(bad.any()):
            break
        floor = torch.where(bad, floor - (floor.abs() * 2.0**-16 + 2.0**-10), floor)
    else:
        floor = torch.full_like(floor, NEG_INF)
    return floor.masked_fill_(torch.isneginf(z_max), NEG_INF)
