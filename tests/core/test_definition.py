"""Every step of the definition on hand-computed cases, through the reference and the Sampler."""

import math

import pytest
import torch

from support.runs import ENGINES, kept_ids, processed_values
from tokensampler import SamplingParams

engines = pytest.mark.parametrize("engine", sorted(ENGINES))
LOG = math.log


@engines
def test_top_k_keeps_border_ties(engine):
    assert kept_ids(engine, [3, 1, 2, 2, 0.5], SamplingParams(top_k=2)) == {0, 2, 3}
    assert kept_ids(engine, [3, 1, 2, 2, 0.5], SamplingParams(top_k=1)) == {0}
    assert kept_ids(engine, [3, 1, 2, 2, 0.5], SamplingParams(top_k=4)) == {0, 1, 2, 3}
    assert kept_ids(engine, [3, 1, 2, 2, 0.5], SamplingParams(top_k=50)) == {0, 1, 2, 3, 4}


@engines
def test_top_p_mass_strictly_above(engine):
    logits = [LOG(0.4), LOG(0.3), LOG(0.2), LOG(0.1)]
    assert kept_ids(engine, logits, SamplingParams(top_p=0.5)) == {0, 1}
    assert kept_ids(engine, logits, SamplingParams(top_p=0.4)) == {0}
    assert kept_ids(engine, logits, SamplingParams(top_p=0.75)) == {0, 1, 2}
    assert kept_ids(engine, logits, SamplingParams(top_p=1.0)) == {0, 1, 2, 3}
    # ties share their mass above: both 0.3's stay or go together
    tied = [LOG(0.4), LOG(0.3), LOG(0.3)]
    assert kept_ids(engine, tied, SamplingParams(top_p=0.45)) == {0, 1, 2}
    assert kept_ids(engine, tied, SamplingParams(top_p=0.4)) == {0}


@engines
def test_top_p_renormalises_after_top_k(engine):
    # after top_k=2 the kept probs are 0.4/0.7 = 0.571 and 0.3/0.7: p=0.56 keeps only id 0
    logits = [LOG(0.4), LOG(0.3), LOG(0.2), LOG(0.1)]
    assert kept_ids(engine, logits, SamplingParams(top_k=2, top_p=0.56)) == {0}
    assert kept_ids(engine, logits, SamplingParams(top_p=0.56)) == {0, 1}
    assert kept_ids(engine, logits, SamplingParams(top_k=2, top_p=0.58)) == {0, 1}


@engines
def test_min_p_relative_to_the_max(engine):
    logits = [LOG(0.5), LOG(0.3), LOG(0.15), LOG(0.05)]
    assert kept_ids(engine, logits, SamplingParams(min_p=0.25)) == {0, 1, 2}
    assert kept_ids(engine, logits, SamplingParams(min_p=0.5)) == {0, 1}
    assert kept_ids(engine, logits, SamplingParams(min_p=1.0)) == {0}
    assert kept_ids(engine, logits, SamplingParams(min_p=0.0)) == {0, 1, 2, 3}


@engines
def test_temperature_applies_before_min_p(engine):
    # at T=2 the ratio q1/q0 = sqrt(0.3/0.5) ~ 0.775 passes min_p 0.7; at T=1 it is 0.6 and fails
    logits = [LOG(0.5), LOG(0.3), LOG(0.2)]
    assert kept_ids(engine, logits, SamplingParams(min_p=0.7, temperature=2.0)) == {0, 1}
    assert kept_ids(engine, logits, SamplingParams(min_p=0.7, temperature=1.0)) == {0}


@engines
def test_penalties_exact_values(engine):
    # prompt [0, 1], output [2, 2]: repetition on 0, 1, 2; frequency and presence on 2 only
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    values = processed_values(engine, [2.0, -2.0, 1.0, 0.5], params, prompts=[[0, 1]], outputs=[[2, 2]])
    assert values.tolist() == [1.0, -4.0, 1.0 / 2.0 - 0.5 * 2 - 0.25, 0.5]


@engines
def test_presence_and_frequency_ignore_the_prompt(engine):
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=1.0)
    values = processed_values(engine, [1.0, 1.0, 1.0], params, prompts=[[0, 0, 1]], outputs=[[1]])
    assert values.tolist() == [1.0, -1.0, 1.0]


@engines
def test_logit_bias_and_allowed_ids(engine):
    params = SamplingParams(temperature=0.0, logit_bias={2: 3.0, 0: -500.0})
    assert processed_values(engine, [1.0, 2.0, 0.5], params).tolist() == [-99.0, 2.0, 3.5]
    assert kept_ids(engine, [5.0, 1.0, 2.0, 3.0], SamplingParams(allowed_token_ids=(1, 3))) == {1, 3}


@engines
def test_min_tokens_removes_stop_and_eos_until_reached(engine):
    params = SamplingParams(min_tokens=2, stop_token_ids=(1,))
    logits = [1.0, 5.0, 4.0, 0.0]
    assert kept_ids(engine, logits, params, eos=(2,), outputs=[[3]]) == {0, 3}
    assert kept_ids(engine, logits, params, eos=(2,), outputs=[[3, 3]]) == {0, 1, 2, 3}


@engines
def test_greedy_is_the_lowest_id_among_maxima_and_ignores_filters(engine):
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    params = [SamplingParams(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9, seed=5)]
    assert ENGINES[engine](logits, params).token_ids.tolist() == [1]


@engines
def test_sampled_token_is_the_gumbel_argmax(engine):
    from tokensampler.core import rng
    logits = torch.randn(1, 50)
    params = SamplingParams(temperature=0.7, seed=99)
    got = int(ENGINES[engine](logits, [params], positions=[13]).token_ids[0])
    g = rng.gumbel(99, 13, torch.arange(50))
    assert got == int(torch.argmax(logits[0] / torch.tensor(0.7) + g))


@engines
def test_bad_logits(engine):
    nan = float("nan")
    inf = float("inf")
    logits = torch.tensor([
        [nan, 1.0, nan, 0.5, 9.0, 9.0],   # NaN removed; ids 4, 5 are padding
        [-inf, -inf, -inf, -inf, 3.0, 3.0],  # nothing left: raw greedy over real ids -> 0, invalid
        [1.0, inf, 2.0, inf, 0.0, 0.0],   # +inf ids dominate, equally likely
        [nan, nan, nan, nan, nan, nan],   # nothing left
    ])
    params = [SamplingParams(seed=s) for s in range(4)]
    out = ENGINES[engine](logits, params, vocab_size=4)
    assert out.valid.tolist() == [True, False, True, False]
    assert out.token_ids[0] in (1, 3) and out.token_ids[2] in (1, 3)
    assert out.token_ids[1] == 0 and out.token_ids[3] == 0
    # every z / T underflows to -inf: nothing is left after temperature -> raw greedy id, invalid
    logits = torch.tensor([[-2e38, -1e38, -1e38, -3e38]])
    out = ENGINES[engine](logits, [SamplingParams(temperature=1e-3, seed=1)])
    assert out.token_ids.tolist() == [1] and out.valid.tolist() == [False]
    # allowed ids that are all removed -> the raw greedy id, flagged invalid
    logits = torch.tensor([[1.0, -inf, 5.0, 2.0]])
    out = ENGINES[engine](logits, [SamplingParams(allowed_token_ids=(1,))])
    assert out.token_ids.tolist() == [2] and out.valid.tolist() == [False]


@engines
def test_logprob_modes(engine):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = [SamplingParams(temperature=0.5, top_k=2, logprobs=3, seed=1)]
    raw = ENGINES[engine](logits, p, logprobs_mode="raw_logprobs").logprobs
    expected = torch.log_softmax(logits[0], -1)
    assert raw.top_token_ids.tolist() == [[0, 1, 2]]
    assert torch.allclose(raw.top_logprobs[0], expected[:3])
    proc = ENGINES[engine](logits, p, logprobs_mode="processed_logprobs").logprobs
    kept = torch.log_softmax(logits[0, :2] / 0.5, -1)
    assert torch.allclose(proc.top_logprobs[0, :2], kept) and proc.top_logprobs[0, 2] == float("-inf")
    raw_logits = ENGINES[engine](logits, p, logprobs_mode="raw_logits").logprobs
    assert raw_logits.top_logprobs[0].tolist() == [2.0, 1.0, 0.0]
    proc_logits = ENGINES[engine](logits, p, logprobs_mode="processed_logits").logprobs
    assert proc_logits.top_logprobs[0].tolist() == [4.0, 2.0, float("-inf")]
    token = int(raw.token_ids[0]) if hasattr(raw, "token_ids") else None
    assert token is None  # LogprobsOutput carries no token ids of its own


@engines
def test_rank_counts_ids_at_least_as_likely(engine):
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0, -1.0]])
    p = [SamplingParams(temperature=0.0, logprobs=0)]
    out = ENGINES[engine](logits, p)
    assert out.token_ids.tolist() == [1]
    assert out.logprobs.token_ranks.tolist() == [2]  # ids 1 and 2 have logprob >= the token's
    assert out.logprobs.top_token_ids.shape == (1, 0)
