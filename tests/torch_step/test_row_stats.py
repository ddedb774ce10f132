"""backends/torch_step/row_stats.py: the compiled count and tail passes, and the error bound top-p relies on.

The compiled tail mass may differ from the reference's (eager exp) by an ulp per id; the sampler
decides top-p at both ends of `mass_error` and recomputes the rows where they disagree. These tests
measure the bound on the compiled kernel and check that an uncertain row is recomputed.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.runs import run_reference, run_sampler
from tokensampler import SamplingParams
from tokensampler.backends.torch_step import row_stats

NEG_INF = float("-inf")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in float32 ulps between non-negative finite floats (their bit patterns are ordered)."""
    return (a.view(torch.int32).to(torch.int64) - b.view(torch.int32).to(torch.int64)).abs()


def test_compiled_tail_is_within_the_error_bound():
    """Inductor's exp is within 2 ulps of eager torch.exp over the range the mass sees, and the
    compiled tail is within `mass_error` of the eager sum (the reference's exp), with and without a
    scale (undivided rows)."""
    from tokensampler.backends.torch_step import compile_cache
    gen = torch.Generator().manual_seed(5)
    x = torch.cat([-110 * torch.rand(1 << 20, generator=gen), -torch.rand(1 << 18, generator=gen) * 1e-3,
                   torch.tensor([0.0, -87.3, -103.9, -1e-30])])
    compiled_exp = compile_cache.maybe_compiled("test_exp", lambda t: torch.exp(t), True)
    assert int(_ulps(compiled_exp(x), torch.exp(x)).max()) <= 2
    from tokensampler.tools.workloads import make_logits
    for flat in (False, True):
        raw = make_logits(6, 20000, flat=flat, seed=3)
        raw[1, ::3] = NEG_INF
        scale = torch.full((6,), 0.7)
        z = raw / 0.7
        z_max = z.amax(dim=-1)
        floor = z_max - 6
        want_count = (z >= floor[:, None]).sum(dim=-1)
        p = torch.exp(z - z_max[:, None])
        exact = torch.where(z >= floor[:, None], 0.0, p).to(torch.float64).sum(dim=-1)
        for rows, given_floor, given_scale in ((z, floor, None), (raw, floor * 0.7, scale)):
            tail = row_stats.tail_mass(rows, z_max, given_floor, given_scale, compiled=True)
            if given_scale is None:
                assert torch.equal(row_stats.winnable_count(rows, given_floor, compiled=True), want_count)
            assert bool(((tail - exact).abs() <= row_stats.mass_error(exact, z.shape[1])).all())
        tail = row_stats.tail_mass(z, z_max, floor, compiled=True)
        assert bool(((tail - exact).abs() > 0).any())  # the bound is not vacuous here


@pytest.mark.parametrize("checked", [True, False])
def test_uncertain_top_p_rows_get_the_exact_mass(checked, monkeypatch):
    """p = 1, 1/2, 1/4, 1/4 (+ a tail of tiny p) with top_p * total just below 1.5, the mass above
    the 1/4 ids, so they go. A tail off by 4e-7 of itself (inside the error bound) would keep them;
    the sampler sees the row is uncertain and recomputes its mass. With the check
    switched off (error 0) the perturbed tail gives a different kept set: the test sees it."""
    real = row_stats._tail_eager

    def perturbed(*args):
        return real(*args) * (1 + 4e-7)  # inside MASS_RELATIVE_ERROR = 2^-21

    monkeypatch.setattr(row_stats, "_tail_eager", perturbed)
    if not checked:
        monkeypatch.setattr(row_stats, "MASS_RELATIVE_ERROR", 0.0)
    tail = [-20.5] * 2000  # below the winnable floor (~ -20.1): their p (1.25e-9 each) is the tail
    row = [0.0, math.log(0.5), math.log(0.25), math.log(0.25)] + tail + [NEG_INF] * 20
    logits = torch.tensor([row, row])
    total = 2.0 + 2000 * float(torch.exp(torch.tensor(-20.5)).double())
    top_p = (1.5 - 1e-13) / total  # the bound lands just below 1.5: the 1/4 ids go
    params = [SamplingParams(top_p=top_p, seed=s, logprobs=4) for s in (1, 2)]
    want = run_reference(logits, params, logprobs_mode="processed_logits")
    got = run_sampler(logits, params, logprobs_mode="processed_logits")
    kept = {int(i) for i, v in zip(got.logprobs.top_token_ids[0], got.logprobs.top_logprobs[0]) if v > NEG_INF}
    if checked:
        assert kept == {0, 1}
        assert torch.equal(want.logprobs.top_logprobs, got.logprobs.top_logprobs)
    else:
        assert kept == {0, 1, 2, 3}


def test_eager_count_and_tail_split_the_row_at_the_floor():
    """Ids at the floor are counted, not in the tail; with `scale` the rows are read as z * scale."""
    z = torch.tensor([[0.0, -1.0, -2.0, -3.0, NEG_INF], [1.0, -0.5, -0.5, -4.0, -8.0]])
    z_max, floor = z.amax(dim=-1), torch.tensor([-2.0, -0.5])
    p = torch.exp(z - z_max[:, None])
    want = torch.where(z < floor[:, None], p, 0.0).to(torch.float64).sum(dim=-1)
    half = torch.tensor([0.5, 0.5])
    for tail in (row_stats.tail_mass(z, z_max, floor), row_stats.tail_mass(z * 0.5, z_max, floor * 0.5, half),
                 row_stats.winnable_count_and_tail(z, z_max, floor)[1],
                 row_stats.winnable_count_and_tail(z * 0.5, z_max, floor * 0.5, half)[1]):
        assert torch.allclose(tail, want, rtol=1e-12, atol=0.0), tail
    assert row_stats.winnable_count(z, floor).tolist() == [3, 3]
    assert row_stats.winnable_count_and_tail(z * 0.5, z_max, floor * 0.5, half)[0].tolist() == [3, 3]
