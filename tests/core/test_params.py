"""SamplingParams: defaults, normalisation, and a clear error for every invalid value."""

import math

import pytest

from tokensampler import InvalidSamplingParams, SamplingParams


def test_defaults_are_neutral():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (1.0, 0, 1.0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.seed is None and p.logprobs is None and p.logit_bias is None
    assert p.allowed_token_ids is None and p.min_tokens == 0 and p.stop_token_ids == ()
    assert p.max_tokens is None and p.n == 1 and not p.greedy


def test_normalisations():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert dict(SamplingParams(logit_bias={3: 250.0, 4: -1e9, 5: 1.5}).logit_bias) == {3: 100.0, 4: -100.0, 5: 1.5}
    assert SamplingParams(allowed_token_ids=[4, 2]).allowed_token_ids == (4, 2)
    assert SamplingParams(temperature=0).greedy
    one = SamplingParams(temperature=1).temperature
    assert one == 1.0 and isinstance(one, float)


def test_frozen_and_hashable():
    p = SamplingParams(logit_bias={1: 2.0}, allowed_token_ids=(1, 2))
    with pytest.raises(Exception):
        p.temperature = 2.0  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(logit_bias={1: 2.0}, allowed_token_ids=(1, 2)))


@pytest.mark.parametrize("field,value,allowed_fragment", [
    ("temperature", -0.1, ">= 0"), ("temperature", math.nan, ">= 0"), ("temperature", math.inf, ">= 0"),
    ("temperature", "1", ">= 0"), ("temperature", True, ">= 0"),
    ("top_k", -2, ">= 1"), ("top_k", 1.5, ">= 1"), ("top_k", True, ">= 1"),
    ("top_p", 0.0, "(0, 1]"), ("top_p", 1.01, "(0, 1]"), ("top_p", math.nan, "(0, 1]"),
    ("min_p", -0.01, "[0, 1]"), ("min_p", 1.5, "[0, 1]"),
    ("presence_penalty", 2.5, "[-2, 2]"), ("frequency_penalty", -2.01, "[-2, 2]"),
    ("presence_penalty", math.inf, "[-2, 2]"),
    ("repetition_penalty", 0.0, "> 0"), ("repetition_penalty", -1.0, "> 0"), ("repetition_penalty", math.inf, "> 0"),
    ("seed", 2**64, "int in"), ("seed", -(2**63) - 1, "int in"), ("seed", 1.0, "int in"),
    ("logprobs", -2, ">= 0"), ("logprobs", 1.0, ">= 0"),
    ("logit_bias", [1, 2], "mapping"), ("logit_bias", {-1: 1.0}, ">= 0"), ("logit_bias", {"a": 1.0}, ">= 0"),
    ("logit_bias", {1: math.nan}, "clamped"),
    ("allowed_token_ids", [], "non-empty"), ("allowed_token_ids", [1, -3], ">= 0"),
    ("allowed_token_ids", "abc", "sequence"),
    ("min_tokens", -1, ">= 0"), ("stop_token_ids", [1.5], ">= 0"),
    ("max_tokens", 0, ">= 1"), ("n", 0, ">= 1"),
])
def test_invalid_values_name_field_value_and_range(field, value, allowed_fragment):
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**{field: value})
    err = info.value
    assert isinstance(err, ValueError)
    assert err.field.startswith(field)
    assert field in str(err) and allowed_fragment in str(err)
    assert repr(err.value) in str(err)


def test_boundary_values_are_accepted():
    SamplingParams(temperature=0.0, top_k=1, top_p=1.0, min_p=1.0, presence_penalty=-2.0,
                   frequency_penalty=2.0, repetition_penalty=1e-6, seed=0, logprobs=-1,
                   min_tokens=0, max_tokens=1, n=3)
    SamplingParams(top_p=1e-9, min_p=0.0, logprobs=0)
