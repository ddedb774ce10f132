"""ops/row_stats: the fused count-and-mass pass and the error bound top-p relies on.

The compiled mass may differ from the reference's (eager exp) by an ulp per id; the sampler
decides top-p at both ends of `mass_error` and recomputes the rows where they disagree. These tests
measure the bound on the compiled kernel and check that an uncertain row is recomputed.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("TOKENSAMPLER_COMPILE", "0")

import pytest
import torch

from tokensampler import SamplingParams
from tokensampler.ops import row_stats, select

from helpers import run_reference, run_sampler

NEG_INF = float("-inf")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in float32 ulps between non-negative finite floats (their bit patterns are ordered)."""
    return (a.view(torch.int32).to(torch.int64) - b.view(torch.int32).to(torch.int64)).abs()


def test_compiled_mass_is_within_the_error_bound(monkeypatch):
    """Inductor's exp is within 2 ulps of eager torch.exp over the range the mass sees, and the
    fused mass is within `mass_error` of `select.kept_mass` (eager exp, the reference's)."""
    from tokensampler import compile as ts_compile
    monkeypatch.setenv("TOKENSAMPLER_COMPILE", "1")
    gen = torch.Generator().manual_seed(5)
    x = torch.cat([-110 * torch.rand(1 << 20, generator=gen), -torch.rand(1 << 18, generator=gen) * 1e-3,
                   torch.tensor([0.0, -87.3, -103.9, -1e-30])])
    compiled_exp = ts_compile.maybe_compiled("test_exp", lambda t: torch.exp(t))
    assert int(_ulps(compiled_exp(x), torch.exp(x)).max()) <= 2
    from tokensampler.bench import make_logits
    for flat in (False, True):
        z = make_logits(6, 20000, flat=flat, seed=3) / 0.7
        z[1, ::3] = NEG_INF
        z_max = z.amax(dim=-1)
        lower = z_max - 20
        count, mass = row_stats.winnable_count_and_mass(z, z_max, lower)
        exact = select.kept_mass(z, z_max, torch.full_like(z_max, NEG_INF))
        assert torch.equal(count, (z >= lower[:, None]).sum(dim=-1))
        assert bool(((mass - exact).abs() <= row_stats.mass_error(exact, z.shape[1])).all())
        assert bool(((mass - exact).abs() > 0).any()) or not flat  # the bound is not vacuous here


@pytest.mark.parametrize("checked", [True, False])
def test_uncertain_top_p_rows_get_the_exact_mass(checked, monkeypatch):
    """p = 1, 1/2, 1/4, 1/4 with top_p = 0.75: the bound 1.5 equals the mass above the 1/4 ids, so
    they go. A whole-row mass off by 1e-7 (inside the error bound) would keep them; the sampler
    sees the row is uncertain and recomputes its mass. With the check switched off (error 0) the
    perturbed mass gives a different kept set: the test sees the difference."""
    real = row_stats._count_and_mass_eager

    def perturbed(z, z_max, lower, scale):
        count, mass = real(z, z_max, lower, scale)
        return count, mass * (1 + 1e-7)

    monkeypatch.setattr(row_stats, "_count_and_mass_eager", perturbed)
    if not checked:
        monkeypatch.setattr(row_stats, "MASS_RELATIVE_ERROR", 0.0)
    row = [0.0, math.log(0.5), math.log(0.25), math.log(0.25)] + [NEG_INF] * 60
    logits = torch.tensor([row, row])
    params = [SamplingParams(top_p=0.75, seed=s, logprobs=4) for s in (1, 2)]
    want = run_reference(logits, params, logprobs_mode="processed_logits")
    got = run_sampler(logits, params, logprobs_mode="processed_logits")
    kept = {int(i) for i, v in zip(got.logprobs.top_token_ids[0], got.logprobs.top_logprobs[0]) if v > NEG_INF}
    if checked:
        assert kept == {0, 1}
        assert torch.equal(want.logprobs.top_logprobs, got.logprobs.top_logprobs)
    else:
        assert kept == {0, 1, 2, 3}
