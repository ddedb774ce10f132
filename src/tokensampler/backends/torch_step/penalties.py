"""Repetition, frequency and presence penalties (step 5), in the reference's float32 order, at the
ids each row has seen (`stages.penalty_cells` / `stages.apply_penalties` write them)."""

from __future__ import annotations

import torch

from . import native
from .indexing import nonzero_ids, read_at


def penalty_edits(z: torch.Tensor, rows: list[int], slots: list[int], prompt_mask: torch.Tensor,
                  output_counts: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                  presence: torch.Tensor, compiled: bool = False, helpers: int = -1
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Step 5 at the ids each slot has seen, without writing them.

    Parameters
    ----------
    z: float32 [B, V], the rows' values before penalties.
    rows, slots: the rows of `z` to penalise and the slot each reads its history from.
    prompt_mask: bool [S, V]; output_counts: int32 [S, V]; repetition, frequency, presence:
        float32 [S] (the state's columns).
    compiled: the sampler compiles: the seen ids by the C++ pass (`native.seen_op`) where it is built.
    helpers: the C++ pass's rows shared with up to this many helper threads never waited for
        (`native_rows.h`); -1: one torch parallel region.

    Returns
    -------
    (row_index int64 [H], ids int64 [H], values float32 [H]): the penalised value of every seen
    (row, id), in the reference's float32 order; None if no row has seen an id. One seen-mask for
    all rows, its hits found by `nonzero_ids` (or, compiled, the C++ pass's one read of the two
    rows), then the arithmetic over the hits only. Compiled, with the C++ pass built, one call does
    both (`native.penalty_op`: the same values, each operation rounded as torch rounds it)."""
    op = native.penalty_op() if compiled and _native_layouts(z, prompt_mask, output_counts) else None
    if op is not None:
        as_index = lambda values: torch.as_tensor(values, dtype=torch.int64, device=z.device)  # noqa: E731
        row_index, ids, values = op(z, as_index(rows), as_index(slots), prompt_mask, output_counts,
                                    repetition, frequency, presence, helpers)
        return None if ids.numel() == 0 else (row_index, ids, values)
    member, ids = seen_ids(prompt_mask, output_counts, slots, z.shape[1], compiled)
    if ids.numel() == 0:
        return None
    slot_index = torch.as_tensor(slots, dtype=torch.int64, device=z.device)[member]
    row_index = torch.as_tensor(rows, dtype=torch.int64, device=z.device)[member]
    values = read_at(z, row_index, ids)
    counts = output_counts.view(-1).take(slot_index * output_counts.stride(0) + ids).to(torch.float32)
    r = repetition[slot_index]
    values = torch.where(values > 0, values / r, values * r)
    values = values - frequency[slot_index] * counts
    return row_index, ids, values - presence[slot_index] * (counts > 0).to(torch.float32)


def _native_layouts(z: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor) -> bool:
    return (native.rows_layout(z, torch.float32) and native.rows_layout(prompt_mask, torch.bool)
            and native.rows_layout(output_counts, torch.int32) and prompt_mask.shape[1] >= z.shape[1])


def seen_ids(prompt_mask: torch.Tensor, output_counts: torch.Tensor, slots: list[int], vocab: int,
             compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(member int64 [H], ids int64 [H]): every id < vocab that slots[member] has seen (prompt mask
    or output count != 0), slot after slot, ids ascending."""
    takes = native.rows_layout(prompt_mask, torch.bool) and native.rows_layout(output_counts, torch.int32)
    op = native.seen_op() if compiled and takes else None
    if op is not None:
        return op(prompt_mask[:, :vocab], output_counts[:, :vocab],
                  torch.as_tensor(slots, dtype=torch.int64, device=prompt_mask.device))
    seen = torch.empty((len(slots), vocab), dtype=torch.bool, device=prompt_mask.device)
    for i, slot in enumerate(slots):  # no gathered copy of the int32 counts (a large temporary)
        seen[i].copy_(output_counts[slot, :vocab])  # int -> bool: count != 0 (the fastest form measured)
        seen[i] |= prompt_mask[slot, :vocab]
    hits = nonzero_ids(seen.view(-1))  # flat positions in [len(slots), vocab]
    return hits // vocab, hits % vocab

