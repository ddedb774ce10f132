"""Step 7's dynamic temperature without sorting (backends/torch_step/extra_filters.py).

The torch step computes each row's entropy in any summation order and brackets T_dyn with a bound
on its distance to the canonical sequential sum (docs/semantics.md, "Full-row quantities"): the bound
holds on rows of every shape; a T_dyn whose interval straddles a float32 rounding boundary goes to the
canonical sum; every row's T_dyn equals the canonical one to the bit; and LLM-shaped rows are
decided without the canonical sum (else the route would be as slow as sorting every row).
"""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch

from tokensampler import SamplingParams
from tokensampler.backends.torch_step import extra_filters as ef
from tokensampler.tools.workloads import make_logits

NEG_INF = float("-inf")


def canonical_entropy(row: torch.Tensor) -> float:
    """H as the definition sums it: kept ids in the canonical order, sequential float64 sums."""
    ids = ef._ordered(row, row > NEG_INF)
    return float(ef._weights(row[ids].to(torch.float64))[2])


def rows_of_every_shape(seed: int = 0) -> list[torch.Tensor]:
    """LLM-shaped rows (peaked and flat, 151,936 wide), small random rows, rows with removed ids, ties,
    one dominant id, values far apart, near-uniform rows."""
    gen = torch.Generator().manual_seed(seed)
    rows = list(make_logits(6, 151936, seed=seed)) + list(make_logits(4, 151936, flat=True, seed=seed + 1))
    r = random.Random(seed)
    for _ in range(60):
        vocab = r.choice([2, 3, 7, 64, 1000, 50000])
        scale = r.choice([1e-6, 0.01, 1.0, 10.0, 300.0])
        row = torch.randn(vocab, generator=gen) * scale
        if r.random() < 0.3:
            row[torch.rand(vocab, generator=gen) < 0.5] = NEG_INF
            row[r.randrange(vocab)] = 0.0
        if r.random() < 0.2:
            row = torch.round(row)  # ties
        if r.random() < 0.2:
            row[r.randrange(vocab)] = 1e30  # one id with all the mass
        rows.append(row)
    rows.append(torch.full((151936,), 3.0))  # uniform: H = log n
    return rows


def test_the_unsorted_entropy_is_within_its_bound_of_the_canonical_sum():
    worst = 0.0
    for row in rows_of_every_shape():
        fast, n = ef.row_entropy(row)
        canonical = canonical_entropy(row)
        assert n == int((row > NEG_INF).sum())
        bound = ef.entropy_error(fast, n)
        assert abs(fast - canonical) <= bound, (fast, canonical, bound)
        worst = max(worst, abs(fast - canonical) / bound)
    assert worst < 0.5  # the bound's safety factor is 4: seen differences stay well inside it


def _midpoint_above(value: float) -> float:
    """The float64 halfway between float32(value) and the next float32 up."""
    bits = struct.unpack("I", struct.pack("f", value))[0]
    up = struct.unpack("f", struct.pack("I", bits + 1))[0]
    return (struct.unpack("f", struct.pack("f", value))[0] + up) / 2


def test_a_temperature_at_a_float32_rounding_boundary_is_left_to_the_canonical_sum():
    """T(H) = T_min + (T_max - T_min) H / log n with H placed so that T(H) is a float32 midpoint:
    an entropy that could be either side of it is not decided; one far enough away is."""
    p = SamplingParams(temperature=1.0, dynatemp_range=0.5, dynatemp_exponent=1.0)
    n = 151936
    target = _midpoint_above(1.1)
    h = (target - 0.5) * math.log(n) / 1.0
    assert ef.bracketed_temperature(h, n, p) is None
    step = 20 * ef.entropy_error(h, n)
    below, above = ef.bracketed_temperature(h - step, n, p), ef.bracketed_temperature(h + step, n, p)
    assert below is not None and above is not None and above > below
    # one kept id: the request's T; a non-finite entropy: undecided
    assert ef.bracketed_temperature(0.0, 1, p) == 1.0
    assert ef.bracketed_temperature(math.nan, 5, p) is None


@pytest.mark.parametrize("seed", range(3))
def test_every_row_gets_the_canonical_temperature_to_the_bit(seed):
    r = random.Random(seed)
    rows = rows_of_every_shape(seed)
    params = [SamplingParams(temperature=r.choice([0.3, 0.7, 1.0, 1.5, 2.0]),
                             dynatemp_range=r.choice([0.05, 0.3, 0.5, 1.0, 1.9]),
                             dynatemp_exponent=r.choice([0.0, 0.5, 1.0, 1.7, 3.0])) for _ in rows]
    for row, p in zip(rows, params):
        got = ef.dynamic_temperatures(row[None], [p])
        want = ef.dynamic_temperature(row, p)
        assert got.dtype == torch.float32 and bool(got[0] == want), (p, float(got[0]), float(want))


def test_llm_rows_are_decided_without_the_canonical_sum(monkeypatch):
    calls = []
    exact = ef.dynamic_temperature
    monkeypatch.setattr(ef, "dynamic_temperature", lambda row, p: calls.append(p) or exact(row, p))
    rows = make_logits(32, 151936, seed=7)
    p = SamplingParams(temperature=1.0, dynatemp_range=0.5)
    got = ef.dynamic_temperatures(rows, [p] * 32)
    assert len(calls) <= 1
    monkeypatch.setattr(ef, "dynamic_temperature", exact)
    assert torch.equal(got, torch.stack([exact(row, p) for row in rows]))


def test_a_power_past_float64s_range_is_left_to_the_canonical_sum():
    """An exponent near float32's largest value: (H / log n)^e overflows Python's float for an H a
    rounding above log n; that row is not decided here, and the step returns the canonical T_dyn."""
    p = SamplingParams(temperature=1.0, dynatemp_range=0.5, dynatemp_exponent=3e38)
    assert ef.bracketed_temperature(math.log(5) * (1 + 1e-15), 5, p) is None
    rows = [torch.zeros(5), torch.tensor([0.0, 0.0, 0.0, 1e-7, NEG_INF]), torch.tensor([1.0, 0.0, 3.0])]
    for row in rows:
        assert bool(ef.dynamic_temperatures(row[None], [p])[0] == ef.dynamic_temperature(row, p))
