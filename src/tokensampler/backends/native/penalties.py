"""Repetition, frequency and presence penalties (step 5), in the reference's float32 order."""

from __future__ import annotations

import torch

from .indexing import nonzero_ids, read_at, write_at


def apply_penalties(z: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """z: float32 [B, V]; prompt_mask: bool [B, V]; output_counts: int [B, V];
    repetition, frequency, presence: float32 [B].

    Repetition on ids seen in the prompt or the output: z / r if z > 0 else z * r; then
    z -= frequency * count; then z -= presence * [count > 0]. Returns a new tensor.
    """
    return apply_penalties_(z.clone(), prompt_mask, output_counts, repetition, frequency, presence)


def apply_penalties_(z: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                     repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """`apply_penalties` in place on `z`, with temporaries of the size of one row block."""
    seen_out = output_counts > 0
    r = repetition[:, None]
    penalised = torch.where(z > 0, z / r, z * r)
    z.copy_(torch.where(prompt_mask | seen_out, penalised, z))
    del penalised
    z.sub_(frequency[:, None] * output_counts.to(torch.float32))
    return z.sub_(presence[:, None] * seen_out.to(torch.float32))


def apply_penalties_rows_(z: torch.Tensor, rows: list[int], slots: list[int], prompt_mask: torch.Tensor,
                          output_counts: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                          presence: torch.Tensor) -> torch.Tensor:
    """`apply_penalties` in place on the rows `rows` of `z`, reading the state of `slots` directly,
    and only at the ids the slot has seen (prompt or output): elsewhere the penalties subtract a
    zero, which leaves every value unchanged (up to the sign of a zero). repetition, frequency,
    presence: float32 [S] state columns."""
    edits = penalty_edits(z, rows, slots, prompt_mask, output_counts, repetition, frequency, presence)
    if edits is not None:
        write_at(z, *edits)
    return z


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
