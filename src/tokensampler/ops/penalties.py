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
    counts = output_counts.to(torch.float32)
    seen_out = output_counts > 0
    r = repetition[:, None]
    penalised = torch.where(z > 0, z / r, z * r)
    z = torch.where(prompt_mask | seen_out, penalised, z)
    z = z - frequency[:, None] * counts
    return z - presence[:, None] * seen_out.to(torch.float32)
