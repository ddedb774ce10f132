"""Turning raw logits into float32 `z` with every removed id at `-inf` (steps 1 and 3)."""

from __future__ import annotations

import torch

from ...core.constants import NEG_INF
from ...core.order import saturate_posinf as _saturate


def prepare_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 copy of `logits[:, :vocab_size]` (padding dropped) with NaN set to -inf."""
    z = logits[:, :vocab_size].to(torch.float32, copy=True)
    return z.masked_fill_(torch.isnan(z), NEG_INF)


def prepare_logits_into(out: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """`prepare_logits` written into `out` (float32 [B, V]): no allocation, one in-place NaN pass."""
    source = logits[:, :out.shape[1]]
    if source.dtype == torch.float32:  # one pass: read, replace NaN, write
        return torch.nan_to_num(source, nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF, out=out)
    out.copy_(source)
    return out.nan_to_num_(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)


def saturate_posinf(z: torch.Tensor) -> torch.Tensor:
    """The +inf rule (`core.order.saturate_posinf`) in place on clean float32 rows `z` [B, V]."""
    return _saturate(z, out=z)


def remove_disallowed(z: torch.Tensor, allowed_mask: torch.Tensor) -> torch.Tensor:
    """Set every id outside `allowed_mask` (bool [B, V]) to -inf, in place."""
    return z.masked_fill_(~allowed_mask, NEG_INF)


def remove_stop_ids(z: torch.Tensor, stop_mask: torch.Tensor, below_min_tokens: torch.Tensor) -> torch.Tensor:
    """While a row has generated fewer than min_tokens (`below_min_tokens`, bool [B]), its stop and
    EOS ids (`stop_mask`, bool [B, V]) are removed; in place."""
    return z.masked_fill_(stop_mask & below_min_tokens[:, None], NEG_INF)
