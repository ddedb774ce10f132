"""backends/torch_step/candidates.py: steps 7-11 of sampled rows, called directly.

The not-in-place form (the caller's own logits, divided by T only where they are read) must give
the definition's tokens on every path that reads values through the undivided-row scale: the
one-pass tail, the tail of rows computed later, and a min-p threshold below the candidate list.
Also: the dense route without a caller's buffer, and the +inf rule after the temperature.
"""

from __future__ import annotations

import torch

from tokensampler import SamplingParams
from tokensampler.backends.torch_step import candidates
from tokensampler.backends.torch_step.routes import Values
from tokensampler.core import rng
from tokensampler.reference import ReferenceRequest, reference_sample_row

NEG_INF = float("-inf")
FIRST_SEED = 100  # row r draws its noise with seed FIRST_SEED + r
POSITION = 7


def _columns(temperature: float, top_p: list[float], min_p: float = 0.0, dense_buffer=None) -> candidates.RowColumns:
    rows = len(top_p)
    min_p_t = torch.full((rows,), min_p, dtype=torch.float32)
    top_p_t = torch.tensor(top_p, dtype=torch.float64)
    keys = rng.row_key(FIRST_SEED + torch.arange(rows), POSITION)
    return candidates.RowColumns(torch.full((rows,), temperature, dtype=torch.float32), min_p_t,
                            torch.zeros(rows, dtype=torch.int64), top_p_t, keys, min_p > 0, False,
                            bool((top_p_t < 1.0).any()), dense_buffer)


def _reference_tokens(logits: torch.Tensor, temperature: float, top_p: list[float], min_p: float = 0.0) -> list[int]:
    tokens = []
    for r in range(logits.shape[0]):
        seed = FIRST_SEED + r
        params = SamplingParams(temperature=temperature, top_p=top_p[r], min_p=min_p, seed=seed)
        tokens.append(reference_sample_row(logits[r], ReferenceRequest(params, seed, POSITION), logits.shape[1])[0])
    return tokens


def _peaked_rows(rows: int = 8) -> torch.Tensor:
    """Undivided logits for T = 0.1: z / T is 0 at id 0, -3 at ids 1-50 (the candidate list) and -25
    on a 20000-id tail below the winnable floor (z_max - 20.2)."""
    z = torch.full((rows, 20051), -2.5)
    z[:, 0] = 0.0
    z[:, 1:51] = -0.3
    return z


def test_not_in_place_rows_give_the_in_place_tokens():
    logits = _peaked_rows()
    cases = [
        ([0.2] * 8, 0.0),  # every row top-p only: the tail comes from the one-pass count
        ([0.2] * 7 + [1.0], 0.0),  # a row without top-p: the rows' tails are computed afterwards
        ([0.9] * 8, 1e-12),  # min-p keeps ids below the list: its threshold from the whole row
    ]
    for top_p, min_p in cases:
        want = _reference_tokens(logits, 0.1, top_p, min_p)
        z_max = logits.amax(dim=-1)
        kept = logits.clone()
        got = candidates.sample_rows(kept, z_max, _columns(0.1, top_p, min_p), exact_threshold=False,
                                       values=Values.DIVIDED_WHERE_READ)
        assert got is not None and torch.equal(kept, logits)  # nothing written
        assert got[0].tolist() == want, (top_p, min_p)
        divided = candidates.sample_rows(logits.clone(), z_max, _columns(0.1, top_p, min_p), exact_threshold=False)
        assert divided[0].tolist() == want, (top_p, min_p)
    assert len(set(_reference_tokens(logits, 0.1, [0.9] * 8, 1e-12))) > 1  # the cases tell the kept sets apart


def test_dense_route_without_a_buffer():
    logits = torch.randn(3, 20000, generator=torch.Generator().manual_seed(4))
    top_p = [0.9, 0.5, 0.95]
    got = candidates.sample_rows(logits.clone(), logits.amax(dim=-1), _columns(1.0, top_p), exact_threshold=True)
    assert got[0].tolist() == _reference_tokens(logits, 1.0, top_p)


def test_temperature_overflow_applies_the_posinf_rule():
    z = torch.tensor([[3e38, 2.9e38, 1.0, -5.0], [1.0, 2.0, 3.0, 4.0]])
    new_max = candidates.apply_temperature(z, z.amax(dim=-1), torch.tensor([0.5, 2.0]))
    assert new_max.tolist() == [0.0, 2.0]
    assert z.tolist() == [[0.0, 0.0, NEG_INF, NEG_INF], [0.5, 1.0, 1.5, 2.0]]


def test_exact_threshold_below_the_candidate_list():
    """Processed logprobs need the exact kept set: a top-p crossing inside the tail below the list
    (here the last ~1e-7 of the mass) is found by the histogram search."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.full((2, 20051), -25.0) + torch.rand(2, 20051, generator=gen)
    logits[:, 0] = 0.0
    logits[:, 1:51] = -3.0
    top_p = [1.0 - 3e-8, 1.0 - 3e-8]
    _, tau = candidates.sample_rows(logits.clone(), logits.amax(dim=-1), _columns(1.0, top_p), exact_threshold=True)
    for r in range(2):
        params = SamplingParams(top_p=top_p[r], seed=FIRST_SEED + r)
        request = ReferenceRequest(params, FIRST_SEED + r, POSITION)
        _, _, (_, final) = reference_sample_row(logits[r], request, 20051,
                                                "processed_logits")
        kept = torch.isfinite(final)
        assert 51 < int(kept.sum()) < 20051  # the threshold cuts the tail
        assert torch.equal(logits[r] >= tau[r], kept)


def test_more_rows_than_the_sorted_head_with_short_lists():
    """80 top-p rows whose candidate lists (51 ids) are shorter than the sorted head (64)."""
    logits = torch.full((80, 2000), -25.0)
    logits[:, 0] = 0.0
    logits[:, 1:51] = -torch.arange(1, 51, dtype=torch.float32) / 10
    top_p = [0.3] * 80
    got = candidates.sample_rows(logits.clone(), logits.amax(dim=-1), _columns(1.0, top_p), exact_threshold=False)
    assert got[0].tolist() == _reference_tokens(logits, 1.0, top_p)
