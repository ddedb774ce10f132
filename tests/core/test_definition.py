"""Every step of the definition on hand-computed cases, through the reference and the Sampler."""

import math

import pytest
import torch

from tests.support.runs import ENGINES, kept_ids, processed_values
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


def test_bitmask_bits_are_read_least_significant_first():
    from tokensampler.reference import bitmask_allowed_ids
    # row 0: bits 0, 1, 3 and 31 (the sign bit) of word 0, bits 0 and 7 of word 1 (ids 32, 39; 39 >= V)
    bitmask = torch.tensor([[-(2**31) + 0b1011, 0b10000001], [-1, 0]], dtype=torch.int32)
    assert bitmask_allowed_ids(bitmask, 36) == [{0, 1, 3, 31, 32}, set(range(32))]


def test_the_step_token_bitmask_removes_every_other_id():
    from tokensampler.reference import ReferenceRequest, reference_sample
    logits = torch.tensor([[5.0, 1.0, 2.0, 3.0], [5.0, 1.0, 2.0, 3.0]])
    requests = [ReferenceRequest(SamplingParams(temperature=0.0, logprobs=-1), 0, 0)] * 2
    # row 0: ids 1 and 3 (4 and 40 lie beyond the vocabulary); row 1: no constraint
    out = reference_sample(logits, requests, logprobs_mode="processed_logits", allowed=[{1, 3, 4, 40}, None])
    assert out.token_ids.tolist() == [3, 0] and out.valid.tolist() == [True, True]
    assert out.logprobs.top_token_ids.tolist() == [[3, 1, 0, 2], [0, 3, 2, 1]]
    assert out.logprobs.top_logprobs[0].tolist() == [3.0, 1.0, float("-inf"), float("-inf")]


def test_bad_word_ids_follow_the_output_suffix():
    from tokensampler.reference import bad_word_ids
    words = ((5,), (1, 2, 6), (3, 1, 2, 7), (2, 4), (1, 8), (9, 3, 1, 2, 10))
    params = SamplingParams(bad_words_token_ids=words)
    assert bad_word_ids(params, [3, 1, 2]) == {5, 6, 7, 4}  # (1, 8): 1 does not end the output; the last is too long
    assert bad_word_ids(params, []) == {5}


@engines
def test_bad_words_remove_their_last_token(engine):
    params = SamplingParams(bad_words_token_ids=((1,), (3, 2)))
    assert kept_ids(engine, [1.0, 2.0, 3.0, 4.0], params, outputs=[[0, 3]]) == {0, 3}
    assert kept_ids(engine, [1.0, 2.0, 3.0, 4.0], params, outputs=[[3, 0]]) == {0, 2, 3}


@engines
def test_logit_bias_is_added_in_float32(engine):
    # float32(2^-24 + 2^-50) = 2^-24, and 1 + 2^-24 rounds to 1 (ties to even); a float64 sum would round up
    params = SamplingParams(temperature=0.0, logit_bias={0: 2.0**-24 + 2.0**-50})
    assert processed_values(engine, [1.0, 0.0], params).tolist() == [1.0, 0.0]


@engines
def test_repetition_penalty_applies_from_the_first_occurrence(engine):
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert processed_values(engine, [2.0, 2.0, -2.0], params, outputs=[[1, 2]]).tolist() == [2.0, 1.0, -4.0]


@engines
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_are_computed_in_float32(engine, dtype):
    """Every step runs on the float32 values of the logits: a half-precision row gives exactly the
    output of its float32 copy (values, ranks and the sampled token)."""
    logits = (torch.randn(4, 300, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    for mode in ("raw_logprobs", "processed_logprobs"):
        params = [SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.3, logprobs=5, seed=s)
                  for s in range(4)]
        half = ENGINES[engine](logits, params, logprobs_mode=mode, outputs=[[1, 2]] * 4)
        full = ENGINES[engine](logits.float(), params, logprobs_mode=mode, outputs=[[1, 2]] * 4)
        assert half.token_ids.tolist() == full.token_ids.tolist()
        assert torch.equal(half.logprobs.top_token_ids, full.logprobs.top_token_ids)
        assert torch.equal(half.logprobs.top_logprobs, full.logprobs.top_logprobs)
        assert torch.equal(half.logprobs.token_logprobs, full.logprobs.token_logprobs)


@engines
def test_top_p_one_keeps_every_id_and_the_total_is_a_float64_sum(engine):
    # with top_p = 1 nothing is removed, even ids whose mass is below the total's float64 rounding
    assert kept_ids(engine, [0.0, -50.0, -60.0], SamplingParams(top_p=1.0)) == {0, 1, 2}
    # total = 1 + e^-17 (1 in float32): id 1's mass above (1) is < top_p * total only in float64
    assert kept_ids(engine, [0.0, -17.0], SamplingParams(top_p=1.0 - 2e-8)) == {0, 1}


@engines
def test_top_k_larger_than_the_vocabulary_keeps_the_min_p_set(engine):
    logits = [LOG(0.5), LOG(0.3), LOG(0.15), LOG(0.05)]
    assert kept_ids(engine, logits, SamplingParams(min_p=0.5, top_k=50)) == {0, 1}


@engines
def test_processed_values_of_greedy_and_invalid_rows(engine):
    inf = float("inf")
    logits = torch.tensor([[1.0, 3.0, 2.0], [-inf, -inf, -inf]])
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(seed=3, logprobs=3)]
    out = ENGINES[engine](logits, params, logprobs_mode="processed_logprobs")
    assert out.token_ids.tolist() == [1, 0] and out.valid.tolist() == [True, False]
    assert out.logprobs.top_token_ids.tolist() == [[1, 2, 0], [0, 1, 2]]
    assert torch.allclose(out.logprobs.top_logprobs[0], torch.log_softmax(torch.tensor([3.0, 2.0, 1.0]), -1))
    assert out.logprobs.top_logprobs[1].tolist() == [-inf] * 3  # every id removed: -inf, not NaN
    raw = ENGINES[engine](logits, params, logprobs_mode="raw_logprobs").logprobs
    assert raw.top_logprobs[1].tolist() == [-inf] * 3


@engines
def test_the_stream_selects_the_noise(engine):
    from tokensampler.core import rng
    logits = torch.zeros(8, 50)
    params = [SamplingParams(seed=40 + b) for b in range(8)]
    streams = [1, 2, 3, 4, 5, 6, 7, 9]
    out = ENGINES[engine](logits, params, positions=[7] * 8, streams=streams)
    want = [int(torch.argmax(rng.gumbel(40 + b, 7, torch.arange(50), streams[b]))) for b in range(8)]
    assert out.token_ids.tolist() == want
    assert want != [int(torch.argmax(rng.gumbel(40 + b, 7, torch.arange(50)))) for b in range(8)]


def test_reference_logprobs_layout():
    """Rows asking nothing, fewer or more ids: dtypes, -1 / -inf padding, ties ordered by id."""
    from tokensampler.reference import ReferenceRequest, reference_sample, reference_sample_row
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]] * 3)
    requests = [ReferenceRequest(SamplingParams(temperature=0.0, logprobs=n), 0, 0) for n in (None, 2, 4)]
    out = reference_sample(logits, requests)  # the default mode: raw_logprobs
    lp = torch.log_softmax(logits[0], -1)
    assert out.token_ids.tolist() == [1, 1, 1] and out.valid.dtype == torch.bool and out.valid.all()
    assert out.logprobs.token_ranks.dtype == torch.int64 and out.logprobs.token_ranks.tolist() == [0, 3, 3]
    assert out.logprobs.top_token_ids.dtype == torch.int64
    assert out.logprobs.top_token_ids.tolist() == [[-1] * 4, [1, 2, -1, -1], [1, 2, 4, 5]]
    assert out.logprobs.token_logprobs.tolist() == [0.0, float(lp[1]), float(lp[1])]
    assert out.logprobs.top_logprobs[2].tolist() == lp[[1, 2, 4, 5]].tolist()
    assert out.logprobs.top_logprobs[1, 2:].tolist() == [float("-inf")] * 2
    ties = torch.tensor([[float(i % 3) for i in range(64)]])
    full = reference_sample(ties, [ReferenceRequest(SamplingParams(temperature=0.0, logprobs=-1), 0, 0)])
    assert full.logprobs.top_token_ids[0].tolist() == [i for v in (2, 1, 0) for i in range(64) if i % 3 == v]
    token, valid, (scores, values) = reference_sample_row(logits[0], requests[1], 6)  # default: raw_logprobs
    assert (token, valid) == (1, True) and torch.equal(values, lp) and torch.equal(scores, logits[0])
    with pytest.raises(ValueError, match="logprobs_mode"):
        reference_sample(logits, requests, logprobs_mode="logits")
