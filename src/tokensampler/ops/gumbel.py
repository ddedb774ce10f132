"""The Gumbel argmax of step 11, with noise from `rng` keyed by (seed, position, id, stream)."""

from __future__ import annotations

import torch

from .. import rng

NEG_INF = float("-inf")


def gumbel_argmax(z: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  streams: torch.Tensor) -> torch.Tensor:
    """z: float32 [B, V] with removed ids at -inf; seeds, positions, streams: int64 [B].

    Returns int64 [B]: per row the id with the largest z + g among ids with z > -inf, the lowest
    id on ties (torch.argmax returns the first maximum).
    """
    keys = rng.row_key(seeds, positions, streams)[:, None]
    ids = torch.arange(z.shape[-1], device=z.device)[None, :]
    score = z + rng.gumbel_from_bits(rng.random_bits(keys, ids))
    score = score.masked_fill_(torch.isneginf(z), NEG_INF)
    return score.argmax(dim=-1)
