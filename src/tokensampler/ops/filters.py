"""min-p, top-k and top-p (steps 8-10) on a batch, as masks of the ids they keep.

All three take `z` (float32 [B, V], post-temperature, removed ids at -inf) and return a new `z`
with the ids they remove set to -inf. `p = exp(z - z_max)` is the float32 relative probability.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def relative_probs(z: torch.Tensor) -> torch.Tensor:
    """p_i = exp(z_i - max_j z_j), float32 [B, V]."""
    return torch.exp(z - z.amax(dim=-1, keepdim=True))


def apply_min_p(z: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep i iff p_i >= min_p (float32 [B]); 0 keeps every id."""
    return z.masked_fill(relative_probs(z) < min_p[:, None], NEG_INF)


def apply_top_k(z: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep i iff fewer than k kept ids have a strictly larger z (int64 [B]; 0 = off).

    That is z_i >= the k-th largest z of the row, so ties at the border stay.
    """
    vocab = z.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    k_max = int(k.max()) if k.numel() else 1
    top_values = torch.topk(z, k_max, dim=-1, sorted=True).values
    kth_value = top_values.gather(-1, (k - 1)[:, None])
    return z.masked_fill(z < kth_value, NEG_INF)


def apply_top_p(z: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep i iff the float64 mass of kept ids with a strictly larger z is < top_p * total mass.

    Sort-based: the kept ids are those with z >= the z of the last sorted position whose exclusive
    cumulative mass is below the bound (a tie group's first position carries its mass above).
    """
    sorted_z = torch.sort(z, dim=-1, descending=True).values
    p_sorted = torch.exp(sorted_z - sorted_z[:, :1]).to(torch.float64)
    inclusive_mass = torch.cumsum(p_sorted, dim=-1)
    exclusive_mass = torch.nn.functional.pad(inclusive_mass[:, :-1], (1, 0))
    bound = top_p.to(torch.float64)[:, None] * inclusive_mass[:, -1:]
    n_kept = (exclusive_mass < bound).sum(dim=-1, keepdim=True).clamp(min=1)
    threshold = sorted_z.gather(-1, n_kept - 1)
    threshold = threshold.masked_fill(top_p[:, None] >= 1.0, NEG_INF)  # top_p = 1 is off
    return z.masked_fill(z < threshold, NEG_INF)
