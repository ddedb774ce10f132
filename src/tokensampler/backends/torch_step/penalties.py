"""Repetition, frequency and presence penalties (step 5), in the reference's float32 order, at the
ids each row has seen (`stages.penalty_cells` / `stages.apply_penalties` write them)."""

from __future__ import annotations

import torch

from .indexing import nonzero_ids, read_at


def penalty_edits(z: torch.Tensor, rows: list[int], slots: list[int], prompt_mask: torch.Tensor,
                  output_counts: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                  presence: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Step 5 at the ids each slot has seen, without writing them.

    Parameters
    ----------
    z: float32 [B, V], the rows' values before penalties.
    rows, slots: the rows of `z` to penalise and the slot each reads its history from.
    prompt_mask: bool [S, V]; output_counts: int32 [S, V]; repetition, frequency, presence:
        float32 [S] (the state's columns).

    Returns
    -------
    (row_index int64 [H], ids int64 [H], values float32 [H]): the penalised value of every seen
    (row, id), in the reference's float32 order; None if no row has seen an id. One seen-mask for
    all rows, its hits found by `nonzero_ids`, then the arithmetic over the hits only."""
    vocab = z.shape[1]
    seen = torch.empty((len(slots), vocab), dtype=torch.bool, device=z.device)
    for i, slot in enumerate(slots):  # no gathered copy of the int32 counts (a large temporary)
        seen[i].copy_(output_counts[slot])  # int -> bool: count != 0 (the fastest form measured)
        seen[i] |= prompt_mask[slot]
    hits = nonzero_ids(seen.view(-1))  # flat positions in [len(slots), V]
    del seen
    if hits.numel() == 0:
        return None
    member, ids = hits // vocab, hits % vocab
    slot_index = torch.as_tensor(slots, dtype=torch.int64, device=z.device)[member]
    row_index = torch.as_tensor(rows, dtype=torch.int64, device=z.device)[member]
    values = read_at(z, row_index, ids)
    counts = output_counts.view(-1).take(slot_index * output_counts.stride(0) + ids).to(torch.float32)
    r = repetition[slot_index]
    values = torch.where(values > 0, values / r, values * r)
    values = values - frequency[slot_index] * counts
    return row_index, ids, values - presence[slot_index] * (counts > 0).to(torch.float32)
