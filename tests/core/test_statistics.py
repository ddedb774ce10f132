"""Distribution: over many seeds, sampled frequencies match the exact filtered distribution.

The expected distribution is computed here in float64 from the textbook formulas, independently of
the library; a chi-square test with fixed seeds (deterministic) must not reject it, and must reject
a distribution that is off (wrong temperature, filter not applied).
"""

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from tokensampler import Sampler, SamplingParams

LOGITS = np.array([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -3.0])
ROWS, STEPS = 2_000, 10  # 20,000 draws: 2,000 seeds, 10 positions each


def exact_distribution(logits, temperature, top_k, top_p, min_p):
    z = logits / temperature
    q = np.exp(z - z.max())
    q /= q.sum()
    kept = q >= min_p * q.max()
    if top_k:
        kth = np.sort(z[kept])[::-1][min(top_k, kept.sum()) - 1]
        kept &= z >= kth
    if top_p < 1.0:
        qk = np.where(kept, q, 0.0)
        qk /= qk.sum()
        mass_above = np.array([qk[z > z[i]].sum() for i in range(len(z))])
        kept &= mass_above < top_p
    out = np.where(kept, q, 0.0)
    return out / out.sum()


def sampled_counts(params_by_row, logits):
    sampler = Sampler(len(logits), max_slots=ROWS)
    for row in range(ROWS):
        sampler.add_request(row, params_by_row(row), [])
    batch = torch.tensor(logits, dtype=torch.float32).expand(ROWS, -1).contiguous()
    tokens = torch.cat([sampler.sample(batch).token_ids for _ in range(STEPS)])
    return np.bincount(tokens.numpy(), minlength=len(logits))


def chi2_pvalue(counts, probs):
    support = probs > 0
    assert counts[~support].sum() == 0, "a removed id was sampled"
    return stats.chisquare(counts[support], probs[support] * counts.sum()).pvalue


COMBOS = list(itertools.product([0.5, 1.0, 1.7], [0, 3], [1.0, 0.8], [0.0, 0.2]))


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", COMBOS)
def test_frequencies_match_the_filtered_distribution(temperature, top_k, top_p, min_p):
    params = lambda row: SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                        seed=1_000_003 * row + 17)
    counts = sampled_counts(params, LOGITS)
    probs = exact_distribution(LOGITS, temperature, top_k, top_p, min_p)
    assert chi2_pvalue(counts, probs) > 1e-4


def test_positions_give_fresh_draws():
    """One seed, many positions: the same request's successive tokens follow the distribution."""
    vocab = len(LOGITS)
    sampler = Sampler(vocab, max_slots=1)
    sampler.add_request(0, SamplingParams(seed=5, temperature=1.0), [])
    logits = torch.tensor(LOGITS, dtype=torch.float32)[None]
    tokens = [int(sampler.sample(logits).token_ids[0]) for _ in range(2000)]
    counts = np.bincount(tokens, minlength=vocab)
    assert chi2_pvalue(counts, exact_distribution(LOGITS, 1.0, 0, 1.0, 0.0)) > 1e-4


def test_the_test_rejects_a_wrong_distribution():
    params = lambda row: SamplingParams(temperature=1.0, seed=1_000_003 * row + 17)
    counts = sampled_counts(params, LOGITS)
    wrong_temperature = exact_distribution(LOGITS, 1.2, 0, 1.0, 0.0)
    assert stats.chisquare(counts, wrong_temperature * counts.sum()).pvalue < 1e-6
    no_filter = exact_distribution(LOGITS, 1.0, 0, 1.0, 0.0)
    counts_top_k = sampled_counts(lambda row: SamplingParams(top_k=3, seed=row), LOGITS)
    assert counts_top_k[3:].sum() == 0
    assert stats.chisquare(counts_top_k + 1, no_filter * (counts_top_k.sum() + 8)).pvalue < 1e-6
