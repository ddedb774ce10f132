"""U(seed, position, token, stream): the one counter-based uniform every code path draws from.

A pure function of its four arguments, in 32-bit unsigned integer arithmetic (multiply mod 2^32,
xor, logical shift) so a Triton kernel reproduces the bits exactly. Torch has no general uint32
arithmetic, so the words live in int64 tensors masked to 32 bits; products are split in 16-bit
halves so no intermediate passes 2^49.

    key  = mix(mix(mix(mix(seed_lo ^ K0) ^ seed_hi) ^ position) ^ stream)   one per row
    bits = hash(key ^ token)                                                 one per element
    u    = ((bits >> 8) + 0.5) / 2^24   in [2^-25, 1 - 2^-25], exact in float64, 24 random bits
    g    = float32(-log(-log(u)))       Gumbel noise, computed in float64

    coin = U(seed, position, COIN_TOKEN, stream)                             XTC's coin, one per row

`mix` is lowbias32 and `hash` is triple32 (C. Wellons' integer hash prospector).

`hash32` is the definition (int64 words); `hash32_words` is the same hash on int32 words whose
multiplication wraps mod 2^32, the form the CPU fast path uses (tested bit-identical). The Triton
kernels keep their own uint32 mirror (`backends/triton/noise.py`).
"""

from __future__ import annotations

import math
import secrets

import torch

MASK32 = 0xFFFFFFFF
KEY_SALT = 0x9E3779B9
LOWBIAS32 = (0x7FEB352D, 0x846CA68B)
TRIPLE32 = (0xED5AD4BB, 0xAC4C1B51, 0x31848BAB)
_HASH_SHIFTS = (17, 11, 15, 14)  # xor-shift before each multiply, and the final one
UNIFORM_BITS = 24
UNIFORM_MASK = (1 << UNIFORM_BITS) - 1
# The token coordinate of XTC's coin (docs/semantics.md step 10.5): above every vocabulary (ids are
# below 2^31), so the coin is never the noise of a token of its row, and a change of the tokens'
# noise (another id, another draw) leaves it as it was.
COIN_TOKEN = MASK32

# The extreme values of g = float32(-log(-log(u))) over the 2^24 possible u: the bound a fast path
# uses to skip ids whose z is too far below the best kept z to ever win the Gumbel argmax.
_U_MIN = 0.5 / 2**UNIFORM_BITS
_U_MAX = (2**UNIFORM_BITS - 0.5) / 2**UNIFORM_BITS
GUMBEL_MIN = float(torch.tensor(-math.log(-math.log(_U_MIN)), dtype=torch.float32))
GUMBEL_MAX = float(torch.tensor(-math.log(-math.log(_U_MAX)), dtype=torch.float32))


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for x in [0, 2^32), without overflowing int64."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijective 32-bit mixer (xorshift-multiply)."""
    x = x ^ (x >> 16)
    x = _mul32(x, LOWBIAS32[0])
    x = x ^ (x >> 15)
    x = _mul32(x, LOWBIAS32[1])
    return x ^ (x >> 16)


def hash32(x: torch.Tensor) -> torch.Tensor:
    """triple32: a stronger bijective 32-bit hash, used once per (row key, token)."""
    x = x ^ (x >> 17)
    x = _mul32(x, TRIPLE32[0])
    x = x ^ (x >> 11)
    x = _mul32(x, TRIPLE32[1])
    x = x ^ (x >> 15)
    x = _mul32(x, TRIPLE32[2])
    return x ^ (x >> 14)


def to_int32_words(words: torch.Tensor) -> torch.Tensor:
    """32-bit words held in int64 (in [0, 2^32)) as int32 tensors with the same bits."""
    return (words - ((words >> 31) << 32)).to(torch.int32)


_TRIPLE32_SIGNED = tuple(c - (1 << 32) if c >= 1 << 31 else c for c in TRIPLE32)


def hash32_words(x: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """`hash32` on int32 words (multiplication wraps mod 2^32; right shifts made logical by a mask).

    in_place=True overwrites `x` (with one temporary of its size): the form for large eager blocks;
    the default builds new tensors, which torch.compile fuses into one loop."""
    tmp = torch.empty_like(x) if in_place else None
    for step, shift in enumerate(_HASH_SHIFTS):
        mask = (1 << (32 - shift)) - 1
        if in_place:
            torch.bitwise_right_shift(x, shift, out=tmp)
            x.bitwise_xor_(tmp.bitwise_and_(mask))
            if step < len(_TRIPLE32_SIGNED):
                x.mul_(_TRIPLE32_SIGNED[step])
        else:
            x = x ^ ((x >> shift) & mask)
            if step < len(_TRIPLE32_SIGNED):
                x = x * _TRIPLE32_SIGNED[step]
    return x


def uniform_index_words(bits: torch.Tensor) -> torch.Tensor:
    """k = bits >>> 8 (the 24 random bits of u = (k + 0.5) / 2^24) from int32 words."""
    return (bits >> (32 - UNIFORM_BITS)) & UNIFORM_MASK


def _as_long(value: torch.Tensor | int, device: torch.device | str | None = None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(dtype=torch.int64, device=device if device is not None else value.device)
    return torch.tensor(seed_to_int64(value) if abs(value) >= 2**63 else value, dtype=torch.int64,
                        device=device)


def fresh_seed() -> int:
    """A fresh random 63-bit seed, for a request that did not name one."""
    return secrets.randbits(63)


def seed_to_int64(seed: int) -> int:
    """The int64 (two's complement) carrying the 64 bits of a seed given as signed or unsigned."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def row_key(seed: torch.Tensor | int, position: torch.Tensor | int,
            stream: torch.Tensor | int = 0) -> torch.Tensor:
    """The 32-bit per-row key (int64 tensor in [0, 2^32)) from the seed's 64 bits, the position
    of the token being sampled and the stream index (choice i of an n > 1 request)."""
    seed_t = _as_long(seed)
    device = seed_t.device
    position_t = _as_long(position, device)
    stream_t = _as_long(stream, device)
    seed_lo = seed_t & MASK32
    seed_hi = (seed_t >> 32) & MASK32
    key = mix32(seed_lo ^ KEY_SALT)
    key = mix32(key ^ seed_hi)
    key = mix32(key ^ (position_t & MASK32))
    return mix32(key ^ (stream_t & MASK32))


def random_bits(key: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """The 32 random bits of (row key, token id), int64 in [0, 2^32). Shapes broadcast."""
    return hash32(key ^ (token.to(torch.int64) & MASK32))


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """u = ((bits >> 8) + 0.5) / 2^24 as float64: 24 random bits, never 0 or 1."""
    return ((bits >> (32 - UNIFORM_BITS)).to(torch.float64) + 0.5) * (0.5**UNIFORM_BITS)


def gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """g = float32(-log(-log(u))), computed in float64 then rounded once."""
    u = uniform_from_bits(bits)
    return (-torch.log(-torch.log(u))).to(torch.float32)


def U(seed: torch.Tensor | int, position: torch.Tensor | int, token: torch.Tensor | int,
      stream: torch.Tensor | int = 0) -> torch.Tensor:
    """The uniform U(seed, position, token, stream) in (0, 1), float64, broadcast over the inputs."""
    key = row_key(seed, position, stream)
    return uniform_from_bits(random_bits(key, _as_long(token, key.device)))


def gumbel(seed: torch.Tensor | int, position: torch.Tensor | int, token: torch.Tensor | int,
           stream: torch.Tensor | int = 0) -> torch.Tensor:
    """The Gumbel noise g = float32(-log(-log(U(seed, position, token, stream))))."""
    key = row_key(seed, position, stream)
    return gumbel_from_bits(random_bits(key, _as_long(token, key.device)))


def xtc_coin(seed: torch.Tensor | int, position: torch.Tensor | int, stream: torch.Tensor | int = 0) -> torch.Tensor:
    """XTC's coin U(seed, position, COIN_TOKEN, stream) in (0, 1), float64: the row applies XTC iff
    coin < xtc_probability."""
    return U(seed, position, COIN_TOKEN, stream)
