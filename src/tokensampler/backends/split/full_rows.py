"""The full-row samplers on a vocabulary split: dynamic temperature (step 7), top-n-sigma, typical-p,
epsilon, eta, XTC and Mirostat v2 (10.1-10.6 of docs/semantics.md).

Their kept sets need quantities of a row's whole kept set (an entropy, a standard deviation, sums in
the canonical order, typical-p's score order), so no small per-rank summary merges them exactly.
The split gathers those rows instead: for the sampled rows of the step that turn one of them on
(the plan's parameters decide, so every rank picks the same rows), every rank sends its slice of
their processed z (after steps 1-5 and the +inf rule) in one all-gather of float32 [F, Vp / W]
through the step's `Exchange`, puts the whole rows back together in global id order (rank r's
columns at `[r Vp / W, (r + 1) Vp / W)`, cut at V: the padding dropped), and runs the torch step's
own full-row route on them (`torch_step.extra_filters.draw_rows`: T_dyn, min-p/top-k/top-p with the
exact threshold, the six filters, the Gumbel argmax with the definition's noise, keyed by the
column of the whole row, which is the global id). The stages are written once; every rank computes
the same tokens from the same rows, equal to the unsplit sampler's.

`draw_rows` reads only per-slot columns of the state (temperature, seed, position, stream, min-p,
top-k, top-p, Mirostat's mu), which a split state holds whole on every rank, and leaves each
Mirostat row's surprise in `state.mirostat_surprise` on every rank: `record_tokens` (step 13) turns
it into the same mu everywhere.

What comes back to this rank's slice: the token (global id), the final row's values on this
rank's columns (the slice of the whole final row, its padding at -inf) for processed log-probs,
the final value at the token, and, in the processed_logprobs mode, the log-sum-exp of the final
row (computed from the whole row, no exchange). In the raw modes the raw value at the token is on
the rank that holds it: one more all-gather of float64 [F].

Bytes: with F such rows, W ranks and Vp the padded vocabulary, each rank sends 4 F Vp / W bytes
and receives 4 F Vp (W - 1) / W (plus 8 F sent, 8 F (W - 1) received in the raw logprobs modes);
nothing when no sampled row turns a full-row sampler on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ...core.constants import NEG_INF
from ...core.params import SamplingParams
from ...core.plan import full_row_stages
from ...parallel.transport import Exchange
from ...state import SamplerState
from ..torch_step import extra_filters
from . import merge as sel


class SplitSlice(Protocol):
    """What this module reads of the split step (`step.SplitStep`): its exchange, state and slice."""

    exchange: Exchange
    state: SamplerState
    vocab_size: int
    width: int
    real_width: int
    offset: int


def full_row_split(rows: Sequence[int], row_params: Sequence[SamplingParams]) -> tuple[list[int], list[int]]:
    """(full, plain): the batch rows among `rows` that turn a full-row sampler on, and the others."""
    full = [b for b in rows if full_row_stages(row_params[b])]
    return full, [b for b in rows if not full_row_stages(row_params[b])]


@dataclass
class RowResults:
    """The step's per-row results [B] on this rank, written in place: tokens (global ids), valid,
    the raw and final values at the token (float64), the final values on this rank's columns
    (float32 [B, width], or None where no processed mode asks), and the log-sum-exp (float64 [2, B],
    `merge.merge_logsumexp`'s, or None)."""

    tokens: torch.Tensor
    valid: torch.Tensor
    raw_at_token: torch.Tensor
    final_at_token: torch.Tensor
    final: torch.Tensor | None
    lse: torch.Tensor | None


def whole_rows(split: SplitSlice, part: torch.Tensor) -> torch.Tensor:
    """The whole rows [F, V] of this rank's slices `part` [F, width]: one all-gather, the ranks'
    columns side by side in rank order (global id order), the padding cut off."""
    gathered = split.exchange.all_gather(part)  # [W, F, width]
    return gathered.permute(1, 0, 2).reshape(part.shape[0], -1)[:, :split.vocab_size].contiguous()


def local_columns(split: SplitSlice, whole: torch.Tensor) -> torch.Tensor:
    """This rank's columns [F, width] of whole rows [F, V]; its padding columns at -inf."""
    part = torch.full((whole.shape[0], split.width), NEG_INF, dtype=whole.dtype, device=whole.device)
    part[:, :split.real_width] = whole[:, split.offset:split.offset + split.real_width]
    return part


def sample_full_rows(split: SplitSlice, z: torch.Tensor, raw: torch.Tensor, index: torch.Tensor, rows: list[int],
                     row_params: Sequence[SamplingParams], z_max: torch.Tensor, raw_max: torch.Tensor,
                     raw_token: torch.Tensor, out: RowResults, mode: str | None) -> None:
    """Steps 7-11 for the sampled batch rows `rows` (each turns a full-row sampler on) of this rank's
    processed slice `z` [B, width] (+inf rule applied; `raw` the raw slice), every rank alike.

    z_max: float32 [B], the rows' global maxima with the +inf rule (0 where an id is +inf);
    raw_max, raw_token: the raw rows' global maxima and first ids (rows with no id left). Writes
    the rows' results into `out`."""
    st = split.state
    device = z.device
    r = torch.tensor(rows, dtype=torch.int64, device=device)
    slots = index[r]
    whole = whole_rows(split, z[r])
    row_max = z_max[r]
    ok = out.valid[r]
    # every kept id underflows at the request's T: no id left (the raw greedy id, invalid)
    emptied = ok & torch.isneginf(row_max / st.temperature[slots])
    live = ok & ~emptied
    whole[emptied] = NEG_INF  # their final values: z / T, every one -inf
    tokens = torch.where(ok & ~emptied, out.tokens[r], raw_token[r])
    live_rows = [i for i, alive in enumerate(live.tolist()) if alive]
    if live_rows:
        drawn, _ = extra_filters.draw_rows(whole, row_max, slots, [row_params[b] for b in rows], live_rows, st)
        tokens[live_rows] = drawn
    out.tokens[r] = tokens
    out.valid[r] = live
    at_token = whole.gather(-1, tokens[:, None]).squeeze(-1).to(torch.float64)
    out.final_at_token[r] = torch.where(live, at_token, torch.full_like(at_token, NEG_INF))
    if out.final is not None:
        out.final[r] = local_columns(split, whole)
    if mode == "processed_logprobs":
        out.lse[:, r] = torch.stack(sel.merge_logsumexp(sel.local_sumexp(whole)[None]))
    if mode is not None and mode.startswith("raw"):  # the raw value at the token, from the rank holding it
        local = tokens - split.offset
        mine = (local >= 0) & (local < split.real_width)
        here = raw[r].gather(-1, local.clamp(0, split.width - 1)[:, None]).squeeze(-1).to(torch.float64)
        gathered = split.exchange.all_gather(torch.where(mine, here, torch.zeros_like(here)))
        owner = torch.div(tokens, split.width, rounding_mode="floor")
        out.raw_at_token[r] = torch.where(live, sel.pick_rank(gathered, owner), raw_max[r])
