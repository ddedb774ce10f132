"""Order keys of float32 values and the +inf rule: the two conventions every path shares.

Order key: a float32 value as an int64 with the same order (-0.0 and +0.0 equal), so thresholds can
be searched over integers and "value descending, then id ascending" is one integer comparison:

    key(z) = b            if b >= 0      b = the int32 bits of (z + 0.0)
             b ^ 0x7FFFFFFF otherwise

The Triton kernels mirror it bit for bit (`backends/triton/thresholds.py`, tested against this one).

The +inf rule (docs/semantics.md): a row holding +inf among its kept ids keeps only its +inf ids, at
value 0 (the limit of the softmax); every other id of that row is removed.
"""

from __future__ import annotations

import torch

from .constants import NEG_INF, POS_INF

_LOW31 = 0x7FFFFFFF


def order_key(z: torch.Tensor) -> torch.Tensor:
    """int64 keys with key(a) < key(b) iff a < b, for float32 values without NaN; key(-0.0) = key(0.0)."""
    bits = (z.to(torch.float32) + 0.0).view(torch.int32)
    return torch.where(bits < 0, bits ^ _LOW31, bits).to(torch.int64)


def key_to_float(key: torch.Tensor) -> torch.Tensor:
    """The float32 value of an `order_key` (the map is its own inverse on int32 words)."""
    bits = key.to(torch.int32)
    return torch.where(bits < 0, bits ^ _LOW31, bits).view(torch.float32)


KEY_NEG_INF = int(order_key(torch.tensor(NEG_INF)))  # the smallest key of a value (-inf)


def value_id_keys(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys, larger = earlier in the order (value desc, id asc), distinct for distinct ids:
    `order_key(value)` above `2^32 - 1 - id`. values: float32 without NaN; ids: int64 broadcastable
    to values' shape, 0 <= id < 2^32."""
    return order_key(values) * (1 << 32) + ((1 << 32) - 1 - ids)


def saturate_posinf(z: torch.Tensor, has_posinf: torch.Tensor | None = None, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The +inf rule along the last dim: rows holding +inf keep only their +inf ids, at 0; other
    rows are unchanged. `has_posinf` (bool, the row shape with a trailing 1 or broadcastable to it)
    says which rows hold +inf when that is known globally (a vocabulary split); `out=z` works in
    place. Without `has_posinf` and without a +inf, `z` itself is returned (one reduction)."""
    if has_posinf is None:
        has_posinf = z.amax(dim=-1, keepdim=True) == POS_INF  # a NaN-free z: +inf is the max
        if not bool(has_posinf.any()):
            return z if out is None else out.copy_(z) if out is not z else z
    elif has_posinf.dim() == z.dim() - 1:
        has_posinf = has_posinf.unsqueeze(-1)
    replaced = torch.where(z == POS_INF, 0.0, NEG_INF).to(z.dtype)
    return torch.where(has_posinf, replaced, z, out=out) if out is not None else torch.where(has_posinf, replaced, z)
