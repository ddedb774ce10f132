"""The dense route's top-p threshold and Gumbel argmax by full-row *reductions* (flat logits).

Rows with ~10^5 winnable ids cannot use a candidate list. Instead of a histogram (a float64
bincount) and approximate noise for every id, `sample_dense` takes the eager p = exp(z - z_max)
once (the reference's float32 values, in a reused buffer), two compiled reduction passes and one
narrow extraction:

1. **Thresholds.** A strided subsample of each row (sorted, small) estimates where the mass from
   the top reaches `top_p * total`; `TorchStepConfig.dense_threshold_offsets` sample positions around that estimate,
   plus +inf and the threshold so far, are candidate thresholds. One pass (`threshold_pass`) sums
   the float64 mass of p at or above every candidate at once (the last one is the total).
2. **Bracket.** These masses are sums of the reference's p in another order, so they are within
   `sum_error` of the reference's sums; the adjacent candidates that provably hold the threshold
   are found, only the ids between them are extracted, sorted and scanned with a float64
   cumulative sum. The scan is done at both ends of the error bound; rows where the answer differs
   get masses summed as `select.kept_mass` does and are scanned again. Rows whose bracket holds
   more than `TorchStepConfig.dense_bracket_cap` ids use the histogram (`select.top_p_by_histogram`).
3. **Noise by a race bound.** With u = (k + 1/2) / 2^24 and m = 2^24 - 1 - k from an id's hash
   bits, `(1 - u) <= -log(u) <= (1 - u) / u`, so without any logarithm:
   - every kept id's exact score is at least `z_max + log(p u / (1 - u))` (minus rounding): the
     threshold pass also takes the largest `p u / (1 - u)` over provably kept ids, a lower bound
     S_lo of the winning score;
   - an id can reach S_lo only if `(m + 1/2) / 2^24 <= p exp(z_max - S_lo)` (with slack for every
     rounding). One pass (`race_pass`) counts the kept ids that pass and gives the lowest and the
     highest. The winner always passes; with one or two passers their exact scores decide, else
     the row takes `gumbel.gumbel_argmax_dense`.

Masses are float64 sums of float32 p in another order than the reference's, as elsewhere in the
fast path (docs/cpu-fast-path.md).
"""

from __future__ import annotations

import torch

from ...core import rng
from ...core.constants import NEG_INF, POS_INF
from . import compile_cache, gumbel, native, select
from .config import DEFAULT, TorchStepConfig
from .host import numpy_module
from .indexing import column_chunks, nonzero_ids
from .select import relative_probs

RACE_SLACK = 2.0**-10  # relative slack of the race bound: covers exp's and the products' rounding
_TWO_POW_24 = float(2**24)
_NO_ID = 2**31 - 1


def _race_m(key32: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """m = 2^24 - 1 - (bits >>> 8) as float32 (exact), bits = rng.hash32(key ^ id) in int32."""
    return (rng.UNIFORM_MASK - rng.uniform_index_words(rng.hash32_words(key32 ^ ids))).to(torch.float32)


def _threshold_pass(p: torch.Tensor, z: torch.Tensor, thresholds: torch.Tensor, key32: torch.Tensor,
                    floor: torch.Tensor, ids: torch.Tensor):
    """Sibling reductions over one row block (compiled: one loop). See `threshold_pass`."""
    p64 = p.to(torch.float64)
    masses = [torch.where(z >= thresholds[:, j:j + 1], p64, 0.0).sum(dim=-1) for j in range(thresholds.shape[1])]
    m = _race_m(key32[:, None], ids)
    odds = p * ((2.0**24 - 0.5) - m) / (m + 0.5)  # p u / (1 - u); a literal (no float global guard)
    best = torch.where(z >= floor[:, None], odds, 0.0).amax(dim=-1)
    return torch.stack(masses, dim=-1), best


def _race_pass(p: torch.Tensor, z: torch.Tensor, threshold: torch.Tensor, key32: torch.Tensor,
               scale: torch.Tensor, ids: torch.Tensor):
    """Count, lowest and highest id of the kept ids passing the race bound (compiled: one loop)."""
    passed = (z >= threshold[:, None]) & (_race_m(key32[:, None], ids) + 0.5 <= p * scale[:, None])
    count = passed.to(torch.int32).sum(dim=-1)
    lowest = torch.where(passed, ids, _NO_ID).amin(dim=-1)  # ids are the block's absolute ids
    highest = torch.where(passed, ids, -1).amax(dim=-1)
    return count, lowest, highest


compile_cache.register("dense_threshold_pass", _threshold_pass, rows=(0, 1, 2, 3, 4))  # ids: the block's columns
compile_cache.register("dense_race_pass", _race_pass, rows=(0, 1, 2, 3, 4))


def _column_blocks(z: torch.Tensor, config: TorchStepConfig, compiled: bool) -> list[tuple[int, int]]:
    """(start, stop) column ranges: the whole row compiled (no temporaries), chunks when eager."""
    if compiled:
        return [(0, z.shape[1])]
    return column_chunks(z, config.column_chunk)


def threshold_pass(p: torch.Tensor, z: torch.Tensor, thresholds: torch.Tensor, key32: torch.Tensor,
                   floor: torch.Tensor, config: TorchStepConfig = DEFAULT, compiled: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """p: float32 [R, V] (`relative_probs`); z: float32 [R, V]; thresholds: float32 [R, J]
    (J = `TorchStepConfig.dense_thresholds`); key32: int32 [R] noise keys; floor: float32 [R]. Returns (masses float64
    [R, J]: the sum of p over z >= thresholds[:, j], within `sum_error` of any other order's sum;
    odds float32 [R]: the largest p u / (1 - u) over z >= floor, 0 if none). compiled: one
    compiled loop (the sampler's choice), else column chunks eagerly."""
    fn = compile_cache.maybe_compiled("dense_threshold_pass", _threshold_pass, compiled)
    masses = odds = None
    for start, stop in _column_blocks(z, config, compiled):
        ids = torch.arange(start, stop, dtype=torch.int32, device=z.device)
        m, b = fn(p[:, start:stop], z[:, start:stop], thresholds, key32, floor, ids)
        masses, odds = (m, b) if masses is None else (masses + m, torch.maximum(odds, b))
    return masses, odds


def race_pass(p: torch.Tensor, z: torch.Tensor, threshold: torch.Tensor, key32: torch.Tensor,
              scale: torch.Tensor, config: TorchStepConfig = DEFAULT, compiled: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, lowest, highest) int64 [R] of the ids with z >= threshold and (m + 1/2) <= p * scale
    (p, z float32 [R, V]; threshold, scale float32 [R]; key32 int32 [R]); lowest 2^31 - 1 and
    highest -1 where none. compiled: as `threshold_pass`."""
    fn = compile_cache.maybe_compiled("dense_race_pass", _race_pass, compiled)
    count = lowest = highest = None
    for start, stop in _column_blocks(z, config, compiled):
        ids = torch.arange(start, stop, dtype=torch.int32, device=z.device)
        c, lo, hi = (t.to(torch.int64) for t in fn(p[:, start:stop], z[:, start:stop], threshold, key32, scale, ids))
        if count is None:
            count, lowest, highest = c, lo, hi
        else:
            count, lowest, highest = count + c, torch.minimum(lowest, lo), torch.maximum(highest, hi)
    return count, lowest, highest


def sorted_descending(values: torch.Tensor) -> torch.Tensor:
    """values (float32 [R, W], no NaN) sorted descending along the last dim. On the CPU through
    numpy when it is there: torch.sort costs ~10x more on these small rows."""
    numpy = numpy_module() if values.device.type == "cpu" else None
    if numpy is not None:
        return torch.from_numpy(numpy.sort(values.numpy(), axis=-1)).flip(-1)
    return torch.sort(values, dim=-1, descending=True).values


def sum_error(masses: torch.Tensor, count: int) -> torch.Tensor:
    """float64: a bound on |a float64 sum of `count` non-negative float32 p - the same sum in
    another order| (each is within (count - 1) 2^-53 of the exact sum), for masses of the same p."""
    return masses * (count * 2.0**-52) + 2.0**-1000


def candidate_thresholds(z: torch.Tensor, z_max: torch.Tensor, tau: torch.Tensor, top_p: torch.Tensor,
                         row_mass: torch.Tensor, config: TorchStepConfig = DEFAULT) -> torch.Tensor:
    """float32 [R, `config.dense_thresholds`], non-increasing: +inf, sample values around the estimated top-p
    crossing, then `tau` (the threshold so far); all >= tau. `row_mass`: the whole row's mass
    (float64 [R], approximate is fine: it only places the candidates)."""
    stride = config.dense_sample_stride
    sample = z[:, ::stride].contiguous()
    values = sorted_descending(sample)
    p = torch.exp(values - z_max[:, None])
    kept = values >= tau[:, None]
    removed = torch.where(kept, 0.0, p).sum(dim=-1).to(torch.float64) * stride
    p = p.masked_fill_(~kept, 0.0).to(torch.float64)
    tail = torch.flip(torch.cumsum(torch.flip(p, [1]), dim=1), [1]) - p  # sampled mass below each
    kept_total = (row_mass - removed).clamp(min=1.0)  # the max is kept: its p is 1
    estimate_ge = kept_total[:, None] - tail * stride
    crossing = (estimate_ge < (top_p * kept_total)[:, None]).sum(dim=-1)
    offsets = torch.tensor(config.dense_threshold_offsets, device=z.device)
    position = (crossing[:, None] + offsets).clamp_(0, values.shape[1] - 1)
    thresholds = torch.cat([torch.full_like(tau, POS_INF)[:, None], values.gather(-1, position), tau[:, None]], dim=-1)
    return torch.maximum(thresholds, tau[:, None])


def _bracket(masses: torch.Tensor, top_p: torch.Tensor, vocab: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(up, low, bound_low, bound_high): candidate columns with the threshold provably in
    [thresholds[low], thresholds[up]) whatever the masses' errors, and top_p * total at both ends
    of the total's error bound."""
    error = sum_error(masses, vocab)
    total, total_error = masses[:, -1], error[:, -1]
    bound_low, bound_high = top_p * (total - total_error), top_p * (total + total_error)
    up = ((masses + error) < bound_low[:, None]).sum(dim=-1) - 1  # column 0 (+inf, mass 0) qualifies
    low = ((masses - error) < bound_high[:, None]).sum(dim=-1).clamp_(max=masses.shape[1] - 1)
    return up.clamp_(min=0), low, bound_low, bound_high


def _scan(values: torch.Tensor, z_max: torch.Tensor, above: torch.Tensor, above_error: torch.Tensor,
          bound_low: torch.Tensor, bound_high: torch.Tensor, count: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """values: float32 [R, W] the bracket's ids sorted descending (-inf padding), `count` real ones;
    above: float64 [R] the mass above the bracket. Returns (tau, sure): the first value where the
    mass from the top reaches the bound, and whether it is the same at both ends of the errors."""
    mass = torch.cumsum(torch.exp(values - z_max[:, None]).to(torch.float64), dim=-1)
    early = ((above + above_error)[:, None] + mass < bound_low[:, None]).sum(dim=-1)
    late = ((above - above_error)[:, None] + mass < bound_high[:, None]).sum(dim=-1)
    last = values.shape[1] - 1
    tau_early = values.gather(-1, early.clamp(max=last)[:, None]).squeeze(-1)
    tau_late = values.gather(-1, late.clamp(max=last)[:, None]).squeeze(-1)
    sure = (late < count) & (tau_early == tau_late)
    return tau_late, sure


def _extract(z: torch.Tensor, low: torch.Tensor, high: torch.Tensor, cap: int, compiled: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The values low <= z < high, z > -inf, of each row with at most `cap` of them, sorted
    descending into [R, W] (-inf padding); and the count per row (all of them, also over cap).
    compiled: the C++ pass (`native.range_op`) where it is built (the same tensors)."""
    takes = native.rows_layout(z, torch.float32) and all(native.vector_layout(b, torch.float32) for b in (low, high))
    op = native.range_op() if compiled and takes else None
    if op is not None:
        values, count = op(z, low, high, cap)
        listed = count <= cap
        width = int(torch.where(listed, count, 0).max()) if z.shape[0] else 0
        values = values[:, :max(width, 1)].masked_fill(~listed[:, None], NEG_INF)
        return sorted_descending(values), count  # masked_fill made it contiguous
    mask = z >= low[:, None]
    mask &= z < high[:, None]
    if bool(torch.isneginf(low).any()):
        mask &= z > NEG_INF
    flat = nonzero_ids(mask.view(-1))  # sparse: a 64-bit word scan first
    del mask
    rows, cols = flat // z.shape[1], flat % z.shape[1]
    count = torch.bincount(rows, minlength=z.shape[0])
    start = torch.cumsum(count, dim=0) - count
    slot = torch.arange(rows.numel(), device=z.device) - start[rows]
    listed = count <= cap
    if not bool(listed.all()):
        keep = listed[rows]
        rows, cols, slot = rows[keep], cols[keep], slot[keep]
    width = int(torch.where(listed, count, 0).max()) if z.shape[0] else 0
    values = torch.full((z.shape[0], max(width, 1)), NEG_INF, dtype=z.dtype, device=z.device)
    values[rows, slot] = z[rows, cols]
    return sorted_descending(values), count


def sample_dense(z: torch.Tensor, z_max: torch.Tensor, lower: torch.Tensor, tau: torch.Tensor,
                 top_p: torch.Tensor, keys: torch.Tensor, row_mass: torch.Tensor | None = None,
                 p_buffer: torch.Tensor | None = None, config: TorchStepConfig = DEFAULT, compiled: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 10-11 for flat rows (too many winnable ids for a candidate list).

    Parameters
    ----------
    z: float32 [R, V], after temperature (-inf = removed).
    z_max: float32 [R], each row's max.
    lower: float32 [R], ids below it cannot win (`select.win_floor`).
    tau: float32 [R], the threshold so far (min-p, top-k; -inf = none).
    top_p: float64 [R] (1 = off).
    keys: int64 [R], the rows' noise keys (`rng.row_key`).
    row_mass: float64 [R], the whole row's mass if known (it only places the candidate thresholds).
    p_buffer: where p = exp(z - z_max) is written (see `select.relative_probs`).
    config: the dense route's tunables.
    compiled: the full-row passes compiled (the sampler's choice; the same tokens either way).

    Returns
    -------
    (tokens int64 [R], tau float32 [R]): the Gumbel argmax over the kept ids, and tau raised to
    the exact top-p threshold."""
    p = relative_probs(z, z_max, p_buffer)
    if row_mass is None:  # it only places the candidates: a float32 sum of p is close enough
        row_mass = p.sum(dim=-1).to(torch.float64)
    key32 = rng.to_int32_words(keys)
    thresholds = candidate_thresholds(z, z_max, tau, top_p, row_mass, config)
    rows_mask = top_p < 1.0
    floor = torch.where(rows_mask, thresholds[:, config.dense_proxy_column], tau)
    masses, odds = threshold_pass(p, z, thresholds, key32, floor, config, compiled)
    tau = top_p_from_masses(p, z, z_max, tau, top_p, thresholds, masses, config, compiled)
    invalid = floor < tau  # S_lo must come from kept ids only
    if bool(invalid.any()):
        rows = invalid.nonzero().squeeze(-1)
        odds = odds.index_put((rows,), threshold_pass(p[rows], z[rows], thresholds[rows], key32[rows], tau[rows],
                                                      config, compiled)[1])
    return race_argmax(p, z, z_max, torch.maximum(tau, lower), keys, odds, config, compiled), tau


def top_p_from_masses(p: torch.Tensor, z: torch.Tensor, z_max: torch.Tensor, tau: torch.Tensor,
                      top_p: torch.Tensor, thresholds: torch.Tensor, masses: torch.Tensor,
                      config: TorchStepConfig = DEFAULT, compiled: bool = False) -> torch.Tensor:
    """tau (float32 [R]) raised to the top-p threshold on the rows with top_p < 1: exactly the
    definition's kept set. thresholds, masses: `candidate_thresholds` and `threshold_pass`."""
    rows_mask = top_p < 1.0
    up, low, bound_low, bound_high = _bracket(masses, top_p, z.shape[1])
    upper = torch.where(rows_mask, thresholds.gather(-1, up[:, None]).squeeze(-1), POS_INF)
    lower = torch.where(rows_mask, thresholds.gather(-1, low[:, None]).squeeze(-1), POS_INF)
    values, count = _extract(z, lower, upper, config.dense_bracket_cap, compiled)
    histogram = rows_mask & (count > config.dense_bracket_cap)
    scanned = rows_mask & ~histogram
    above = masses.gather(-1, up[:, None]).squeeze(-1)
    tau_p, sure = _scan(values, z_max, above, sum_error(above, z.shape[1]), bound_low, bound_high, count)
    unsure = scanned & ~sure
    if bool(unsure.any()):  # masses summed as select.kept_mass does, for the uncertain rows
        rows = unsure.nonzero().squeeze(-1)
        total, exact_above = exact_masses(z[rows], z_max[rows], tau[rows], upper[rows], config)
        bound = top_p[rows] * total
        tau_exact, found = _scan(values[rows], z_max[rows], exact_above, torch.zeros_like(total), bound, bound,
                                 count[rows])
        tau_p = tau_p.index_put((rows,), tau_exact)
        missed = torch.zeros_like(histogram).index_put_((rows,), ~found)  # cannot happen: a safety net
        histogram, scanned = histogram | missed, scanned & ~missed
    out = torch.where(scanned, torch.maximum(tau, tau_p), tau)
    if bool(histogram.any()):
        rows = histogram.nonzero().squeeze(-1)
        out[rows] = torch.maximum(tau[rows], select.top_p_by_histogram(z[rows], z_max[rows], tau[rows], None,
                                                                       top_p[rows], config))
    return out


def exact_masses(z: torch.Tensor, z_max: torch.Tensor, tau: torch.Tensor, upper: torch.Tensor,
                 config: TorchStepConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 [R] masses of z >= tau and of z >= upper, summed as `select.kept_mass` does (the
    recheck of rows whose top-p answer changes inside the error bound)."""
    return select.kept_mass(z, z_max, tau, config=config), select.kept_mass(z, z_max, upper, config=config)


def race_argmax(p: torch.Tensor, z: torch.Tensor, z_max: torch.Tensor, threshold: torch.Tensor,
                keys: torch.Tensor, odds: torch.Tensor, config: TorchStepConfig = DEFAULT,
                compiled: bool = False) -> torch.Tensor:
    """The Gumbel argmax over the ids with z >= threshold (p = `select.relative_probs(z, z_max)`, z float32
    [R, V], z_max, threshold float32 [R], keys int64 [R]), given odds (float32 [R]): p u / (1 - u)
    of some kept id, so that z_max + log(odds) bounds the winning score from below (less rounding).
    Returns int64 [R]. compiled: the race pass and the noise blocks compiled (the sampler's choice)."""
    # An id reaches the winning score only if 1 - u <= p exp(z_max - S_lo + margin), with
    # S_lo = z_max + log(odds) - margin: the margins cover the odds', p's, g's and the scores'
    # rounding (each far below gumbel.margin); RACE_SLACK covers p's and the products' rounding.
    odds64 = odds.to(torch.float64)
    estimate = z_max.to(torch.float64) + odds64.log()
    slack = 2 * gumbel.margin(estimate.abs())
    scale = (_TWO_POW_24 * (1.0 + RACE_SLACK)) * torch.exp(slack) / odds64
    count, lowest, highest = race_pass(p, z, threshold, rng.to_int32_words(keys), scale.to(torch.float32), config,
                                       compiled)
    rows = torch.arange(z.shape[0], device=z.device)
    pair = torch.stack([lowest, highest], dim=-1).clamp_(0, z.shape[1] - 1)
    pair_scores = gumbel.exact_scores(z[rows[:, None], pair], keys[:, None], pair)
    second = pair_scores[:, 1] > pair_scores[:, 0]  # ties: the lower id
    token = torch.where(second, pair[:, 1], pair[:, 0])
    crowded = (count > 2) | (count < 1) | ~torch.isfinite(scale) | (odds <= 0)
    if bool(crowded.any()):
        rows_c = crowded.nonzero().squeeze(-1)
        token[rows_c] = gumbel.gumbel_argmax_dense(z[rows_c], threshold[rows_c], keys[rows_c], config.dense_block,
                                                   compiled)
    return token
