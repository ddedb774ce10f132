"""The definition's stages, each written once in torch, composed by every torch-side step.

Steps 1 and 3-5.1 of docs/semantics.md are *edits* of a float32 `z` (padding and NaN removed, ids
removed, bias added, penalties and DRY applied); steps 8-10 are *filters* (min-p, top-k, top-p) that keep
a prefix of the ids ordered by `z / T`. Each edit below is one function, in place on `z`, over the
rows a `StageRows` describes; each edit that touches few ids per row also has a *cell* form (which
(row, id) it changes and to what), so a route can write its cells into the caller's logits and
restore them (the torch step's direct route). The composers:

- `TorchStep` (`step.py`): its block route runs `apply_edits` on each block's workspace; its
  direct route takes plans whose edits all have a cell form (`CELL_EDITS`) and runs
  `edit_cells` / `restore_cells` on the caller's logits;
- `speculative.target_rows` (rejection mode): `apply_edits` on a fresh copy of the rows;
- `SplitStep` (`backends/split/step.py:_processed_z`): `apply_edits` on a rank's slice (the rows'
  state is the slice's; bad words and the token bitmask are read at global ids from `offset`).

The filters have one torch implementation, `filter_and_draw`: `candidates.sample_rows` (temperature,
the three thresholds as one per row, the Gumbel argmax), on the parameter columns `filter_columns`
builds (the only place they are built). The split step computes the same thresholds by exact
merges over its ranks (`backends/split`), the Triton kernels mirror everything bit for bit
(`backends/triton/kernels.py`), and `reference.py` is the separate oracle.

Which stages a step runs is the plan's (`core.plan.StepPlan.edits`, `.filters`); a stage's
function also skips a block whose rows do not need it (a host test of the rows' parameters).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ...core import rng
from ...core.constants import NEG_INF
from ...core.params import SamplingParams
from ...core.plan import EDIT_STAGES, has_penalties
from ...state import SamplerState
from . import candidates, dry, masking, penalties
from .config import DEFAULT, TorchStepConfig
from .indexing import read_at, write_at
from .routes import Draw, Handoff, RowFacts, Values

Cells = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (row index int64 [H], column int64 [H], value float32 [H])


@dataclass
class StageRows:
    """The rows of a `z` [R, width] that the stages edit, and what they read.

    state: the sampler's state (whole vocabulary, or one rank's slice: its columns are z's).
    slots: int64 [R] on the state's device, the slot of each row of z.
    params: the rows' parameters (the host mirror), one per row.
    token_bitmask: int32 [R, W], the call's mask at these rows (global ids), or None.
    dense_buffer: a callable giving a reused float32 buffer of >= n elements (the bitmask's
        table lookup, `masking.remove_by_bitmask`), or None.
    compiled: the sampler's compile choice (the penalties' seen ids and the bitmask by the C++ passes).
    helpers: the C++ passes' rows shared with up to this many helper threads that are never waited
        for (`TorchStepConfig.wait_free_rows`, `native_rows.h`); -1: one torch parallel region.
    """

    state: SamplerState
    slots: torch.Tensor
    params: Sequence[SamplingParams]
    token_bitmask: torch.Tensor | None = None
    dense_buffer: Callable[[int], torch.Tensor] | None = None
    compiled: bool = False  # the sampler compiles: its C++ passes too (`native`)
    helpers: int = -1

    @property
    def offset(self) -> int:
        """The global id of z's column 0 (a split rank's first id; 0 unsplit)."""
        return self.state.layout.offset

    def where(self, predicate: Callable[[SamplingParams], bool]) -> list[int]:
        """The rows whose parameters satisfy `predicate`."""
        return [r for r, p in enumerate(self.params) if predicate(p)]


# ------------------------------------------------------------------ step 1
def clean_logits(out: torch.Tensor, logits: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
    """Step 1 into `out` (float32 [R, width]): `float32(logits[:, :width])`, NaN at -inf, and the
    columns where `padding` (bool [width], or None) is True at -inf (unsplit, padding is the
    columns past `width = V`, dropped). Returns `out`; no allocation."""
    z = masking.prepare_logits_into(out, logits)
    return z if padding is None else z.masked_fill_(padding[None, :], NEG_INF)


# ------------------------------------------------------------------ step 3: removals
def remove_disallowed(z: torch.Tensor, rows: StageRows) -> None:
    """`allowed_token_ids`: every id outside a row's allowed set to -inf (rows that have one)."""
    if any(p.allowed_token_ids is not None for p in rows.params) and rows.state.allowed_mask is not None:
        z.masked_fill_(~rows.state.allowed_mask[rows.slots], NEG_INF)


def remove_by_bitmask(z: torch.Tensor, rows: StageRows) -> None:
    """The call's `token_bitmask`: every id whose bit is 0 to -inf (bit j of word w is id 32 w + j,
    read from z's first global id on)."""
    if rows.token_bitmask is not None:
        masking.remove_by_bitmask(z, rows.token_bitmask, rows.offset, buffer=rows.dense_buffer,
                                  compiled=rows.compiled)


def bad_word_cells(z: torch.Tensor, rows: StageRows) -> Cells | None:
    """`bad_words_token_ids` as cells: (row, column, -inf) of every id a row's bad words remove after
    its recorded output (vLLM's rule), among z's columns; None if there is none."""
    st = rows.state
    if st.bad_words is None or not any(p.bad_words_token_ids for p in rows.params):
        return None
    recent = None if st.recent_tokens is None else st.recent_tokens[rows.slots]
    cells = masking.banned_cells(masking.banned_tokens(st.bad_words[rows.slots], recent), rows.offset, z.shape[1])
    if cells is None:
        return None
    return cells[0], cells[1], torch.full(cells[0].shape, NEG_INF, dtype=z.dtype, device=z.device)


def remove_bad_words(z: torch.Tensor, rows: StageRows) -> None:
    """`bad_words_token_ids`: the ids `bad_word_cells` names to -inf."""
    cells = bad_word_cells(z, rows)
    if cells is not None:
        write_at(z, *cells)


def remove_stop_ids(z: torch.Tensor, rows: StageRows) -> None:
    """`min_tokens`: while a row has generated fewer, its stop and EOS ids to -inf."""
    st = rows.state
    if any(p.min_tokens > 0 for p in rows.params) and st.stop_mask is not None:
        s = rows.slots
        below_min_tokens = st.output_len[s] < st.min_tokens[s]
        z.masked_fill_(st.stop_mask[s] & below_min_tokens[:, None], NEG_INF)


# ------------------------------------------------------------------ step 4
def add_logit_bias(z: torch.Tensor, rows: StageRows) -> None:
    """`logit_bias`: `z += bias` on the rows that have one (float32, the state's clamped values)."""
    biased = rows.where(lambda p: bool(p.logit_bias))
    if biased and rows.state.logit_bias is not None:
        z[biased] += rows.state.logit_bias[rows.slots[biased]]


# ------------------------------------------------------------------ step 5
def penalty_cells(z: torch.Tensor, rows: StageRows) -> Cells | None:
    """The three penalties as cells: the penalised value of every id a penalised row has seen
    (prompt or output), computed from z as it is now, in the reference's float32 order; None if no
    row has seen an id. Elsewhere the penalties change no value (up to the sign of a zero)."""
    st = rows.state
    penalised = rows.where(has_penalties)
    if not penalised:
        return None
    slot_list = rows.slots.tolist()
    return penalties.penalty_edits(z, penalised, [slot_list[r] for r in penalised], st.prompt_mask,
                                   st.output_counts, st.repetition, st.frequency, st.presence,
                                   compiled=rows.compiled, helpers=rows.helpers)


def apply_penalties(z: torch.Tensor, rows: StageRows) -> None:
    """Repetition, frequency and presence penalties (in that order) on the rows that have them."""
    cells = penalty_cells(z, rows)
    if cells is not None:
        write_at(z, *cells)


# ------------------------------------------------------------------ step 5.1
def dry_cells(z: torch.Tensor, rows: StageRows) -> Cells | None:
    """DRY as cells: the penalised value of every id that would extend a repeat of a DRY row's
    history (`dry.penalised_cells`), computed from z as it is now; None if no id is penalised."""
    st = rows.state
    on = rows.where(lambda p: p.dry)
    if not on or st.dry_history is None:
        return None
    slots = rows.slots[on] if len(on) < len(rows.params) else rows.slots
    return dry.penalised_cells(z, on, [rows.params[r] for r in on], st.dry_history[slots], rows.offset,
                               st.layout.real_width)


def apply_dry(z: torch.Tensor, rows: StageRows) -> None:
    """DRY (step 5.1) on the rows that have it: the ids `dry_cells` names to their penalised values."""
    cells = dry_cells(z, rows)
    if cells is not None:
        write_at(z, *cells)


# ------------------------------------------------------------------ composing the edits
EDITS: dict[str, Callable[[torch.Tensor, StageRows], None]] = {
    "allowed_ids": remove_disallowed,
    "token_bitmask": remove_by_bitmask,
    "bad_words": remove_bad_words,
    "min_tokens": remove_stop_ids,
    "logit_bias": add_logit_bias,
    "penalties": apply_penalties,
    "dry": apply_dry,
}
# one implementation per edit flag of the plan, in the definition's order (tests/torch_step/test_stages.py)

# the edits with a cell form: few ids per row, so the direct route writes them into the caller's logits
CELL_EDITS: dict[str, Callable[[torch.Tensor, StageRows], Cells | None]] = {
    "bad_words": bad_word_cells,
    "penalties": penalty_cells,
    "dry": dry_cells,
}


def apply_edits(z: torch.Tensor, rows: StageRows, names: Sequence[str]) -> torch.Tensor:
    """Steps 3-5 in place on `z` (float32 [R, width], step 1 done): the edits `names` (a plan's
    `edits(...)`), in the definition's order. Returns z."""
    for name in EDIT_STAGES:
        if name in names:
            EDITS[name](z, rows)
    return z


def edit_cells(z: torch.Tensor, rows: StageRows, names: Sequence[str]) -> list[Cells]:
    """The edits `names` (each in `CELL_EDITS`) written into `z` in the definition's order, each
    computed from z as the previous ones left it (as `apply_edits` does). Returns what
    `restore_cells` needs to put the original values back: (row, column, value before) per edit."""
    undo = []
    for name in EDIT_STAGES:
        if name in names:
            cells = CELL_EDITS[name](z, rows)
            if cells is not None:
                undo.append((cells[0], cells[1], read_at(z, cells[0], cells[1])))
                write_at(z, *cells)
    return undo


def restore_cells(z: torch.Tensor, undo: list[Cells]) -> None:
    """Undo `edit_cells`: the values before each edit written back, the last edit first."""
    for row_index, ids, before in reversed(undo):
        write_at(z, row_index, ids, before)


# ------------------------------------------------------------------ steps 7-11: the filters
def filter_columns(state: SamplerState, slots: torch.Tensor, params: Sequence[SamplingParams],
                   config: TorchStepConfig = DEFAULT,
                   dense_buffer: Callable[[int], torch.Tensor] | None = None,
                   compiled: bool = False, taken: Counter | None = None, full_row: bool = False
                   ) -> candidates.RowColumns:
    """The parameter columns of sampled rows (slots int64 [R], their params) for `filter_and_draw`:
    temperature, min-p, top-k, top-p, the noise keys (seed, position, stream), and which filters
    some row needs; `compiled`: the full-row passes through the compile cache (the sampler's choice);
    `taken`: a counter of the thresholds routes run (the torch step's record); `full_row`: some row
    has a full-row stage (`extra_filters.needed`)."""
    st = state
    return candidates.RowColumns(
        temperature=st.temperature[slots], min_p=st.min_p[slots], top_k=st.top_k[slots], top_p=st.top_p[slots],
        keys=rng.row_key(st.seed[slots], st.position[slots], st.stream[slots]),
        any_min_p=any(p.min_p > 0 for p in params), any_top_k=any(p.top_k > 0 for p in params),
        any_top_p=any(p.top_p < 1.0 for p in params), dense_buffer=dense_buffer, config=config,
        compiled=compiled, taken=taken, any_full_row=full_row)


def filter_and_draw(z: torch.Tensor, z_max: torch.Tensor, cols: candidates.RowColumns, *, exact_threshold: bool,
                    values: Values = Values.IN_PLACE, facts: RowFacts | None = None) -> Draw | Handoff:
    """Steps 7-11 for sampled rows: temperature, min-p, top-k and top-p as one threshold per row,
    and the Gumbel argmax over the kept ids (`candidates.sample_rows`, which documents the arguments).
    Returns `Draw(tokens int64 [R], tau float32 [R])`, the kept set being {i : z_i / T >= tau}; read
    where divided (`values`), a `Handoff` when the rows need z / T written out (run them in place)."""
    return candidates.sample_rows(z, z_max, cols, exact_threshold=exact_threshold, values=values, facts=facts)
