"""rng.U: pinned vectors, an independent pure-Python implementation, range, and the statistics of the bits."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from tokensampler.core import rng

M32 = 0xFFFFFFFF


def _py_lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _py_triple32(x: int) -> int:
    x ^= x >> 17
    x = (x * 0xED5AD4BB) & M32
    x ^= x >> 11
    x = (x * 0xAC4C1B51) & M32
    x ^= x >> 15
    x = (x * 0x31848BAB) & M32
    return x ^ (x >> 14)


def py_uniform(seed: int, position: int, token: int, stream: int = 0) -> float:
    """The specification of U in plain Python integers (what a kernel must reproduce)."""
    seed &= (1 << 64) - 1
    key = _py_lowbias32((seed & M32) ^ 0x9E3779B9)
    key = _py_lowbias32(key ^ (seed >> 32))
    key = _py_lowbias32(key ^ (position & M32))
    key = _py_lowbias32(key ^ (stream & M32))
    bits = _py_triple32(key ^ (token & M32))
    return ((bits >> 8) + 0.5) / 2**24


def test_pinned_vectors():
    key = rng.row_key(0, 0, 0)
    assert int(key) == 1106484830
    assert rng.random_bits(key, torch.arange(4)).tolist() == [1684591726, 100723531, 507484661, 2672193326]
    key = rng.row_key(2**64 - 1, 123456, 3)
    assert int(key) == 3520648124
    assert rng.random_bits(key, torch.tensor([0, 151935, 2**31])).tolist() == [511741834, 1575628213, 554425247]
    assert rng.U(42, 7, torch.tensor([0, 1, 2])).tolist() == [
        0.3742985427379608, 0.7566826045513153, 0.21629473567008972]


@pytest.mark.parametrize("seed", [0, 1, 42, 2**32 + 5, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63)])
def test_matches_pure_python_specification(seed):
    positions = [0, 1, 511, 2**31 + 3]
    tokens = torch.tensor([0, 1, 2, 1000, 151935, 2**20 + 7])
    for position in positions:
        for stream in (0, 3):
            got = rng.U(seed, position, tokens, stream).tolist()
            want = [py_uniform(seed, position, int(t), stream) for t in tokens]
            assert got == want


def test_signed_and_unsigned_seeds_are_the_same_bits():
    tokens = torch.arange(100)
    assert torch.equal(rng.U(-1, 3, tokens), rng.U(2**64 - 1, 3, tokens))
    assert torch.equal(rng.U(-(2**63), 3, tokens), rng.U(2**63, 3, tokens))


def test_tensor_and_int_inputs_agree_and_broadcast():
    seeds = torch.tensor([[5], [6]])
    grid = rng.U(seeds, torch.tensor([[9], [10]]), torch.arange(8)[None, :])
    assert grid.shape == (2, 8)
    assert torch.equal(grid[1], rng.U(6, 10, torch.arange(8)))


def test_range_open_and_24_bits():
    u = rng.U(7, 0, torch.arange(2**20))
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert u.dtype == torch.float64
    # every value is (k + 0.5) / 2^24 for an integer k: 24 bits, exactly representable
    k = u * 2**24 - 0.5
    assert torch.equal(k, torch.round(k))
    assert torch.unique(k).numel() > 0.96 * 2**20  # few collisions among 2^20 draws of 2^24 values


def test_gumbel_bounds_are_the_extremes():
    extremes = torch.tensor([0.5 / 2**24, (2**24 - 0.5) / 2**24], dtype=torch.float64)
    g = (-torch.log(-torch.log(extremes))).to(torch.float32)
    assert float(g[0]) == rng.GUMBEL_MIN and float(g[1]) == rng.GUMBEL_MAX
    sample = rng.gumbel(3, 4, torch.arange(2**18))
    assert float(sample.min()) >= rng.GUMBEL_MIN and float(sample.max()) <= rng.GUMBEL_MAX


def _chi2_uniform_pvalue(u: torch.Tensor, bins: int = 64) -> float:
    counts = np.histogram(u.numpy(), bins=bins, range=(0.0, 1.0))[0]
    return float(stats.chisquare(counts).pvalue)


def test_uniform_over_tokens_positions_and_seeds():
    assert _chi2_uniform_pvalue(rng.U(11, 0, torch.arange(200_000))) > 1e-4
    assert _chi2_uniform_pvalue(rng.U(11, torch.arange(200_000), 5)) > 1e-4
    assert _chi2_uniform_pvalue(rng.U(torch.arange(200_000), 0, 5)) > 1e-4
    assert _chi2_uniform_pvalue(rng.U(11, 0, 5, torch.arange(200_000))) > 1e-4


def test_each_bit_is_fair():
    bits = rng.random_bits(rng.row_key(3, 9, 0), torch.arange(200_000))
    ones = torch.stack([((bits >> b) & 1).sum() for b in range(32)]).double()
    # binomial(200000, 1/2): sd ~ 224; 5 sd
    assert float((ones - 100_000).abs().max()) < 5 * math.sqrt(200_000 / 4)


@pytest.mark.parametrize("axis", ["token", "position", "seed"])
def test_neighbours_are_independent(axis):
    n = 100_000
    idx = torch.arange(n + 1)
    if axis == "token":
        u = rng.U(123, 17, idx)
    elif axis == "position":
        u = rng.U(123, idx, 17)
    else:
        u = rng.U(idx, 17, 5)
    a, b = u[:-1].numpy(), u[1:].numpy()
    # correlation of neighbours: sd 1/sqrt(n) ~ 0.003
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.015
    # joint distribution of neighbour pairs on an 8x8 grid is uniform
    joint = np.histogram2d(a, b, bins=8, range=[[0, 1], [0, 1]])[0].ravel()
    assert stats.chisquare(joint).pvalue > 1e-4


def test_the_statistical_checks_can_fail():
    """The same checks reject a bad generator: the low bits of the token id alone."""
    bad = ((torch.arange(200_000) * 2654435761) % 2**24 + 0.5) / 2**24  # a linear sequence
    a, b = bad[:-1].numpy(), bad[1:].numpy()
    joint = np.histogram2d(a, b, bins=8, range=[[0, 1], [0, 1]])[0].ravel()
    assert stats.chisquare(joint).pvalue < 1e-4


def test_int32_word_forms_are_bit_identical_to_the_definition():
    """`to_int32_words`, `hash32_words` (default, copying and in-place forms) and `uniform_index_words`:
    the fast path's int32 forms of the int64 words, on the edge words and on random ones."""
    gen = torch.Generator().manual_seed(2026)
    words = torch.cat([torch.tensor([0, 1, 2**31 - 1, 2**31, 2**31 + 1, 2**32 - 1, rng.KEY_SALT]),
                       torch.randint(0, 2**32, (4096,), generator=gen, dtype=torch.int64)])
    w32 = rng.to_int32_words(words)
    assert w32.dtype == torch.int32
    assert w32.tolist() == [w - (1 << 32) if w >= 1 << 31 else w for w in words.tolist()]
    want = rng.hash32(words)
    assert want.tolist()[:7] == [_py_triple32(w) for w in words.tolist()[:7]]
    for kwargs in ({}, {"in_place": False}, {"in_place": True}):
        x = w32.clone()
        got = rng.hash32_words(x, **kwargs)
        assert got.dtype == torch.int32 and torch.equal(got.to(torch.int64) & M32, want), kwargs
        assert torch.equal(x, w32) != kwargs.get("in_place", False), kwargs  # only in_place overwrites x
    index = rng.uniform_index_words(rng.to_int32_words(want))
    assert torch.equal(index.to(torch.int64), want >> 8)


def test_gumbel_is_the_transform_of_u_at_every_coordinate():
    """g = float32(-log(-log(U))) with all four coordinates, the stream included."""
    tokens = torch.arange(4096)
    for seed, position, stream in ((5, 0, 0), (2**64 - 3, 77, 1), (-9, 2**33 + 5, 6)):
        u = rng.U(seed, position, tokens, stream)
        assert torch.equal(rng.gumbel(seed, position, tokens, stream), (-torch.log(-torch.log(u))).to(torch.float32))
    assert not torch.equal(rng.gumbel(5, 0, tokens, 0), rng.gumbel(5, 0, tokens, 1))


def test_noise_is_computed_on_the_device_of_the_seed():
    """Int and CPU-tensor coordinates follow a seed tensor's device (meta here: only shapes)."""
    seed = torch.tensor([[5], [6]], device="meta")
    for fn in (rng.U, rng.gumbel):
        for position, stream in ((3, 0), (torch.tensor([[9], [10]]), torch.tensor([[0], [2]]))):
            out = fn(seed, position, torch.arange(8), stream)
            assert out.device.type == "meta" and out.shape == (2, 8)
    assert rng.row_key(seed, torch.tensor([[9], [10]])).device.type == "meta"


def test_coordinates_of_any_integer_dtype_give_the_same_noise():
    """int32 / int16 tensors (and the default stream 0) give the bits of the int64 coordinates."""
    tokens = torch.arange(0, 30000, 7)
    want = rng.U(-5, 2**31 - 3, tokens, 3)
    for dtype in (torch.int32, torch.int16):
        got = rng.U(torch.tensor(-5, dtype=torch.int32), torch.tensor(2**31 - 3, dtype=torch.int32),
                    tokens.to(dtype), torch.tensor(3, dtype=dtype))
        assert torch.equal(got, want), dtype
    key = rng.row_key(-5, 11)
    assert torch.equal(key, rng.row_key(-5, 11, 0))
    assert torch.equal(rng.random_bits(key, tokens.to(torch.int32)), rng.random_bits(key, tokens))


def test_fresh_seeds_are_distinct_63_bit_ints():
    seeds = [rng.fresh_seed() for _ in range(256)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert len(set(seeds)) == 256
