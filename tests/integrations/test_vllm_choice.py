"""The vLLM plugin's sampler resolves the backend and compile choice once, when it is made, and makes
every batch's sampler with it (`integrations/vllm/sampler.py`, `batch.py`); no engine needed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tokensampler import InvalidEnvironment, InvalidSamplingParams  # noqa: E402
from tokensampler.backends.choice import BACKEND_ENV, COMPILE_ENV, BackendChoice  # noqa: E402
from tokensampler.integrations.vllm.batch import BatchState  # noqa: E402
from tokensampler.integrations.vllm.sampler import TokenSamplerSampler  # noqa: E402


def test_the_plugin_reads_the_environment_once_and_an_argument_wins(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "torch")
    monkeypatch.setenv(COMPILE_ENV, "off")
    sampler = TokenSamplerSampler()
    monkeypatch.setenv(BACKEND_ENV, "triton")  # too late: the plugin has its choice
    monkeypatch.setenv(COMPILE_ENV, "on")
    assert (sampler.backend, sampler.compile) == ("torch", False)
    explicit = TokenSamplerSampler(backend="auto", compile=True)
    assert (explicit.backend, explicit.compile) == ("auto", True)


def test_a_bad_choice_is_refused_when_the_plugin_sampler_is_made(monkeypatch):
    with pytest.raises(InvalidSamplingParams) as error:
        TokenSamplerSampler(backend="gpu")
    assert error.value.field == "backend"
    monkeypatch.setenv(COMPILE_ENV, "maybe")
    with pytest.raises(InvalidEnvironment) as error:
        TokenSamplerSampler()
    assert error.value.field == COMPILE_ENV and error.value.value == "maybe"


def test_a_batch_state_makes_its_sampler_with_the_plugins_choice():
    state = BatchState(2, 50, "cpu", logprobs_mode="raw_logprobs", max_logprobs=5, backend="torch", compile=False)
    assert state.generator.sampler.backends.choice == BackendChoice("torch", False, False)
