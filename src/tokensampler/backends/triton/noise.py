"""`rng.py` inside Triton: the row key, the per-token hash and the Gumbel noise, bit for bit.

The torch definition (`tokensampler.core.rng`) works on 32-bit words held in int64 tensors; here the
words are native uint32, whose multiply wraps mod 2^32 and whose right shift is logical, which is
exactly the arithmetic `rng.py` emulates. u and g are computed in float64 as in `rng.py`.
"""

from __future__ import annotations

import triton.language as tl

import triton

from ...core import rng as _rng

KEY_SALT = tl.constexpr(_rng.KEY_SALT)
LOWBIAS_0 = tl.constexpr(_rng.LOWBIAS32[0])
LOWBIAS_1 = tl.constexpr(_rng.LOWBIAS32[1])
TRIPLE_0 = tl.constexpr(_rng.TRIPLE32[0])
TRIPLE_1 = tl.constexpr(_rng.TRIPLE32[1])
TRIPLE_2 = tl.constexpr(_rng.TRIPLE32[2])


@triton.jit
def mix32(x):
    """lowbias32 on uint32 words."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, LOWBIAS_0, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, LOWBIAS_1, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def row_key(seed, position, stream):
    """The uint32 row key from int64 seed, position and stream scalars (rng.row_key)."""
    seed_lo = seed.to(tl.uint32)
    seed_hi = (seed >> 32).to(tl.uint32)
    key = mix32(seed_lo ^ tl.full(seed_lo.shape, KEY_SALT, tl.uint32))
    key = mix32(key ^ seed_hi)
    key = mix32(key ^ position.to(tl.uint32))
    return mix32(key ^ stream.to(tl.uint32))


@triton.jit
def gumbel_noise(key, ids):
    """g = float32(-log(-log(u))) for token ids (int32 tensor) under a uint32 row key; the bits are
    triple32(key ^ id), rng.hash32."""
    x = key ^ ids.to(tl.uint32)  # hash32, written out (this runs once per block)
    x = x ^ (x >> 17)
    x = x * tl.full(x.shape, TRIPLE_0, tl.uint32)
    x = x ^ (x >> 11)
    x = x * tl.full(x.shape, TRIPLE_1, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, TRIPLE_2, tl.uint32)
    bits = x ^ (x >> 14)
    u = ((bits >> 8).to(tl.float64) + 0.5) * (1.0 / 16777216.0)
    return (-tl.log(-tl.log(u))).to(tl.float32)


@triton.jit
def gumbel_table_kernel(seed_ptr, position_ptr, stream_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    """out[b, i] = rng.gumbel(seed[b], position[b], i, stream[b]): the bit-identity test hook."""
    row = tl.program_id(0)
    key = row_key(tl.load(seed_ptr + row), tl.load(position_ptr + row), tl.load(stream_ptr + row))
    for start in range(0, vocab, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + row * vocab + ids, gumbel_noise(key, ids), mask=ids < vocab)
