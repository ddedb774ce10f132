"""An independent packer of token bitmasks (xgrammar's layout), for tests: plain Python ints."""

from __future__ import annotations

import torch


def pack_bits(allowed: list[set[int]], words: int, extra_bits: list[set[int]] | None = None) -> torch.Tensor:
    """int32 [B, words] with bit (i % 32) of word (i // 32) set for every i in the row's set (and in
    `extra_bits[b]`, ids past the vocabulary); the int32 is the bit pattern."""
    rows = []
    for b, ids in enumerate(allowed):
        values = [0] * words
        for i in set(ids) | (extra_bits[b] if extra_bits else set()):
            values[i // 32] |= 1 << (i % 32)
        rows.append([v - (1 << 32) if v >= 1 << 31 else v for v in values])
    return torch.tensor(rows, dtype=torch.int32).reshape(len(allowed), words)
