"""Checkpoint defaults (load_generation_defaults) and request resolution (resolve_request), as vLLM does."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokensampler import InvalidSamplingParams, SamplingParams
from tokensampler.serving.generation_config import (
    ACCEPTED_FIELDS,
    NEUTRAL_DEFAULTS,
    GenerationDefaults,
    InvalidCheckpoint,
    InvalidRequest,
    load_generation_defaults,
    resolve_request,
)

NEUTRAL = SamplingParams()


def write(directory, name, data):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.fixture
def checkpoint(tmp_path):
    """A checkpoint dir with config.json and a generation_config.json holding every sampling key."""
    write(tmp_path, "config.json", {"model_type": "llama", "eos_token_id": 2, "top_k": 7, "temperature": 0.3})
    write(tmp_path, "generation_config.json", {
        "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05,
        "repetition_penalty": 1.05, "presence_penalty": 0.5, "frequency_penalty": -0.25, "max_new_tokens": 40,
        "eos_token_id": [2, 9], "bos_token_id": 1, "transformers_version": "5.24.0"})
    return tmp_path


# ---------------------------------------------------------------- acceptance (issue #7)
DEFAULTS_T05 = GenerationDefaults(temperature=0.5, repetition_penalty=1.05)


def test_request_without_temperature_gets_checkpoint_temperature():
    params = resolve_request({"prompt": "hi"}, DEFAULTS_T05)
    assert params.temperature == 0.5
    assert params.repetition_penalty == 1.05


def test_request_temperature_wins_over_checkpoint():
    params = resolve_request({"prompt": "hi", "temperature": 0.1}, DEFAULTS_T05)
    assert params.temperature == 0.1
    assert params.repetition_penalty == 1.05


def test_request_temperature_zero_is_greedy_and_keeps_repetition():
    params = resolve_request({"prompt": "hi", "temperature": 0}, DEFAULTS_T05)
    assert params.greedy and params.temperature == 0.0
    assert params.repetition_penalty == 1.05


@pytest.mark.parametrize("asked, expected", [(None, 93), (100, 93), (5, 5), (93, 93), (92, 92)])
def test_max_tokens_capped_by_context(asked, expected):
    request = {"prompt": "seven tokens"} | ({} if asked is None else {"max_tokens": asked})
    params = resolve_request(request, DEFAULTS_T05, max_model_len=100, prompt_len=7)
    assert params.max_tokens == expected


def test_generation_config_vllm_restores_neutral_defaults_exactly(checkpoint):
    defaults = load_generation_defaults(checkpoint, "vllm")
    assert defaults.sampling() == {}
    assert resolve_request({"prompt": "x"}, defaults) == NEUTRAL
    assert resolve_request({"prompt": "x"}, defaults) == resolve_request({"prompt": "x"}, None)
    # ... while auto on the same checkpoint does not
    assert resolve_request({"prompt": "x"}, load_generation_defaults(checkpoint)) != NEUTRAL


def test_checkpoint_top_k_does_not_survive_temperature_zero(checkpoint):
    defaults = load_generation_defaults(checkpoint)
    assert resolve_request({"prompt": "x"}, defaults).top_k == 20
    greedy = resolve_request({"prompt": "x", "temperature": 0.0}, defaults)
    assert (greedy.temperature, greedy.top_k, greedy.top_p, greedy.min_p) == (0.0, 0, 1.0, 0.0)
    # penalties are not filters: they stay
    assert (greedy.repetition_penalty, greedy.presence_penalty, greedy.frequency_penalty) == (1.05, 0.5, -0.25)


def test_request_filters_are_cleared_too_when_greedy():
    params = resolve_request({"prompt": "x", "temperature": 0, "top_k": 5, "top_p": 0.5, "min_p": 0.2})
    assert (params.top_k, params.top_p, params.min_p) == (0, 1.0, 0.0)


def test_checkpoint_temperature_zero_is_greedy_and_clears_its_filters():
    defaults = GenerationDefaults(temperature=0.0, top_k=20, top_p=0.9)
    params = resolve_request({"prompt": "x"}, defaults)
    assert params.greedy and (params.top_k, params.top_p) == (0, 1.0)
    sampled = resolve_request({"prompt": "x", "temperature": 0.7}, defaults)
    assert (sampled.temperature, sampled.top_k, sampled.top_p) == (0.7, 20, 0.9)


# ---------------------------------------------------------------- loading
def test_auto_reads_every_sampling_key_of_generation_config(checkpoint):
    defaults = load_generation_defaults(checkpoint)
    assert defaults.sampling() == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05,
                                   "repetition_penalty": 1.05, "presence_penalty": 0.5,
                                   "frequency_penalty": -0.25, "max_tokens": 40}
    assert defaults.eos_token_ids == (2, 9)
    assert defaults.mode == "auto"
    assert defaults.source == str(checkpoint / "generation_config.json")


def test_auto_ignores_null_and_unrelated_keys(tmp_path):
    write(tmp_path, "generation_config.json", {"temperature": None, "top_k": 20, "do_sample": False,
                                               "max_length": 77, "num_beams": 4})
    defaults = load_generation_defaults(tmp_path)
    assert defaults.sampling() == {"top_k": 20}
    assert defaults.temperature is None


def test_auto_falls_back_to_config_json_only_without_generation_config(tmp_path):
    write(tmp_path, "config.json", {"temperature": 0.3, "top_k": 7, "eos_token_id": 5, "hidden_size": 8})
    defaults = load_generation_defaults(tmp_path)
    assert defaults.sampling() == {"temperature": 0.3, "top_k": 7}
    assert defaults.eos_token_ids == (5,)
    assert defaults.source == str(tmp_path / "config.json")
    # a generation_config.json without sampling keys still wins over config.json's keys
    write(tmp_path, "generation_config.json", {"bos_token_id": 1})
    defaults = load_generation_defaults(tmp_path)
    assert defaults.sampling() == {} and defaults.source is None
    assert defaults.eos_token_ids == (5,)  # EOS falls back to config.json


def test_auto_without_any_file_gives_nothing(tmp_path):
    defaults = load_generation_defaults(tmp_path)
    assert defaults == GenerationDefaults()
    assert resolve_request({"prompt": "x"}, defaults) == NEUTRAL


@pytest.mark.parametrize("mode", ["vllm", "none"])
def test_vllm_mode_still_reads_eos(checkpoint, mode):
    defaults = load_generation_defaults(checkpoint, mode)
    assert defaults.eos_token_ids == (2, 9) and defaults.mode == "vllm"


def test_directory_mode_reads_that_directory(checkpoint, tmp_path):
    other = tmp_path / "other"
    write(other, "generation_config.json", {"temperature": 0.9, "top_p": 0.5})
    defaults = load_generation_defaults(checkpoint, str(other))
    assert defaults.sampling() == {"temperature": 0.9, "top_p": 0.5}
    assert defaults.eos_token_ids == (2, 9)  # the other dir has none: the checkpoint's
    assert defaults.source == str(other / "generation_config.json")


@pytest.mark.parametrize("missing", ["nope", "empty"])
def test_directory_mode_errors_on_a_directory_without_config(checkpoint, tmp_path, missing):
    target = tmp_path / missing
    if missing == "empty":
        target.mkdir()
    with pytest.raises(InvalidSamplingParams) as err:
        load_generation_defaults(checkpoint, str(target))
    assert err.value.field == "generation_config"


def test_missing_model_dir_is_an_error(tmp_path):
    with pytest.raises(InvalidSamplingParams) as err:
        load_generation_defaults(tmp_path / "absent")
    assert err.value.field == "model"


def test_override_is_applied_last(checkpoint):
    defaults = load_generation_defaults(checkpoint, override={"temperature": 0.5, "max_new_tokens": 8})
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.5, 20, 8)
    assert defaults.source.endswith("+ --override-generation-config")
    vllm = load_generation_defaults(checkpoint, "vllm", override='{"top_k": 3}')
    assert vllm.sampling() == {"top_k": 3}
    assert vllm.source == "--override-generation-config"


@pytest.mark.parametrize("override, key", [({"temprature": 0.5}, "temprature"), ({"top_p": 2.0}, "top_p"),
                                           ('{"top_k": ', "<json>"), ("[1, 2]", "<json>"),
                                           ({"eos_token_id": 3}, "eos_token_id")])
def test_bad_override_names_the_key(checkpoint, override, key):
    with pytest.raises(InvalidCheckpoint) as err:
        load_generation_defaults(checkpoint, override=override)
    assert err.value.field == key
    assert "--override-generation-config" in str(err.value)


@pytest.mark.parametrize("key, value", [("top_k", "20"), ("top_k", 20.5), ("top_k", True), ("temperature", "hot"),
                                        ("temperature", -0.1), ("top_p", 1.5), ("top_p", 0), ("min_p", 2),
                                        ("repetition_penalty", 0), ("presence_penalty", 3),
                                        ("max_new_tokens", 0), ("eos_token_id", "2"), ("eos_token_id", [2, -1])])
def test_bad_value_names_file_and_key(tmp_path, key, value):
    path = write(tmp_path, "generation_config.json", {key: value})
    with pytest.raises(InvalidCheckpoint) as err:
        load_generation_defaults(tmp_path)
    assert isinstance(err.value, ValueError)
    assert err.value.field == key and err.value.value == value and err.value.allowed
    assert str(path) in str(err.value) and key in str(err.value)


@pytest.mark.parametrize("text", ['{"temperature": 0.6,', "[]", "not json"])
def test_malformed_json_names_the_file(tmp_path, text):
    path = write(tmp_path, "generation_config.json", text)
    with pytest.raises(InvalidCheckpoint) as err:
        load_generation_defaults(tmp_path)
    assert str(path) in str(err.value)


def test_malformed_config_json_fallback_names_it(tmp_path):
    path = write(tmp_path, "config.json", '{"top_k": 20')
    with pytest.raises(InvalidCheckpoint, match="config.json"):
        load_generation_defaults(tmp_path)
    assert path.exists()


# ---------------------------------------------------------------- requests: precedence
@pytest.mark.parametrize("name, sent, checkpoint_value", [
    ("temperature", 0.8, 0.6), ("top_p", 0.7, 0.95), ("top_k", 5, 20), ("min_p", 0.1, 0.05),
    ("repetition_penalty", 1.2, 1.05), ("presence_penalty", 1.0, 0.5), ("frequency_penalty", 0.3, -0.25)])
def test_each_knob_request_then_checkpoint_then_neutral(name, sent, checkpoint_value):
    defaults = GenerationDefaults(**{name: checkpoint_value})
    assert getattr(resolve_request({name: sent}, defaults), name) == sent
    assert getattr(resolve_request({}, defaults), name) == checkpoint_value
    assert getattr(resolve_request({name: None}, defaults), name) == checkpoint_value  # null = not sent
    assert getattr(resolve_request({}, GenerationDefaults()), name) == NEUTRAL_DEFAULTS[name]


KNOB_VALUES = {"temperature": st.sampled_from([0.0, 0.3, 1.0, 1.7]), "top_p": st.sampled_from([0.2, 0.9, 1.0]),
               "top_k": st.sampled_from([0, 1, 20]), "min_p": st.sampled_from([0.0, 0.1]),
               "repetition_penalty": st.sampled_from([1.0, 1.3]), "presence_penalty": st.sampled_from([-1.0, 0.0, 2.0]),
               "frequency_penalty": st.sampled_from([0.0, 0.5])}


@settings(max_examples=150, deadline=None)
@given(request=st.fixed_dictionaries({}, optional=KNOB_VALUES), file=st.fixed_dictionaries({}, optional=KNOB_VALUES))
def test_resolution_rule_on_random_requests_and_checkpoints(request, file):
    params = resolve_request(request, GenerationDefaults(**file))
    merged = {name: request.get(name, file.get(name, neutral)) for name, neutral in NEUTRAL_DEFAULTS.items()}
    if merged["temperature"] == 0.0:
        merged.update(top_k=0, top_p=1.0, min_p=0.0)
    assert {name: getattr(params, name) for name in NEUTRAL_DEFAULTS} == merged


def test_max_tokens_default_from_checkpoint_and_request_wins():
    defaults = GenerationDefaults(max_tokens=40)
    assert resolve_request({}, defaults).max_tokens == 40
    assert resolve_request({"max_tokens": 60}, defaults).max_tokens == 60
    assert resolve_request({}, defaults, max_model_len=30, prompt_len=7).max_tokens == 23
    assert resolve_request({}, GenerationDefaults()).max_tokens is None


def test_chat_max_completion_tokens_preferred_over_max_tokens():
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "max_completion_tokens": 9}
    assert resolve_request(chat).max_tokens == 9
    assert resolve_request({"messages": [], "max_tokens": 50}).max_tokens == 50
    with pytest.raises(InvalidRequest) as err:
        resolve_request({"prompt": "x", "max_completion_tokens": 9})
    assert err.value.field == "max_completion_tokens"


def test_prompt_longer_than_context_is_rejected():
    with pytest.raises(InvalidRequest) as err:
        resolve_request({"prompt": "x"}, max_model_len=100, prompt_len=100)
    assert err.value.field == "prompt"
    assert resolve_request({}, max_model_len=100, prompt_len=99).max_tokens == 1


def test_max_model_len_needs_prompt_len():
    with pytest.raises(InvalidSamplingParams):
        resolve_request({}, max_model_len=100)
    with pytest.raises(InvalidSamplingParams):
        resolve_request({}, prompt_len=3)


# ---------------------------------------------------------------- requests: the other fields
def test_completion_logprobs_is_an_int():
    assert resolve_request({"prompt": "x", "logprobs": 3}).logprobs == 3
    assert resolve_request({"prompt": "x", "logprobs": 0}).logprobs == 0
    assert resolve_request({"prompt": "x"}).logprobs is None
    with pytest.raises(InvalidRequest) as err:
        resolve_request({"prompt": "x", "top_logprobs": 2})
    assert err.value.field == "top_logprobs"
    with pytest.raises(InvalidRequest):
        resolve_request({"prompt": "x", "logprobs": True})


def test_chat_logprobs_needs_true_and_top_logprobs():
    msgs = [{"role": "user", "content": "hi"}]
    assert resolve_request({"messages": msgs, "logprobs": True, "top_logprobs": 4}).logprobs == 4
    assert resolve_request({"messages": msgs, "logprobs": True}).logprobs == 0
    assert resolve_request({"messages": msgs, "logprobs": False}).logprobs is None
    assert resolve_request({"messages": msgs}).logprobs is None
    for bad in ({"top_logprobs": 3}, {"logprobs": False, "top_logprobs": 3}, {"logprobs": 3}):
        with pytest.raises(InvalidRequest) as err:
            resolve_request({"messages": msgs, **bad})
        assert err.value.field in ("logprobs", "top_logprobs")


def test_logit_bias_string_keys():
    params = resolve_request({"logit_bias": {"5": 2.5, "17": -150}})
    assert dict(params.logit_bias) == {5: 2.5, 17: -100.0}
    for bad, field_name in (({"abc": 1}, "logit_bias"), ({"-3": 1}, "logit_bias"), ({"3": "x"}, "logit_bias[3]"),
                            ({"3": math.nan}, "logit_bias[3]"), ([1, 2], "logit_bias")):
        with pytest.raises(InvalidRequest) as err:
            resolve_request({"logit_bias": bad})
        assert err.value.field == field_name


def test_seed_stop_ids_min_tokens_n_allowed_ids():
    params = resolve_request({"seed": 42, "stop_token_ids": [3, 4], "min_tokens": 2, "n": 3,
                              "allowed_token_ids": [1, 3, 4]})
    assert (params.seed, params.stop_token_ids, params.min_tokens, params.n, params.allowed_token_ids) == \
        (42, (3, 4), 2, 3, (1, 3, 4))
    defaults = resolve_request({"seed": None, "stop_token_ids": None, "n": None})
    assert (defaults.seed, defaults.stop_token_ids, defaults.n, defaults.min_tokens) == (None, (), 1, 0)


def test_unknown_field_is_a_400_error_naming_it():
    with pytest.raises(InvalidRequest) as err:
        resolve_request({"prompt": "x", "temprature": 0.5})
    assert isinstance(err.value, ValueError) and isinstance(err.value, InvalidSamplingParams)
    assert err.value.field == "temprature" and err.value.value == 0.5 and "ACCEPTED_FIELDS" in err.value.allowed


def test_standard_openai_fields_are_accepted():
    body = {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True},
            "stop": ["\n"], "user": "u", "echo": False, "suffix": None, "metadata": {}, "best_of": 1,
            "use_beam_search": False, "ignore_eos": False}
    assert resolve_request(body) == dataclasses.replace(NEUTRAL, stop=("\n",))  # stop strings: for the loop
    chat = {"model": "m", "messages": [], "max_completion_tokens": 5, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "parallel_tool_calls": True, "store": False}
    assert resolve_request(chat).max_tokens == 5
    assert {"model", "prompt", "messages", "stream", "stop", "max_completion_tokens", "user"} <= ACCEPTED_FIELDS


@pytest.mark.parametrize("field_name, value", [("use_beam_search", True), ("best_of", 3),
                                               ("prompt_logprobs", 1), ("bad_words", ["x"]),
                                               ("response_format", {"type": "json_object"}),
                                               ("tool_choice", "required")])
def test_output_changing_fields_we_do_not_implement_are_rejected(field_name, value):
    with pytest.raises(InvalidRequest) as err:
        resolve_request({"prompt": "x", field_name: value})
    assert err.value.field == field_name


@pytest.mark.parametrize("field_name, value", [("temperature", -1), ("temperature", "0.5"), ("top_p", 0),
                                               ("top_k", -2), ("min_p", 1.5), ("n", 0), ("seed", "7"),
                                               ("min_tokens", -1), ("max_tokens", 0), ("presence_penalty", 2.5),
                                               ("stop_token_ids", "3"), ("repetition_penalty", 0)])
def test_invalid_values_are_400_errors_naming_the_field(field_name, value):
    with pytest.raises(InvalidRequest) as err:
        resolve_request({"prompt": "x", field_name: value})
    assert err.value.field == field_name


def test_request_must_be_a_mapping():
    with pytest.raises(InvalidRequest):
        resolve_request([("temperature", 1.0)])


# ---------------------------------------------------------------- stop strings and ignore_eos
@pytest.mark.parametrize("stop, want", [(None, ()), ("###", ("###",)), (["a", "\n\n"], ("a", "\n\n")), ([], ())])
def test_stop_strings_are_returned_on_the_params(stop, want):
    resolved = resolve_request({"prompt": "x", "stop": stop})
    assert resolved.stop == want and resolved.ignore_eos is False
    chat = resolve_request({"messages": [], "stop": stop, "ignore_eos": True})
    assert chat.stop == want and chat.ignore_eos is True


@pytest.mark.parametrize("field_name, value", [("stop", ""), ("stop", ["a", ""]), ("stop", 3), ("stop", [1]),
                                               ("ignore_eos", 1), ("ignore_eos", "yes")])
def test_bad_stop_and_ignore_eos_are_400_errors(field_name, value):
    with pytest.raises(InvalidRequest) as err:
        resolve_request({"prompt": "x", field_name: value})
    assert err.value.field == field_name and err.value.value == value
