"""DRY (docs/semantics.md 5.1): the oracle on hand-built histories, its float conventions, the
parameter checks (tests/test_dry_steps.py: the steps against the oracle)."""

from __future__ import annotations

import pytest
import torch

from tokensampler import InvalidSamplingParams, Sampler, SamplingParams
from tokensampler.core.dry import DRY_MAX_HISTORY, dry_max_exponent
from tokensampler.reference import ReferenceRequest, apply_dry, dry_repeat_lengths, reference_sample


def dry(**kw) -> SamplingParams:
    return SamplingParams(dry_multiplier=kw.pop("dry_multiplier", 0.5), **kw)


# ------------------------------------------------------------------ L on hand-built histories
def test_repeat_length_of_the_token_after_an_earlier_occurrence_of_the_suffix():
    # "1 2" occurred before, followed by 3: L(3) = 2
    assert dry_repeat_lengths(dry(), [1, 2, 3, 1, 2]) == {3: 2}
    # the longest match over all earlier occurrences: "1 2 3 1 2" ends 3 before the end
    assert dry_repeat_lengths(dry(), [1, 2, 3, 1, 2, 3, 1, 2]) == {3: 5}
    # two different following tokens, each with its own length
    assert dry_repeat_lengths(dry(), [5, 1, 2, 7, 9, 2, 8, 1, 2]) == {7: 2}
    assert dry_repeat_lengths(dry(dry_allowed_length=1), [5, 1, 2, 7, 9, 2, 8, 1, 2]) == {7: 2, 8: 1}
    assert dry_repeat_lengths(dry(), [1, 2, 3, 4]) == {}


def test_allowed_length_border():
    assert dry_repeat_lengths(dry(dry_allowed_length=2), [1, 2, 3, 1, 2]) == {3: 2}
    assert dry_repeat_lengths(dry(dry_allowed_length=3), [1, 2, 3, 1, 2]) == {}


def test_breakers_cap_the_match_at_the_tokens_after_the_latest_breaker():
    history = [1, 2, 3, 1, 2]
    assert dry_repeat_lengths(dry(dry_sequence_breakers=[(3,)]), history) == {3: 2}  # 2 tokens after the 3
    assert dry_repeat_lengths(dry(dry_sequence_breakers=[(1,)]), history) == {}      # 1 token after the last 1
    assert dry_repeat_lengths(dry(dry_allowed_length=1, dry_sequence_breakers=[(1,)]), history) == {3: 1}
    # a multi-token breaker (head 1, tail 2) ends at the newest token: nothing after it
    assert dry_repeat_lengths(dry(dry_allowed_length=1, dry_sequence_breakers=[(1, 2)]), history) == {}
    # a breaker whose tail does not follow its head does not break
    assert dry_repeat_lengths(dry(dry_sequence_breakers=[(1, 9)]), history) == {3: 2}
    # the head nearest the end wins, even over a breaker that ends later (llama.cpp's scan):
    # (7, 8, 6) ends 2 tokens before the end, but the head 8 of (8,) is nearer the end than the head 7
    spanning = [7, 8, 6, 1, 2, 5, 7, 8, 6, 1, 2]
    assert dry_repeat_lengths(dry(), spanning) == {5: 5}
    assert dry_repeat_lengths(dry(dry_sequence_breakers=[(7, 8, 6)]), spanning) == {5: 2}
    assert dry_repeat_lengths(dry(dry_sequence_breakers=[(7, 8, 6), (8,)]), spanning) == {5: 3}
    assert dry_repeat_lengths(dry(dry_sequence_breakers=[(8, 6), (8,)]), spanning) == {5: 2}  # longest tail


def test_window_is_the_last_n_tokens_of_prompt_and_output():
    history = [1, 2, 3, 1, 2]
    assert dry_repeat_lengths(dry(dry_penalty_last_n=5), history) == {3: 2}
    assert dry_repeat_lengths(dry(dry_penalty_last_n=4), history) == {}  # [2, 3, 1, 2]: "2" only
    assert dry_repeat_lengths(dry(dry_penalty_last_n=4, dry_allowed_length=1), history) == {3: 1}
    assert dry_repeat_lengths(dry(dry_penalty_last_n=-1), [7] * 3 + history) == {3: 2}
    long = [9] * DRY_MAX_HISTORY + [1, 2, 3, 1, 2]
    assert dry_repeat_lengths(dry(), long) == {3: 2}  # -1 reads the last DRY_MAX_HISTORY tokens


# ------------------------------------------------------------------ the penalty
def test_penalty_is_rounded_to_float32_then_subtracted_in_float32_as_llama_cpp_does():
    z = torch.zeros(6)
    out = apply_dry(z, dry(dry_multiplier=0.5, dry_base=2.0), [1, 2, 3, 1, 2, 3, 1, 2])
    assert out.tolist() == [0, 0, 0, -0.5 * 2.0 ** 3, 0, 0]  # L = 5, allowed 2
    z = torch.full((6,), 1.1)
    out = apply_dry(z, dry(dry_multiplier=0.3, dry_base=1.75), [1, 2, 3, 1, 2, 3, 1, 2])
    m, b = float(torch.tensor(0.3)), float(torch.tensor(1.75))
    penalty = torch.tensor(m * b ** 3, dtype=torch.float64).to(torch.float32)  # llama.cpp's `float penalty`
    want = z[3] - penalty  # float32 arithmetic
    once = torch.tensor(float(z[3]) - m * b ** 3, dtype=torch.float64).to(torch.float32)
    assert want != once  # this case tells the two roundings apart
    assert out[3] == want and out.dtype == torch.float32 and bool((out[[0, 1, 2, 4, 5]] == z[0]).all())


def test_a_one_token_breaker_is_never_penalised_a_longer_breakers_head_is():
    history = [1, 2, 3, 1, 2, 3, 1, 2]  # 3 would extend a repeat of length 5
    z = torch.zeros(6)
    assert apply_dry(z, dry(dry_sequence_breakers=[(3,)]), history)[3] == 0  # 3 is a breaker on its own
    assert apply_dry(z, dry(dry_sequence_breakers=[(3, 5)]), history)[3] < 0  # 3 is only a head
    assert apply_dry(z, dry(dry_multiplier=0.0), [1, 2, 3, 1, 2]) is z


def test_exponent_is_capped_as_llama_cpp_does():
    assert dry_max_exponent(1.0) == 0 and dry_max_exponent(1.0000001) == 0
    assert dry_max_exponent(1e30) == 1 and dry_max_exponent(2.0) == 128
    out = apply_dry(torch.zeros(4), dry(dry_multiplier=1.0, dry_base=1e30), [1, 2, 3, 1, 2, 3, 1, 2])
    base = float(torch.tensor(1e30))
    assert out[3] == torch.tensor(-base, dtype=torch.float64).to(torch.float32)  # e = 3 capped to 1


def test_reference_sample_applies_dry_after_the_penalties_on_greedy_rows():
    logits = torch.tensor([[0.0, 0.0, 0.0, 5.0, 4.9]])
    p = SamplingParams(temperature=0.0, dry_multiplier=0.2)
    got = reference_sample(logits, [ReferenceRequest(p, 0, 5, [1, 2, 3], [1, 2])]).token_ids.tolist()
    assert got == [4]  # 3 loses 0.2: 4.8 < 4.9
    q = SamplingParams(temperature=0.0, dry_multiplier=0.2, presence_penalty=0.05)
    got = reference_sample(logits, [ReferenceRequest(q, 0, 5, [1, 2, 3], [1, 2])]).token_ids.tolist()
    assert got == [4]
    off = SamplingParams(temperature=0.0, dry_multiplier=0.2, dry_penalty_last_n=0)
    assert reference_sample(logits, [ReferenceRequest(off, 0, 5, [1, 2, 3], [1, 2])]).token_ids.tolist() == [3]


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("field, value", [
    ("dry_multiplier", -0.1), ("dry_multiplier", float("inf")), ("dry_multiplier", "1"),
    ("dry_base", 0.99), ("dry_base", float("nan")), ("dry_allowed_length", 0), ("dry_allowed_length", 1.5),
    ("dry_penalty_last_n", -2), ("dry_penalty_last_n", DRY_MAX_HISTORY + 1),
    ("dry_sequence_breakers", [[]]), ("dry_sequence_breakers", ["\n"]), ("dry_sequence_breakers", [[1, -1]]),
    ("dry_sequence_breakers", [list(range(22))]), ("dry_sequence_breakers", 3)])
def test_bad_dry_fields_name_the_field(field, value):
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value)


def test_defaults_and_stored_forms():
    p = SamplingParams()
    defaults = (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n, p.dry)
    assert defaults == (0.0, 1.75, 2, -1, False)
    q = SamplingParams(dry_multiplier=1, dry_sequence_breakers=[[1, 2], (3,)])
    assert q.dry and q.dry_sequence_breakers == ((1, 2), (3,)) and isinstance(q.dry_multiplier, float)


def test_sampler_refuses_a_breaker_outside_the_vocabulary_before_any_state_changes():
    sampler = Sampler(10, max_slots=2)
    with pytest.raises(InvalidSamplingParams) as err:
        sampler.add_request(0, SamplingParams(dry_multiplier=0.5, dry_sequence_breakers=[(10,)]), [1])
    assert "dry_sequence_breakers" in str(err.value)
    assert sampler.state.params[0] is None and sampler.state.dry_history is None


# ------------------------------------------------------------------ against llama.cpp's rule
def test_the_oracle_is_llama_cpps_dry_on_random_histories():
    """reference.apply_dry equals `sampler_definitions.dry_penalised`, the transcription of llama.cpp's
    DRY that tests/integrations/test_llama_cpp_samplers.py checks equal to llama.cpp's own sampler
    (one-token breakers), value for value, on random repetitive histories and parameter sets."""
    import random

    import numpy as np

    from tests.support import sampler_definitions as defs

    r = random.Random(5)
    penalised = 0
    for case in range(300):
        vocab = r.choice([8, 20, 64])
        history = [r.randrange(vocab) for _ in range(r.randint(0, 60))]
        if history and r.random() < 0.5:  # a repeated tail: long matches
            history += history[-r.randint(1, len(history)):]
        multiplier, base = r.choice([0.5, 0.8, 2.0]), r.choice([1.0, 1.1, 1.75, 3.0])
        allowed, last_n = r.randint(1, 3), r.choice([1, 5, 16, 1000])
        breakers = r.sample(range(vocab), r.randint(0, 2))
        z = torch.randn(vocab, generator=torch.Generator().manual_seed(case)) * 3
        params = dry(dry_multiplier=multiplier, dry_base=base, dry_allowed_length=allowed,
                     dry_penalty_last_n=last_n, dry_sequence_breakers=[(b,) for b in breakers])
        got = apply_dry(z, params, history).numpy()
        want = defs.dry_penalised(z.numpy(), history, multiplier, base, allowed, last_n, set(breakers))
        np.testing.assert_array_equal(got, want, err_msg=f"case {case}: {params}, history {history}")
        penalised += int((got != z.numpy()).sum())
    assert penalised > 100, penalised


def test_an_id_at_plus_inf_losing_an_infinite_penalty_is_removed_on_every_path():
    """m * b^e overflows float32 (llama.cpp's `float penalty` is +inf): an id at +inf minus +inf is
    NaN, which counts as removed; the Sampler gives the reference's token and validity."""
    history = [1, 2, 3, 1, 2, 3, 1, 2]  # 3 would extend a repeat of length 5
    z = torch.zeros(6)
    z[3] = float("inf")
    params = dry(dry_multiplier=3e38, dry_base=1.75, temperature=0.0)
    out = apply_dry(z, params, history)
    assert out[3] == float("-inf") and bool((out[[0, 1, 2, 4, 5]] == 0).all())
    want = reference_sample(z[None], [ReferenceRequest(params, 0, 0, history)], vocab_size=6)
    for backend in ("torch", "triton"):
        sampler = Sampler(6, max_slots=1, backend=backend)
        sampler.add_request(0, params, prompt_token_ids=history)
        got = sampler.sample(z[None].clone(), [0])
        assert got.token_ids.tolist() == want.token_ids.tolist() == [0] and bool(got.valid[0]) and bool(want.valid[0])
