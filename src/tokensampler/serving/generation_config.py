"""Checkpoint sampling defaults (`generation_config.json`) and OpenAI request resolution.

`load_generation_defaults` reads the sampling keys a checkpoint's authors ship, the way vLLM's
`--generation-config auto|vllm|<dir>` and `--override-generation-config` do, and
`resolve_request` turns an OpenAI completion or chat request body into `SamplingParams` with
vLLM's precedence: a field sent in the request wins, else the checkpoint default, else the neutral
OpenAI default. Temperature 0 is greedy and clears top-k, top-p and min-p. Every error is an
`InvalidSamplingParams` (a `ValueError` with `.field/.value/.allowed`) an HTTP layer maps to 400.
See docs/generation_config.md for the exact rules and where they differ from vLLM.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from ..core.checks import is_int
from ..core.errors import InvalidCheckpoint, InvalidRequest, InvalidSamplingParams
from ..core.params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
MODES = ("auto", "vllm", "none")

# generation_config.json key -> SamplingParams field (max_new_tokens is HF's name for max_tokens)
FILE_SAMPLING_KEYS: dict[str, str] = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "max_new_tokens": "max_tokens",
    "typical_p": "typical_p",  # Hugging Face's names (TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper)
    "epsilon_cutoff": "epsilon_cutoff",
    "eta_cutoff": "eta_cutoff",
}

# The neutral OpenAI defaults a field gets when neither the request nor the checkpoint sets it.
NEUTRAL_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
}
# The full-row samplers a request may set that no checkpoint file carries (llama.cpp's names).
REQUEST_ONLY_FIELDS = ("dynatemp_range", "dynatemp_exponent", "top_n_sigma", "xtc_probability", "xtc_threshold",
                       "mirostat_tau", "mirostat_eta")


# A generation config (file or override) that cannot be used; `.source` names the file.


@dataclass(frozen=True)
class GenerationDefaults:
    """The checkpoint's sampling defaults; None = the checkpoint does not set this key.

    eos_token_ids: from generation_config.json (else config.json), read in every mode.
    source: the file the sampling keys came from ("--override-generation-config" is appended
    when an override was applied), None when no sampling key is set.
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None
    typical_p: float | None = None
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None
    eos_token_ids: tuple[int, ...] = ()
    mode: str = "auto"
    source: str | None = field(default=None, compare=False)

    def sampling(self) -> dict[str, float | int]:
        """The sampling keys this checkpoint sets (SamplingParams names), nothing else."""
        names = FILE_SAMPLING_KEYS.values()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name in names and getattr(self, f.name) is not None}


# ------------------------------------------------------------------------- loading
def _read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidCheckpoint(str(path), "<file>", str(exc), "a readable JSON file") from exc
    except UnicodeDecodeError as exc:
        raise InvalidCheckpoint(str(path), "<file>", f"byte {exc.start}: {exc.reason}",
                                    "a UTF-8 JSON file") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidCheckpoint(str(path), "<json>", f"line {exc.lineno} col {exc.colno}: {exc.msg}",
                                    "a well-formed JSON object") from exc
    if not isinstance(data, dict):
        raise InvalidCheckpoint(str(path), "<json>", type(data).__name__, "a JSON object at the top level")
    return data


def _check_sampling_value(source: str, key: str, value: Any) -> float | int:
    """Validate one file value with the same rules as SamplingParams, naming the file and key."""
    name = FILE_SAMPLING_KEYS[key]
    try:
        params = SamplingParams(**{name: value})
    except InvalidSamplingParams as exc:
        raise InvalidCheckpoint(source, key, value, exc.allowed) from exc
    return getattr(params, name)


def _sampling_keys(source: str, data: Mapping[str, Any]) -> dict[str, float | int]:
    return {FILE_SAMPLING_KEYS[key]: _check_sampling_value(source, key, data[key])
            for key in FILE_SAMPLING_KEYS if data.get(key) is not None}


def _eos_ids(source: str, data: Mapping[str, Any]) -> tuple[int, ...] | None:
    value = data.get("eos_token_id")
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    for token in ids:
        if not is_int(token) or token < 0:
            raise InvalidCheckpoint(source, "eos_token_id", value, "an int >= 0 or a list of them")
    return tuple(dict.fromkeys(ids))


def _check_override(override: Mapping[str, Any] | str | None) -> dict[str, Any]:
    source = "--override-generation-config"
    if override is None:
        return {}
    if isinstance(override, str):
        try:
            override = json.loads(override)
        except json.JSONDecodeError as exc:
            raise InvalidCheckpoint(source, "<json>", override, "a JSON object") from exc
    if not isinstance(override, Mapping):
        raise InvalidCheckpoint(source, "<json>", override, "a JSON object")
    for key in override:
        if key not in FILE_SAMPLING_KEYS:  # a JSON object's keys are strings; a mapping's may not be
            raise InvalidCheckpoint(source, str(key), override[key], f"one of {sorted(FILE_SAMPLING_KEYS)}")
    return dict(override)


def load_generation_defaults(model_dir: str | Path, mode: str = "auto",
                             override: Mapping[str, Any] | str | None = None) -> GenerationDefaults:
    """The sampling defaults of the checkpoint in `model_dir`.

    mode: "auto" reads model_dir/generation_config.json (or, when that file is absent, the same
    keys in model_dir/config.json); "vllm" (alias "none") ignores the sampling keys and keeps the
    neutral defaults; any other value is a directory whose generation_config.json (or config.json)
    supplies the sampling keys instead. EOS ids are read in every mode.
    override: a dict (or its JSON text) of generation-config keys applied last.
    """
    if not isinstance(model_dir, (str, os.PathLike)) or isinstance(model_dir, bytes) or str(model_dir) == "":
        raise InvalidSamplingParams("model", model_dir, "a checkpoint directory (a str or os.PathLike path)")
    root = Path(model_dir)
    if not isinstance(mode, (str, os.PathLike)) or isinstance(mode, bytes) or str(mode) == "":
        raise InvalidSamplingParams("generation_config", mode, "'auto', 'vllm', 'none' or a directory")
    if not root.is_dir():
        raise InvalidSamplingParams("model", str(model_dir), "an existing checkpoint directory")
    checked_override = _check_override(override)

    def files_in(directory: Path) -> list[Path]:
        return [p for p in (directory / GENERATION_CONFIG_FILE, directory / MODEL_CONFIG_FILE) if p.is_file()]

    model_files = files_in(root)
    sampling: dict[str, float | int] = {}
    source: str | None = None
    eos: tuple[int, ...] | None = None
    mode_name = str(mode)
    if mode_name in ("vllm", "none"):
        mode_name = "vllm"
    else:
        directory = root if mode_name == "auto" else Path(mode_name)
        if mode_name != "auto":
            if not directory.is_dir():
                raise InvalidSamplingParams("generation_config", mode_name,
                                            "'auto', 'vllm', 'none' or an existing directory")
            if not files_in(directory):
                raise InvalidSamplingParams("generation_config", mode_name,
                                            f"a directory holding {GENERATION_CONFIG_FILE} or {MODEL_CONFIG_FILE}")
        chosen = files_in(directory)
        if chosen:
            data = _read_json(chosen[0])
            sampling = _sampling_keys(str(chosen[0]), data)
            source = str(chosen[0]) if sampling else None
            eos = _eos_ids(str(chosen[0]), data)
    for path in model_files:  # EOS ids: first file that has them (generation_config.json first)
        if eos is not None:
            break
        eos = _eos_ids(str(path), _read_json(path))
    if checked_override:
        label = "--override-generation-config"
        sampling.update(_sampling_keys(label, checked_override))
        source = label if source is None else f"{source} + {label}"
    return GenerationDefaults(**sampling, eos_token_ids=eos or (), mode=mode_name, source=source)


# ------------------------------------------------------------------------- requests
SAMPLING_FIELDS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "seed", "n", "max_tokens", "max_completion_tokens", "min_tokens", "logprobs", "top_logprobs",
    "logit_bias", "stop_token_ids", "allowed_token_ids", "stop", "ignore_eos",
    "typical_p", "epsilon_cutoff", "eta_cutoff", *REQUEST_ONLY_FIELDS,
})

# Standard OpenAI (and common vLLM) body fields that do not change which token is sampled; they are
# accepted and left to the layers that own them (prompt rendering, streaming, detokenizing).
PASS_THROUGH_FIELDS = frozenset({
    "model", "prompt", "messages", "stream", "stream_options", "user", "echo", "suffix",
    "metadata", "store", "service_tier", "modalities", "audio", "prediction", "reasoning_effort",
    "tools", "parallel_tool_calls", "functions", "function_call", "web_search_options", "verbosity",
    "prompt_cache_key", "safety_identifier", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens",
    "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
    "chat_template_kwargs", "documents", "request_id", "priority", "truncate_prompt_tokens",
    "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "include_reasoning",
})

# Fields that would change the output in a way tokensampler does not implement: accepted only at
# their neutral value, rejected otherwise (rather than silently ignored).
NEUTRAL_ONLY_FIELDS: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False, None),
    "prompt_logprobs": (None,),
    "logprob_token_ids": (None,),
    "bad_words": (None, []),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "length_penalty": (1, 1.0, None),
    "response_format": (None, {"type": "text"}),  # json_object / json_schema need structured outputs
    "tool_choice": (None, "none", "auto"),  # "required" or a named tool constrain the output
}

ACCEPTED_FIELDS = SAMPLING_FIELDS | PASS_THROUGH_FIELDS | frozenset(NEUTRAL_ONLY_FIELDS) | {"best_of"}


def _request_int(request: Mapping[str, Any], name: str, default: Any, low: int, allowed: str) -> Any:
    value = request.get(name)
    if value is None:
        return default
    if not is_int(value) or value < low:
        raise InvalidRequest(name, value, allowed)
    return value


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """`value` is one of `neutral` (compared only with values of its own type: no tensor or array
    comparison, no True == 1)."""
    return any(type(value) is type(v) and value == v for v in neutral)


def _check_fields(request: Mapping[str, Any]) -> None:
    for name, value in request.items():
        if not isinstance(name, str) or name not in ACCEPTED_FIELDS:
            label = name if isinstance(name, str) and name.strip() else repr(name)  # never an empty field name
            raise InvalidRequest(label, value, "a documented OpenAI/vLLM request field "
                                 "(see tokensampler.serving.generation_config.ACCEPTED_FIELDS)")
        if name in NEUTRAL_ONLY_FIELDS and not _is_neutral(value, NEUTRAL_ONLY_FIELDS[name]):
            raise InvalidRequest(name, value, f"{NEUTRAL_ONLY_FIELDS[name][0]!r}: not supported by tokensampler")


def _logprobs(request: Mapping[str, Any], chat: bool) -> int | None:
    if not chat:
        if request.get("top_logprobs") is not None:
            raise InvalidRequest("top_logprobs", request["top_logprobs"],
                                 "only in chat requests (completions use an int `logprobs`)")
        return _request_int(request, "logprobs", None, -1, "None, -1 (whole vocabulary) or an int >= 0")
    wanted = request.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidRequest("logprobs", wanted, "true or false in a chat request (the count is `top_logprobs`)")
    top = _request_int(request, "top_logprobs", 0, -1, "None, -1 (whole vocabulary) or an int >= 0")
    if not wanted:
        if top != 0:
            raise InvalidRequest("top_logprobs", top, "only with `logprobs: true`")
        return None
    return top


def _logit_bias(request: Mapping[str, Any]) -> dict[int, float] | None:
    bias = request.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise InvalidRequest("logit_bias", bias, "an object mapping token ids (strings) to numbers")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key, 10) if isinstance(key, str) else key
        except ValueError:
            raise InvalidRequest("logit_bias", key, "keys are token ids written as decimal strings") from None
        if not is_int(token) or token < 0:
            raise InvalidRequest("logit_bias", key, "keys are token ids >= 0 written as decimal strings")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidRequest(f"logit_bias[{key}]", value, "a finite number (clamped to [-100, 100])")
        out[token] = value
    return out


def _max_tokens(request: Mapping[str, Any], defaults: GenerationDefaults, chat: bool,
                max_model_len: int | None, prompt_len: int | None) -> int | None:
    asked = None
    for name in (("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)):
        asked = _request_int(request, name, None, 1, "None or an int >= 1")
        if asked is not None:
            break
    if not chat and request.get("max_completion_tokens") is not None:
        raise InvalidRequest("max_completion_tokens", request["max_completion_tokens"],
                             "only in chat requests (completions use `max_tokens`)")
    value = asked if asked is not None else defaults.max_tokens
    if (max_model_len is None) != (prompt_len is None):
        raise InvalidSamplingParams("max_model_len", max_model_len, "given together with prompt_len, or neither")
    if max_model_len is None:
        return value
    if not is_int(max_model_len) or max_model_len < 1:
        raise InvalidSamplingParams("max_model_len", max_model_len, "an int >= 1")
    if not is_int(prompt_len) or prompt_len < 0:
        raise InvalidSamplingParams("prompt_len", prompt_len, "an int >= 0")
    room = max_model_len - prompt_len
    if room < 1:
        raise InvalidRequest("prompt", f"{prompt_len} tokens",
                             f"at most {max_model_len - 1} tokens (max_model_len {max_model_len})")
    return room if value is None else min(value, room)


def resolve_request(request: Mapping[str, Any], defaults: GenerationDefaults | None = None, *,
                    max_model_len: int | None = None, prompt_len: int | None = None) -> SamplingParams:
    """The `SamplingParams` of one OpenAI completion or chat request body (a chat body has `messages`).

    Each sampling field: the request's value if sent and not null, else the checkpoint default
    (`defaults`), else the neutral OpenAI default. Temperature 0 is greedy: top-k, top-p and min-p
    are cleared whatever the checkpoint says. `stop` (a string or a list of strings) and
    `ignore_eos` are returned on the params for the decode loop: stop strings end a completion and
    are not part of its text; ignore_eos = EOS is not a stop condition (the sampler does not ban
    it). max_tokens = min(request or checkpoint default,
    max_model_len - prompt_len) when both lengths are given. Raises `InvalidRequest` /
    `InvalidSamplingParams` (HTTP 400) on an unknown field or an invalid value.
    """
    if not isinstance(request, Mapping):
        raise InvalidRequest("request", type(request).__name__, "a JSON object")
    if defaults is not None and not isinstance(defaults, GenerationDefaults):
        raise InvalidSamplingParams("defaults", defaults, "None or a GenerationDefaults (load_generation_defaults)")
    defaults = defaults if defaults is not None else GenerationDefaults(mode="vllm")
    _check_fields(request)
    chat = "messages" in request
    checkpoint = defaults.sampling()
    knobs: dict[str, Any] = {}
    for name, neutral in NEUTRAL_DEFAULTS.items():
        sent = request.get(name)
        knobs[name] = sent if sent is not None else checkpoint.get(name, neutral)
    n = _request_int(request, "n", 1, 1, "an int >= 1")
    best_of = request.get("best_of")
    if best_of is not None and best_of != n:
        raise InvalidRequest("best_of", best_of, f"None or equal to n ({n}): not supported by tokensampler")
    params = dict(
        knobs,
        seed=request.get("seed"),
        n=n,
        logprobs=_logprobs(request, chat),
        logit_bias=_logit_bias(request),
        stop_token_ids=() if request.get("stop_token_ids") is None else request["stop_token_ids"],
        allowed_token_ids=request.get("allowed_token_ids"),
        stop=request.get("stop"),
        ignore_eos=False if request.get("ignore_eos") is None else request.get("ignore_eos"),
        min_tokens=_request_int(request, "min_tokens", 0, 0, "an int >= 0"),
        max_tokens=_max_tokens(request, defaults, chat, max_model_len, prompt_len),
        **{name: request[name] for name in REQUEST_ONLY_FIELDS if request.get(name) is not None},
    )
    try:
        resolved = SamplingParams(**params)
    except InvalidSamplingParams as exc:
        raise InvalidRequest(exc.field, exc.value, exc.allowed) from exc
    if resolved.greedy:  # temperature 0: vLLM's SamplingParams.__post_init__ clears the filters
        params.update(top_k=0, top_p=1.0, min_p=0.0)
        resolved = SamplingParams(**params)
    return resolved
