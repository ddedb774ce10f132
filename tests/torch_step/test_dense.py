"""backends/torch_step/dense.py (the dense route for flat rows) against reference.py and its own parts.

Token for token (and the processed logprobs, which show the kept set) on flat rows with the dense
route forced (`TorchStepConfig(candidate_cap=0)`): top-p alone and with min-p / top-k, ties, -inf ids; then
each fallback on purpose: the bracket too wide for the scan (histogram), the uncertain-row recheck
(an error bound made huge), a race with too many passers, a proxy sought below the final threshold.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.runs import run_reference, run_sampler
from tokensampler import SamplingParams
from tokensampler.backends.torch_step import dense, gumbel, select
from tokensampler.backends.torch_step.config import TorchStepConfig
from tokensampler.core import rng
from tokensampler.tools.workloads import make_logits

NEG_INF = float("-inf")


DENSE = TorchStepConfig(candidate_cap=0)  # every sampled row takes the dense route


def assert_same(logits, params, mode="processed_logprobs", config=DENSE):
    want = run_reference(logits, params, logprobs_mode=mode)
    got = run_sampler(logits, params, logprobs_mode=mode, config=config)
    assert torch.equal(want.token_ids, got.token_ids), (want.token_ids, got.token_ids)
    if want.logprobs is not None:
        assert torch.equal(want.logprobs.top_token_ids, got.logprobs.top_token_ids)
        assert torch.equal(want.logprobs.top_logprobs, got.logprobs.top_logprobs)
        assert torch.equal(want.logprobs.token_ranks, got.logprobs.token_ranks)


@pytest.fixture
def dense_route(monkeypatch):
    """The spies' monkeypatch (the dense route itself is `assert_same`'s default config)."""
    return monkeypatch


class Spy:
    """Counts the rows a function is called on (first argument's first dimension)."""

    def __init__(self, monkeypatch, module, name):
        self.rows = 0
        original = getattr(module, name)

        def wrapped(*args, **kwargs):
            self.rows += args[0].shape[0]
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapped)


def flat_batch(rows: int, vocab: int, seed: int, style: str = "flat") -> torch.Tensor:
    logits = make_logits(rows, vocab, flat=True, seed=seed)
    if style == "ties":
        logits = (logits * 4).round() / 4  # many equal values, also at the top-p border
    elif style == "neginf":
        gen = torch.Generator().manual_seed(seed)
        logits[torch.rand(logits.shape, generator=gen) < 0.3] = NEG_INF
    return logits


def params_for(rows: int, seed: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(seed=seed * 100 + r, logprobs=3, **kw) for r in range(rows)]


@pytest.mark.parametrize("style", ["flat", "ties", "neginf"])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_rows_match_reference(style, top_p, dense_route):
    noise = Spy(dense_route, gumbel, "gumbel_argmax_dense")
    histogram = Spy(dense_route, select, "top_p_by_histogram")
    recheck = Spy(dense_route, dense, "exact_masses")
    for seed in range(3):
        logits = flat_batch(4, 5000, seed, style)
        assert_same(logits, params_for(4, seed, temperature=1.0, top_p=top_p))
    assert noise.rows <= 6  # the race decides most of the 12 rows without the approximate-noise pass
    assert histogram.rows == 0 and recheck.rows == 0  # the bracket holds the threshold, surely


@pytest.mark.parametrize("extra", [{"min_p": 0.001}, {"min_p": 0.2}, {"top_k": 50}, {"top_k": 3000},
                                   {"top_k": 700, "min_p": 0.0005}])
def test_top_p_with_min_p_and_top_k_matches_reference(extra, dense_route):
    for seed in range(2):
        logits = flat_batch(3, 4000, seed + 10)
        params = params_for(3, seed, temperature=0.9, top_p=0.8, **extra)
        params[1] = SamplingParams(seed=7, temperature=1.3, logprobs=2, **extra)  # a row without top-p
        assert_same(logits, params)


def test_mixed_vocabularies_and_small_rows(dense_route):
    for vocab in (1, 2, 17, 64, 65, 300, 129 * 64):
        logits = flat_batch(3, vocab, vocab)
        assert_same(logits, params_for(3, vocab, temperature=1.0, top_p=0.7))


def test_bracket_too_wide_uses_the_histogram(dense_route):
    histogram = Spy(dense_route, select, "top_p_by_histogram")
    logits = flat_batch(3, 3000, 1)
    assert_same(logits, params_for(3, 1, temperature=1.0, top_p=0.9),
                config=TorchStepConfig(candidate_cap=0, dense_bracket_cap=0))
    assert histogram.rows == 3


def test_misplaced_candidates_still_bracket_the_threshold(dense_route):
    """Candidates far from the crossing (the estimate is only a guide): the bracket is wide but
    still provably holds the threshold."""
    for offsets in [(0,), (-1000, 1000), (5, 6)]:
        config = TorchStepConfig(candidate_cap=0, dense_threshold_offsets=offsets, dense_proxy_column=1,
                              dense_sample_stride=7)
        logits = flat_batch(3, 3000, 2)
        assert_same(logits, params_for(3, 2, temperature=1.0, top_p=0.6), config=config)


def test_uncertain_rows_are_rechecked_with_exact_masses(dense_route):
    """A huge error bound makes every row uncertain: each gets masses summed as kept_mass does."""
    recheck = Spy(dense_route, dense, "exact_masses")
    dense_route.setattr(dense, "sum_error", lambda masses, count: masses * 1e-3 + 1e-3)
    logits = flat_batch(4, 4000, 3)
    assert_same(logits, params_for(4, 3, temperature=1.0, top_p=0.9))
    assert recheck.rows >= 4


def test_crowded_race_falls_back_to_the_dense_noise(dense_route):
    """A weak lower bound (tiny odds) lets many ids pass the race: those rows take the
    approximate-noise pass, and the token is unchanged."""
    noise = Spy(dense_route, gumbel, "gumbel_argmax_dense")
    original = dense.race_argmax
    dense_route.setattr(dense, "race_argmax", lambda p, z, z_max, threshold, keys, odds, *rest:
                        original(p, z, z_max, threshold, keys, odds * 1e-3, *rest))
    logits = flat_batch(3, 3000, 4)
    assert_same(logits, params_for(3, 4, temperature=1.0, top_p=0.9))
    assert noise.rows == 3


def test_proxy_below_the_final_threshold_is_sought_again(dense_route):
    """S_lo must come from kept ids: a proxy floor below the final threshold is redone."""
    passes = Spy(dense_route, dense, "threshold_pass")
    proxy = TorchStepConfig().dense_thresholds - 1  # the floor is tau (-inf)
    logits = flat_batch(3, 3000, 5)
    assert_same(logits, params_for(3, 5, temperature=1.0, top_p=0.3),
                config=TorchStepConfig(candidate_cap=0, dense_proxy_column=proxy))
    assert passes.rows == 6  # once for all rows, once again for each top-p row


def exact_argmax(z, threshold, keys):
    ids = torch.arange(z.shape[1])
    scores = z + rng.gumbel_from_bits(rng.random_bits(keys[:, None], ids[None, :]))
    scores = scores.masked_fill((z < threshold[:, None]) | torch.isneginf(z), NEG_INF)
    return scores.argmax(dim=-1)  # first maximum: the lowest id on ties


def test_race_argmax_is_the_exact_gumbel_argmax():
    gen = torch.Generator().manual_seed(8)
    z = torch.randn(40, 2000, generator=gen) * torch.rand(40, 1, generator=gen) * 3
    z[3, 100:] = NEG_INF
    z[4, :] = 2.0  # all tied: the noise alone decides
    z_max = z.amax(dim=-1)
    threshold = torch.quantile(z.clamp(min=-10), 0.5, dim=-1)
    threshold[4] = NEG_INF
    keys = rng.row_key(torch.arange(40) * 31, torch.arange(40), 0)
    p = select.relative_probs(z, z_max)
    floor = threshold.clone()
    _, odds = dense.threshold_pass(p, z, torch.full((40, TorchStepConfig().dense_thresholds), NEG_INF),
                                   rng.to_int32_words(keys), floor)
    tokens = dense.race_argmax(p, z, z_max, threshold, keys, odds)
    assert torch.equal(tokens, exact_argmax(z, threshold, keys))


def test_race_pair_of_equal_scores_goes_to_the_lower_id(monkeypatch):
    """Two passers with exactly equal exact scores: the lower id wins."""
    keys = rng.row_key(torch.tensor([5]), torch.tensor([9]), 0)
    g = rng.gumbel_from_bits(rng.random_bits(keys, torch.arange(2)))
    z = torch.full((1, 2), 0.0)
    z[0, 1] = float(g[0] - g[1])
    scores = z[0] + g
    if scores[0] != scores[1]:  # rounding: move id 0 onto id 1's score instead
        z[0, 0] = float(scores[1] - g[0])
        scores = z[0] + g
    assert scores[0] == scores[1]
    p = select.relative_probs(z, z.amax(dim=-1))
    odds = torch.tensor([1e-3])  # both ids pass
    token = dense.race_argmax(p, z, z.amax(dim=-1), torch.full((1,), NEG_INF), keys, odds)
    assert int(token[0]) == 0


def test_extract_lists_the_bracket_of_rows_within_the_cap():
    z = torch.tensor([[3.0, 1.0, 2.0, NEG_INF, 2.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    values, count = dense._extract(z, torch.tensor([NEG_INF, 2.0]), torch.tensor([3.0, 5.0]), cap=3)
    assert count.tolist() == [3, 3]
    assert values.tolist() == [[2.0, 2.0, 1.0], [4.0, 3.0, 2.0]]
    values, count = dense._extract(z, torch.tensor([NEG_INF, 2.0]), torch.tensor([3.0, 5.0]), cap=2)
    assert count.tolist() == [3, 3] and bool(torch.isneginf(values).all())  # over the cap: not listed


def test_sorted_descending_matches_torch_sort():
    values = torch.randn(5, 300)
    values[1, :40] = NEG_INF
    values[2] = values[2].round()
    assert torch.equal(dense.sorted_descending(values), torch.sort(values, dim=-1, descending=True).values)


def test_relative_probs_writes_into_the_given_buffer():
    z = torch.randn(3, 50)
    buffer = torch.empty(200)
    first = select.relative_probs(z, z.amax(dim=-1), buffer)
    assert torch.equal(first, torch.exp(z - z.amax(dim=-1)[:, None]))
    assert first.data_ptr() == buffer.data_ptr()
    second = select.relative_probs(z[:2], z[:2].amax(dim=-1), buffer)
    assert second.data_ptr() == buffer.data_ptr()
    assert torch.equal(select.relative_probs(z, z.amax(dim=-1)), first)  # no buffer: a new tensor
