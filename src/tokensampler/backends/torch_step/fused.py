"""`Route.FUSED`: steps 6-11 of every row in one C++ pass (`native_sample.cpp`), on the caller's logits.

The general routes (`step.py`, `candidates.py`) assemble a step from torch operations: each pass is a
parallel region, each small operation a dispatch, and a row's thresholds take dozens of them. The
fused pass does a row's whole work in one function, and a batch's rows are shared between the
calling thread and helper threads that are never waited for (`native_rows.h`; or torch's threads in
one parallel region):

1. one read of the row: its max (NaN and +inf noted); a greedy row's first maximum (a call's token
   bitmask is applied where each value is read: an id whose bit is 0 reads as -inf);
2. the winnable floor and min-p's floor from the max (as `select.win_floor`, `select.min_p_floor`),
   and a strided estimate of the ids above them against the list's cap (`list_cap`);
3. one read: the ids at or above the floor listed with fl(z / T), and for top-p rows whose total can
   include ids below the list, those ids counted in three bands (a bound on their mass: the exact
   value is needed only where the bound leaves the crossing undecided);
4. on the list: p = exp(v - max) by ATen's own exp kernel (the bits of the definition's torch.exp),
   min-p, top-k's k-th value, top-p's crossing found in growing upper sets of the kept ids, sorted;
5. the Gumbel argmax: approximate noise (most ids of a long list are passed over by their noise
   index alone), the definition's noise (ATen's float64 log, one call per batch) for the ids within
   the approximate scores' error margin of the best, lowest id on ties.

A row the pass cannot finish exactly (NaN or +inf, no id left, z / T overflowing or underflowing, a
list over its cap, top-k's k-th value below the list on a row whose top-p total needs the ids below
it, a crossing the tail bound leaves undecided) marks the call for the general routes, which then
run it from the start on the logits as they were. Each thread's lists grow to the longest list it has
held (at most the cap: 0.45 of a row's fp32 logits) and are kept from call to call where they are at
most half the fp32 logits of its rows (a steady batch or a single row allocates nothing, and touches
no fresh page: measured, re-allocating a 248k row's lists after other work cost 0.3 ms a call);
`scratch_bytes` is what the last call's threads held at their largest.
"""

from __future__ import annotations

import torch

from ...core import rng
from ...core.plan import StepPlan
from ...state import SamplerState
from . import logprobs, native, stages
from .config import TorchStepConfig


def available(compiled: bool, config: TorchStepConfig) -> bool:
    """Whether a step may take the fused route: a compiling sampler, `config.fused_route`, and the
    C++ pass loaded (built on first use: `native`)."""
    return compiled and config.fused_route and native.sample_op() is not None


def list_cap(vocab: int) -> int:
    """The longest list per row before the row needs the general routes: 9% of the vocabulary (at least
    1,024). At 20 bytes per listed id that is 0.45 of the row's float32 logits: a single row's lists
    stay within half a logits buffer, and a 248k-vocabulary row at T = 1 (about 15,500 ids above its
    winnable floor) is listed."""
    return max(1024, 9 * vocab // 100)


def sample_rows(z: torch.Tensor, slots: torch.Tensor, state: SamplerState,
                token_bitmask: torch.Tensor | None = None,
                raw_stats: tuple[torch.Tensor, torch.Tensor | None, int] | None = None,
                helpers: int = -1) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Steps 6-11 for every row of z.

    Parameters
    ----------
    z: float32 [B, V] on the CPU, contiguous rows: the rows after the plan's cell edits (-inf = removed).
    slots: int64 [B], each row's slot in `state` (its temperature, min-p, top-k, top-p, seed,
        position and stream).
    token_bitmask: int32 [B, >= ceil(V / 32)] in xgrammar's layout (bit j of word w allows id 32 w + j),
        or None: each id whose bit is 0 is read as removed (-inf).
    raw_stats: (maxima float32 [B, ceil(V / logprobs.CHUNK)], log_sum float32 [B] or None, lanes), no
        token bitmask: filled, for every row not marked general, with the statistics of z as raw
        scores (`logprobs.RowStats`: chunk maxima, and where lanes > 0 log S summed in ATen's order
        over that many lanes), read while each row is in cache.
    helpers: the rows shared between the calling thread and up to this many helper threads that
        sleep between calls, the caller never waiting for a helper that lost its core
        (`native_rows.h`); -1: one parallel region on torch's threads. The tokens are the same.

    Returns
    -------
    (tokens int64 [B], general bool [B], the number of rows marked general): the token of every row
    not marked general, which is exactly the definition's; a row marked general needs the general
    routes.

    Example
    -------
    >>> tokens, general, count = sample_rows(logits, torch.arange(2), state)  # doctest: +SKIP
    """
    op = native.sample_op()
    assert op is not None, "fused.sample_rows needs the C++ pass (fused.available)"
    if token_bitmask is not None and token_bitmask.stride(-1) != 1:
        token_bitmask = token_bitmask.contiguous()
    maxima, log_sum, lanes = (None, None, 0) if raw_stats is None else raw_stats
    return op(z, slots, state.temperature, state.min_p, state.top_k, state.top_p, state.seed, state.position,
              state.stream, list_cap(z.shape[1]), rng.GUMBEL_MIN, rng.GUMBEL_MAX, token_bitmask, maxima, log_sum,
              lanes, helpers)


def edited_pass(z: torch.Tensor, index: torch.Tensor, state: SamplerState, plan: StepPlan,
                token_bitmask: torch.Tensor | None, *, compiled: bool, logprobs_mode: str, helpers: int
                ) -> tuple[torch.Tensor, torch.Tensor, int, tuple[torch.Tensor, torch.Tensor | None, int] | None]:
    """`sample_rows` on z [B, V] with the plan's cell edits (`stages.edit_cells`) written into it for
    the pass and restored after it, and the raw logprobs' statistics filled where the pass can give
    them (`raw_stats_buffers`). Returns (tokens, general, count, the statistics or None). Where there
    are edits to write, the helper threads are woken first: their wake-up overlaps the edits."""
    names = plan.edits()
    undo = []
    if names:
        if helpers > 0:
            torch.ops.tokensampler_native.warm_helpers(helpers)
        edited = stages.StageRows(state, index, list(plan.rows), compiled=compiled, helpers=helpers)
        undo = stages.edit_cells(z, edited, names)
    raw_stats = raw_stats_buffers(z, plan, bool(names) or token_bitmask is not None, compiled, logprobs_mode)
    try:
        tokens, general, count = sample_rows(z, index, state, token_bitmask, raw_stats, helpers)
    finally:
        stages.restore_cells(z, undo)
    return tokens, general, count, raw_stats


def raw_stats_buffers(z: torch.Tensor, plan: StepPlan, edited: bool, compiled: bool, logprobs_mode: str
                      ) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    """Buffers for the pass to fill with the raw logprobs' statistics of every row (chunk maxima, log
    S in ATen's lane order: `logprobs.row_stats`), where the call asks raw logprobs, compiles, and the
    pass reads the raw scores (no cell edited, no token bitmask); else None."""
    if not plan.wants_logprobs or edited or not compiled or not logprobs_mode.startswith("raw"):
        return None
    rows, vocab = z.shape
    lanes = logprobs.fast_normaliser(vocab, True) if logprobs_mode == "raw_logprobs" else 0
    if logprobs_mode == "raw_logprobs" and not lanes:
        return None
    maxima = torch.empty((rows, -(-vocab // logprobs.CHUNK)), dtype=torch.float32, device=z.device)
    log_sum = torch.empty(rows, dtype=torch.float32, device=z.device) if lanes else None
    return maxima, log_sum, lanes


def scratch_bytes() -> int:
    """Bytes the last fused call's threads held in their lists, at their largest (0 where it never ran)."""
    ops = native.sample_op()
    return 0 if ops is None else int(torch.ops.tokensampler_native.scratch_bytes())
