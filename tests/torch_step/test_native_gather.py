"""The C++ candidate pass (`native_gather.cpp`) gives `select.gather_candidates`'s torch result bit
for bit, on the rows a step sees and on the edges of its compare; a sampler that compiles uses it."""

from __future__ import annotations

import math
import os
import platform
import shutil

import pytest
import torch

from tokensampler import Sampler, SamplingParams
from tokensampler.backends.torch_step import native, select
from tokensampler.backends.torch_step.config import TorchStepConfig
from tokensampler.tools.bench import make_logits

COMPILER = platform.system() == "Linux" and (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++"))
pytestmark = pytest.mark.skipif(not COMPILER, reason="no C++ compiler on this platform: the torch operations run")
OP = native.gather_op() if COMPILER else None


def test_it_builds_and_loads_wherever_a_compiler_is_found():
    assert OP is not None


def counted(monkeypatch, name: str) -> list:
    """Replace `native.<name>` by a wrapper whose op appends to the returned list on every call."""
    calls: list = []
    real = getattr(native, name)

    def counting():
        op = real()
        return None if op is None else (lambda *args: calls.append(1) or op(*args))

    monkeypatch.setattr(native, name, counting)
    return calls


def torch_list(z, lower, scale=None):
    count = (z >= lower[:, None]).sum(dim=1)
    return select.gather_candidates(z, lower, 1 << 30, count=count, scale=scale, compiled=False), count


def native_list(z, lower, scale=None, width=None):
    count = (z >= lower[:, None]).sum(dim=1)
    width = int(count.max()) if width is None and count.numel() else (width or 0)
    return OP(z, lower, scale, width)


def assert_same(z, lower, scale=None):
    (values, ids, count), _ = torch_list(z, lower, scale)
    got_values, got_ids, got_count = native_list(z, lower, scale)
    assert torch.equal(got_count, count)
    assert torch.equal(got_ids, ids)
    # bit for bit (NaN-free: the compare never lists a NaN), -0.0 included
    assert torch.equal(got_values.view(torch.int32), values.view(torch.int32))


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 1000, 151936])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_random_rows_at_several_floors(rows, vocab):
    gen = torch.Generator().manual_seed(rows * 1000 + vocab)
    z = torch.randn(rows, vocab, generator=gen) * 4
    for quantile in (0.0, 0.5, 0.99, 1.0):
        lower = torch.quantile(z, quantile, dim=1) if vocab > 1 else z[:, 0].clone()
        assert_same(z, lower.contiguous())
        assert_same(z, lower.contiguous(), scale=torch.rand(rows, generator=gen) * 3 + 0.05)


def test_edges_of_the_compare():
    nan, inf = math.nan, math.inf
    z = torch.tensor([
        [nan, 1.0, nan, 2.0, -inf, inf, 0.0, -0.0] * 5,
        [1.0] * 40,                      # every id ties with the floor
        [-inf] * 40,                     # nothing reaches a finite floor
        [0.5, -0.0, 0.0, 1e-45, -1e-45] * 8,
    ])
    lower = torch.tensor([1.0, 1.0, -1e30, 0.0])
    assert_same(z, lower)
    assert_same(z, lower, scale=torch.tensor([3.0, 0.7, 1.0, 1e-30]))


def test_rows_of_a_wider_buffer_and_empty_rows():
    base = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    z = base[:, 10:260]  # rows contiguous, stride 300
    lower = z.amax(dim=1) - 1.5
    assert_same(z, lower.contiguous())
    empty = torch.empty(0, 64)
    values, ids, count = native_list(empty, torch.empty(0))
    assert values.shape == (0, 1) and ids.shape == (0, 1) and count.shape == (0,)


def test_a_short_width_keeps_the_first_hits_and_counts_them_all():
    z = torch.arange(100, dtype=torch.float32)[None]
    values, ids, count = native_list(z, torch.tensor([50.0]), width=7)
    assert int(count) == 50 and ids.tolist() == [[50, 51, 52, 53, 54, 55, 56]]
    assert values.tolist() == [[50.0, 51.0, 52.0, 53.0, 54.0, 55.0, 56.0]]


def test_a_compiling_sampler_lists_candidates_with_it_and_draws_what_an_eager_one_draws(monkeypatch):
    calls = counted(monkeypatch, "gather_op")
    logits = make_logits(6, 151936, flat=False, device=torch.device("cpu"))  # peaked: the candidate list route
    tokens = []
    for compile in (True, False):
        sampler = Sampler(151936, max_slots=6, compile=compile,  # the general routes (the fused one lists in C++)
                          step_config=TorchStepConfig(fused_route=False))
        for slot in range(6):
            sampler.add_request(slot, SamplingParams(temperature=0.8, top_p=0.9, top_k=50 * slot, seed=slot), [1])
        tokens.append([sampler.sample(logits).token_ids.tolist() for _ in range(4)])
        if compile:
            assert calls, "the compiling sampler did not use the C++ pass"
            calls.clear()
    assert tokens[0] == tokens[1] and not calls


def test_a_library_that_cannot_be_built_leaves_the_torch_operations_with_one_warning(tmp_path, monkeypatch):
    from tokensampler.core.errors import CompileFallbackWarning

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises((RuntimeError, OSError)):
        native.build(tmp_path / "lib" / "native_gather.so")
    assert not (tmp_path / "lib" / "native_gather.so").exists()
    monkeypatch.setattr(native, "LIBRARY", "tokensampler_native_not_built")
    monkeypatch.setattr(native, "library_path", lambda: tmp_path / "lib" / "native_gather.so")
    monkeypatch.setattr(native, "_STATE", {})
    with pytest.warns(CompileFallbackWarning, match="C\\+\\+ candidate pass"):
        assert native.gather_op() is None
    assert native.gather_op() is None  # decided once
    z = torch.randn(3, 500, generator=torch.Generator().manual_seed(4))
    lower = z.amax(dim=1) - 2
    count = (z >= lower[:, None]).sum(dim=1)
    got = select.gather_candidates(z, lower, 1 << 30, count=count, compiled=True)
    want = select.gather_candidates(z, lower, 1 << 30, count=count, compiled=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 151936])
def test_the_seen_ids_of_penalised_slots_are_the_torch_compactions(vocab):
    from tokensampler.backends.torch_step import penalties

    gen = torch.Generator().manual_seed(vocab)
    slots_total = 6
    prompt = torch.rand(slots_total, vocab, generator=gen) < 0.01
    counts = (torch.rand(slots_total, vocab, generator=gen) < 0.005).to(torch.int32) * torch.randint(
        1, 5, (slots_total, vocab), generator=gen, dtype=torch.int32)
    prompt[1] = False
    counts[1] = 0  # a slot that has seen nothing
    counts[2, -1] = 3  # the last id, from the outputs only
    prompt[3, 0] = True  # the first id, from the prompt only
    counts[4] = 7  # every id
    for slots in ([0, 1, 2, 3, 4, 5], [5, 3, 1], [2], []):
        want = penalties.seen_ids(prompt, counts, slots, vocab, compiled=False)
        got = penalties.seen_ids(prompt, counts, slots, vocab, compiled=True)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), slots
        assert got[1].numel() == sum(int(((prompt[s] | (counts[s] != 0))).sum()) for s in slots)


@pytest.mark.parametrize("vocab, width", [(33, 33), (1000, 1040), (151936, 151936)])
def test_the_penalised_cells_are_the_torch_arithmetics_bit_for_bit(vocab, width):
    """`penalty_cells` against `penalty_edits`' torch operations: rows of zeros of both signs, negative
    and positive values, NaN and +-inf, penalties of both signs (presence and frequency below zero,
    repetition below and above one), slots that saw nothing, z a view of a wider buffer: the same
    cells, each value the same float32 bits."""
    from tokensampler.backends.torch_step import penalties

    gen = torch.Generator().manual_seed(vocab)
    slots_total = 5
    buffer = torch.randn(4, width, generator=gen) * 3.0
    z = buffer[:, :vocab]
    z[0, : min(vocab, 8)] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, float("nan"), float("inf"), -float("inf"),
                                          3e38])[: min(vocab, 8)]
    prompt = torch.rand(slots_total, width, generator=gen) < 0.05
    counts = (torch.rand(slots_total, width, generator=gen) < 0.05).to(torch.int32) * torch.randint(
        1, 9, (slots_total, width), generator=gen, dtype=torch.int32)
    prompt[0, :8] = True
    counts[2] = 0
    prompt[2] = False  # a slot that has seen nothing
    repetition = torch.tensor([1.3, 0.7, 1.0, 2.0, 1.1])
    frequency = torch.tensor([0.4, -0.3, 0.0, 1.7, 0.25])
    presence = torch.tensor([0.3, -1.1, 0.5, 0.0, -0.6])
    rows, slots = [0, 1, 2, 3], [0, 4, 2, 1]
    want = penalties.penalty_edits(z, rows, slots, prompt, counts, repetition, frequency, presence, compiled=False)
    for helpers in (-1, 0, 1, 3):  # torch's threads; the caller alone; with helper threads (native_rows.h)
        got = penalties.penalty_edits(z, rows, slots, prompt, counts, repetition, frequency, presence,
                                      compiled=True, helpers=helpers)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(got[2].view(torch.int32), want[2].view(torch.int32))


def test_a_compiling_sampler_penalises_with_it_as_an_eager_one(monkeypatch):
    calls = counted(monkeypatch, "penalty_op")
    vocab = 50_000
    logits = make_logits(4, vocab, flat=False, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(7)
    histories = [torch.randint(0, vocab, (300,), generator=gen).tolist() for _ in range(4)]
    tokens = []
    for compile in (True, False):
        sampler = Sampler(vocab, max_slots=4, compile=compile)
        for slot in range(4):
            sampler.add_request(slot, SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.3,
                                                     frequency_penalty=0.4, presence_penalty=0.3, seed=slot),
                                histories[slot][:200], output_token_ids=histories[slot][200:])
        tokens.append([sampler.sample(logits).token_ids.tolist() for _ in range(4)])
        if compile:
            assert calls, "the compiling sampler did not use the C++ pass"
            calls.clear()
    assert tokens[0] == tokens[1] and not calls


@pytest.mark.parametrize("start, width", [(0, 151936), (0, 1000), (7, 300), (64, 96), (33, 5), (0, 40)])
def test_a_bitmask_removes_what_the_torch_lookup_removes(start, width):
    from tokensampler.backends.torch_step import masking

    gen = torch.Generator().manual_seed(start * 7 + width)
    rows, words = 5, -(-(start + width) // 32)
    bits = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bits[1] = -1  # every id allowed
    bits[2] = 0  # none
    bits[3, ::2] = -1  # whole words of ones and of random bits
    short = bits[:, :max(words - 2, 0)]  # ids past the mask's words are removed
    z = torch.randn(rows, width, generator=gen)
    z[0, :4] = torch.tensor([math.inf, -math.inf, -0.0, 0.0])[:min(4, width)]
    for mask in (bits, short, bits[:, :max(words - 1, 1)].contiguous()):
        want = masking.remove_by_bitmask(z.clone(), mask, start, compiled=False)
        got = masking.remove_by_bitmask(z.clone(), mask, start, compiled=True)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_a_compiling_sampler_applies_a_bitmask_with_it_as_an_eager_one(monkeypatch):
    calls = counted(monkeypatch, "bitmask_op")
    vocab = 151936
    logits = make_logits(4, vocab, flat=False, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(9)
    allowed = torch.rand(4, vocab, generator=gen) < 0.03
    padded = torch.zeros(4, -(-vocab // 32) * 32, dtype=torch.bool)
    padded[:, :vocab] = allowed
    weights = 2 ** torch.arange(32, dtype=torch.int64)
    bitmask = (padded.view(4, -1, 32).to(torch.int64) * weights).sum(-1)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)
    tokens = []
    for compile in (True, False):
        sampler = Sampler(vocab, max_slots=4, compile=compile,  # the block route (the fused one reads the bits)
                          step_config=TorchStepConfig(fused_route=False))
        for slot in range(4):
            sampler.add_request(slot, SamplingParams(temperature=0.9, top_p=0.9, seed=slot), [1])
        tokens.append([sampler.sample(logits, token_bitmask=bitmask).token_ids.tolist() for _ in range(4)])
        if compile:
            assert calls, "the compiling sampler did not use the C++ pass"
            calls.clear()
    assert tokens[0] == tokens[1] and not calls
    assert all(bool(allowed[row, token]) for step in tokens[0] for row, token in enumerate(step))


@pytest.mark.parametrize("vocab", [1, 31, 33, 1000, 151936])
def test_the_dense_bracket_is_the_torch_extraction(vocab):
    from tokensampler.backends.torch_step import dense

    gen = torch.Generator().manual_seed(vocab + 5)
    rows = 6
    z = torch.randn(rows, vocab, generator=gen) * 3
    z[0, : min(vocab, 5)] = -math.inf
    z[1, : min(vocab, 3)] = math.nan
    if vocab > 12:
        z[2, :8] = 1.0  # ties at the low end (kept)
        z[2, 8:12] = 2.0  # and at the high end (not)
    low = torch.quantile(z.nan_to_num(nan=-1e30), 0.3, dim=1).contiguous()
    high = torch.quantile(z.nan_to_num(nan=-1e30), 0.7, dim=1).contiguous()
    low[2], high[2] = 1.0, 2.0
    low[3] = -math.inf  # the whole row below high, -inf excluded
    z[3, :2] = -math.inf
    z[3, -1] = -math.inf  # in the last 32-id block and in the scalar tail
    low[4] = high[4] = math.inf  # a row without top-p: nothing
    for cap in (0, 3, 50, 1 << 20):
        want = dense._extract(z, low, high, cap, compiled=False)
        got = dense._extract(z, low, high, cap, compiled=True)
        assert torch.equal(got[1], want[1]), cap
        assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32)), cap
