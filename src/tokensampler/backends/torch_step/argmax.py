"""`first_argmax`: the lowest index among each row's maxima, at the speed of `amax`.

torch's CPU `argmax` over a long row runs several times slower than `amax`. Here the row is cut in
blocks: `amax` per block (vectorised), the first block holding the row maximum (a short argmax),
then the first maximum inside that block. NaN behaves as in `torch.argmax` (it is the maximum).

The block is a divisor of the row's width near `BLOCK` when there is one (151,936 = 128 x 1187,
128,256 = 128 x 1002, 32,000 = 32 x 1000): the row is then a [blocks, block] view with no tail,
and the step is a handful of tensor operations, which is what a greedy step of a small batch costs.
"""

from __future__ import annotations

from functools import lru_cache

import torch

BLOCK = 1024


@lru_cache(maxsize=64)
def block_size(width: int, block: int = BLOCK) -> int:
    """The block for rows of `width`: the divisor of `width` in [block / 2, 2 block] nearest to
    `block` (no partial tail block), else `block`."""
    divisors = [d for d in range(max(1, block // 2), 2 * block + 1) if width % d == 0]
    return min(divisors, key=lambda d: (abs(d - block), d)) if divisors else block


def block_maxima(x: torch.Tensor, block: int | None = None) -> torch.Tensor | None:
    """x: float [B, V]. float [B, ceil(V / b)]: each block's `amax` (NaN propagates) with b =
    `block_size(V)` (or `block`), or None where `first_argmax` takes torch's argmax (short rows, a
    strided last dim). Its `amax(-1)` is `x.amax(-1)`, so a caller needing both reads the row once."""
    rows, width = x.shape
    block = block_size(width) if block is None else block
    if width <= 4 * block or x.stride(-1) != 1:
        return None
    full = width // block
    block_max = x[:, : full * block].view(rows, full, block).amax(dim=-1)
    if full * block < width:
        block_max = torch.cat([block_max, x[:, full * block:].amax(dim=-1, keepdim=True)], dim=-1)
    return block_max


def first_argmax(x: torch.Tensor, block: int | None = None, block_max: torch.Tensor | None = None) -> torch.Tensor:
    """x: float [B, V] (last dim contiguous). Returns int64 [B]: the first index of each row's max.
    block: the block width (default `block_size(V)`); block_max: `block_maxima(x, block)` when the
    caller has it (else computed here)."""
    rows, width = x.shape
    block = block_size(width) if block is None else block
    if block_max is None:
        block_max = block_maxima(x, block)
    if block_max is None:
        return x.argmax(dim=-1)
    best_block = block_max.argmax(dim=-1)
    if width % block == 0:  # no tail: the chosen block is a row of the [B, blocks, block] view
        blocks = x.view(rows, width // block, block)
        window = blocks[torch.arange(rows, device=x.device), best_block]
        return best_block * block + window.argmax(dim=-1)
    start = (best_block * block).clamp(max=width - block)  # the tail block is read from width - block
    columns = start[:, None] + torch.arange(block, device=x.device)[None, :]
    window = x.gather(-1, columns)
    # ids before the chosen block that fall in a shifted tail window hold values < the max (they
    # belong to earlier blocks whose max is smaller), so the first max of the window is the row's
    return start + window.argmax(dim=-1)
