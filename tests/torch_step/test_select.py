"""backends/torch_step/select.py: the sort-free thresholds, on hand-computed rows."""

from __future__ import annotations

import pytest
import torch

from tokensampler.backends.torch_step import select

NEG_INF = float("-inf")


def test_histogram_top_p_sums_masses_in_float64():
    """total = 1 + e^-17 is 1 in float32: id 1's mass above (1) is below top_p * total only in float64,
    so the threshold is id 1's value (the definition keeps both ids)."""
    tau = select.top_p_by_histogram(torch.tensor([[0.0, -17.0]]), torch.tensor([0.0]), torch.tensor([NEG_INF]),
                                    top_p=torch.tensor([1.0 - 2e-8], dtype=torch.float64))
    assert tau.tolist() == [-17.0]


def test_kept_mass_sums_every_column_chunk():
    z = torch.randn(2, 70000, generator=torch.Generator().manual_seed(3)) * 2  # wider than one column chunk
    z_max = z.amax(dim=-1)
    p = torch.exp(z - z_max[:, None])
    for tau in (torch.tensor([NEG_INF, NEG_INF]), torch.tensor([0.5, -1.0])):
        want = torch.where(z >= tau[:, None], p, 0.0).to(torch.float64).sum(dim=-1)
        assert torch.allclose(select.kept_mass(z, z_max, tau), want, rtol=1e-12, atol=0.0)


def test_histogram_top_p_when_only_the_max_is_kept():
    """tau = z_max leaves one value and a zero-width histogram (a removed -inf id included)."""
    z = torch.tensor([[1.0, NEG_INF, 0.5, 1.0], [1.0, NEG_INF, 0.5, 1.0]])
    tau = select.top_p_by_histogram(z, torch.tensor([1.0, 1.0]), torch.tensor([1.0, NEG_INF]),
                                    top_p=torch.tensor([0.5, 0.6], dtype=torch.float64))
    assert tau.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("scaled", [False, True])
def test_the_candidate_list_is_every_id_at_or_above_lower_in_id_order(rows, scaled):
    """One row (its own path) and several: the listed values (divided by scale when given) and ids
    are exactly the ids with z >= lower, ascending, padded with -inf / id 0."""
    gen = torch.Generator().manual_seed(rows)
    z = torch.randn(rows, 5000, generator=gen) * 3
    lower = torch.tensor([2.0, 4.0, 9.0][:rows])
    scale = torch.tensor([0.7, 1.3, 2.0][:rows]) if scaled else None
    values, ids, count = select.gather_candidates(z, lower, cap=5000, scale=scale)
    for r in range(rows):
        want = (z[r] >= lower[r]).nonzero().squeeze(-1)
        n = want.numel()
        assert int(count[r]) == n and torch.equal(ids[r, :n], want) and not ids[r, n:].any()
        expected = z[r, want] if scale is None else z[r, want] / scale[r]
        assert torch.equal(values[r, :n], expected) and bool(torch.isneginf(values[r, n:]).all())
