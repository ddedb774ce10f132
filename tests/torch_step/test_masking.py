"""backends/torch_step/masking.py: steps 1 and 3 on hand-computed rows."""

from __future__ import annotations

import math

import torch

from tokensampler.backends.torch_step import masking

NEG_INF = float("-inf")


def test_prepare_logits_copies_the_callers_rows():
    logits = torch.tensor([[1.0, float("nan"), 3.0, 9.0]])
    assert masking.prepare_logits(logits, 3).tolist() == [[1.0, NEG_INF, 3.0]]
    assert math.isnan(float(logits[0, 1])) and float(logits[0, 3]) == 9.0  # the caller's rows are untouched


def _expected(z: torch.Tensor, bitmask: torch.Tensor, start: int) -> torch.Tensor:
    from tokensampler.reference import bitmask_allowed_ids
    allowed = bitmask_allowed_ids(bitmask, 32 * bitmask.shape[1])
    want = z.clone()
    for r, ids in enumerate(allowed):
        for c in range(z.shape[1]):
            if start + c not in ids:
                want[r, c] = NEG_INF
    return want


def test_remove_by_bitmask_at_partial_bytes():
    """Rows whose only removed id lies in a byte shared with ids outside [start, start + width)."""
    bitmask = torch.full((3, 2), -1, dtype=torch.int32)
    bitmask[0, 0] = ~(1 << 4)  # id 4: bit 4 of the first, partial, byte
    bitmask[1, 0] = ~(1 << 11)  # id 11: bit 3 of the last, partial, byte
    bitmask[2, 0] = ~(1 << 1)  # id 1: before start, changes nothing
    z = torch.arange(30.0).reshape(3, 10)
    got = masking.remove_by_bitmask(z.clone(), bitmask, start=3)
    assert torch.equal(got, _expected(z, bitmask, 3))
    assert got[0, 1] == NEG_INF and got[1, 8] == NEG_INF and not bool(torch.isinf(got[2]).any())


def test_remove_by_bitmask_on_strided_and_half_rows():
    gen = torch.Generator().manual_seed(8)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 2), generator=gen, dtype=torch.int64).to(torch.int32)
    z = torch.randn(2, 40, generator=gen)
    want = _expected(z, bitmask, 5)
    strided = torch.empty(40, 2).t()  # stride(1) = 2: the masked_fill fallback
    strided.copy_(z)
    assert torch.equal(masking.remove_by_bitmask(strided, bitmask, start=5), want)
    half = masking.remove_by_bitmask(z.to(torch.float16), bitmask, start=5)
    assert torch.equal(half, want.to(torch.float16))
