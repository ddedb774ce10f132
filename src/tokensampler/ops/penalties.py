"""Repetition, frequency and presence penalties (step 5), in the reference's float32 order."""

from __future__ import annotations

import torch


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
    for row, slot in zip(rows, slots):
        counts_row = output_counts[slot]
        ids = torch.nonzero(prompt_mask[slot] | (counts_row > 0)).squeeze(-1)
        if ids.numel() == 0:
            continue
        values = z[row, ids]
        counts = counts_row[ids]
        r = repetition[slot]
        values = torch.where(values > 0, values / r, values * r)
        values = values - frequency[slot] * counts.to(torch.float32)
        z[row, ids] = values - presence[slot] * (counts > 0).to(torch.float32)
    return z
