"""vLLM's `SamplingParams` as tokensampler's: every field vLLM's sampler honours, with vLLM's
conventions mapped onto the definition (docs/semantics.md)."""

from __future__ import annotations

from typing import Any

from ...core.errors import InvalidSamplingParams
from ...core.params import SamplingParams

GREEDY_BELOW = 1e-5  # vLLM samples greedily below this temperature (its _SAMPLING_EPS)
# vLLM accepts any finite repetition penalty > 0 and applies it in float32: the float32 range
PENALTY_RANGE = (2.0 ** -149, 3.4028234663852886e38)  # the smallest subnormal, the largest finite float32


# tokensampler fields read from vLLM's `SamplingParams.extra_args` (`vllm_xargs` in OpenAI requests),
# by their tokensampler names; any other key is left to other plugins
EXTRA_ARGS_FIELDS = ("dynatemp_range", "dynatemp_exponent", "top_n_sigma", "typical_p", "epsilon_cutoff",
                     "eta_cutoff", "xtc_probability", "xtc_threshold", "dry_multiplier", "dry_base",
                     "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "mirostat_tau",
                     "mirostat_eta")
INT_FIELDS = ("dry_allowed_length", "dry_penalty_last_n")
# DRY's breakers: strings in a request (tokenised by the API server: `admission.tokenize_breakers`),
# token-id sequences when they reach the engine
BREAKERS = "dry_sequence_breakers"


def extra_fields(extra_args: Any) -> dict[str, Any]:
    """The `EXTRA_ARGS_FIELDS` of `extra_args` (None: none): floats, ints (`INT_FIELDS`), and the
    breakers as token-id sequences; vllm_xargs values arrive as str, int or float: a value of
    another kind raises `InvalidSamplingParams` naming the field."""
    out: dict[str, Any] = {}
    for name in (n for n in EXTRA_ARGS_FIELDS if n in (extra_args or {})):
        value = extra_args[name]
        if name == BREAKERS:
            out[name] = _breakers(value)
            continue
        try:
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise ValueError
            number = float(value)
            if name in INT_FIELDS:
                if not number.is_integer():
                    raise ValueError
                out[name] = int(number)
            else:
                out[name] = number
        except (ValueError, OverflowError):
            kind = "an integer" if name in INT_FIELDS else "a number (an int, float or numeric string)"
            raise InvalidSamplingParams(name, value, kind) from None
    return out


def _breakers(value: Any) -> list[list[int]]:
    """The breakers as the engine receives them: a list of token-id lists (the API server turned
    the request's strings into these)."""
    if (isinstance(value, (list, tuple)) and all(isinstance(b, (list, tuple)) and b
                                                 and all(isinstance(t, int) and not isinstance(t, bool) for t in b)
                                                 for b in value)):
        return [list(b) for b in value]
    raise InvalidSamplingParams(BREAKERS, value, "a list of strings (tokenised by the server's tokenizer; "
                                "the server needs one: no --skip-tokenizer-init)")


def to_tokensampler(params: Any, vocab_size: int) -> SamplingParams:
    """The tokensampler parameters of one vLLM request.

    temperature below 1e-5 is greedy (temperature 0, as vLLM); top_k 0 / -1 / >= V is off; the
    stop ids active below `min_tokens` are vLLM's `all_stop_token_ids` (EOS unless ignore_eos, and
    stop_token_ids); bad words come as vLLM tokenised them; the seed is vLLM's (n > 1 children
    already carry seed + index), None draws a fresh one at admission; logprobs N or -1; a
    repetition penalty outside float32's range (vLLM accepts any finite one > 0) is clamped into it.
    """
    temperature = float(params.temperature)
    greedy = temperature < GREEDY_BELOW
    top_k = int(params.top_k or 0)
    min_tokens = int(params.min_tokens or 0)
    stop_ids = tuple(sorted(params.all_stop_token_ids)) if min_tokens > 0 else ()
    bias = {int(t): float(v) for t, v in params.logit_bias.items()} if params.logit_bias else None
    logprobs = params.logprobs
    return SamplingParams(
        temperature=0.0 if greedy else temperature,
        top_k=0 if greedy or top_k <= 0 or top_k >= vocab_size else top_k,
        top_p=1.0 if greedy else float(params.top_p),
        min_p=0.0 if greedy else float(params.min_p),
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        repetition_penalty=min(max(float(params.repetition_penalty), PENALTY_RANGE[0]), PENALTY_RANGE[1]),
        seed=params.seed,
        logprobs=None if logprobs is None else int(logprobs),
        logit_bias=bias,
        allowed_token_ids=tuple(params.allowed_token_ids) if params.allowed_token_ids else None,
        min_tokens=min_tokens,
        stop_token_ids=stop_ids,
        bad_words_token_ids=[list(w) for w in (params.bad_words_token_ids or ())],
        **extra_fields(getattr(params, "extra_args", None)),
    )
