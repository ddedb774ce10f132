"""One request's sampling parameters, validated when they are made.

`SamplingParams` is a frozen dataclass: every field is checked in `__post_init__` and a bad value
raises `InvalidSamplingParams` (a `ValueError`) naming the field, the value and the allowed range.
Token ids are checked later, against the vocabulary, when a `Sampler` admits the request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from .checks import check_int, check_real, check_token_ids, is_int, is_real
from .constants import INT64_MIN, LOGIT_BIAS_LIMIT, UINT64_MAX
from .errors import InvalidSamplingParams


def _token_tuple(name: str, ids: Iterable[Any] | None) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise InvalidSamplingParams(name, ids, "a sequence of int token ids")
    out = tuple(ids)
    for token in out:
        if not is_int(token) or token < 0:
            raise InvalidSamplingParams(name, token, "token ids are ints >= 0")
    return out


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request (see docs/semantics.md for the exact meaning).

    temperature: >= 0, finite; 0 means greedy (lowest id among the maxima).
    top_k: 0 or -1 = off (stored as 0), else >= 1.
    top_p: in (0, 1]; 1 = off.       min_p: in [0, 1]; 0 = off.
    presence_penalty, frequency_penalty: in [-2, 2], on output tokens only.
    repetition_penalty: > 0, finite, on prompt and output tokens; 1 = off.
    seed: any int in the signed or unsigned 64-bit range; None or -1 = a fresh random seed at admission.
    logprobs: None = none; 0 = the sampled token only; N >= 1 = also the top N; -1 = the whole vocabulary.
    logit_bias: token id -> bias, each value clamped to [-100, 100].
    allowed_token_ids: if given (non-empty), every other id is removed.
    min_tokens, stop_token_ids: while fewer than `min_tokens` tokens were generated, the stop ids and
      the sampler's EOS ids are removed.
    max_tokens, n: for the layers above the sampler; choice `i` of a request uses noise stream `i`.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    allowed_token_ids: tuple[int, ...] | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "temperature", check_real("temperature", self.temperature, 0.0, math.inf,
                                             allowed="a finite float >= 0 (0 = greedy)"))
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise InvalidSamplingParams("top_k", self.top_k, "0 or -1 (off), or an int >= 1")
        put(self, "top_k", 0 if self.top_k == -1 else int(self.top_k))
        put(self, "top_p", check_real("top_p", self.top_p, 0.0, 1.0, low_open=True,
                                       allowed="a float in (0, 1]"))
        put(self, "min_p", check_real("min_p", self.min_p, 0.0, 1.0, allowed="a float in [0, 1]"))
        for name in ("presence_penalty", "frequency_penalty"):
            put(self, name, check_real(name, getattr(self, name), -2.0, 2.0,
                                        allowed="a float in [-2, 2]"))
        put(self, "repetition_penalty",
            check_real("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True,
                        allowed="a finite float > 0"))
        seed = self.seed
        if seed is not None:
            if not is_int(seed) or not INT64_MIN <= seed <= UINT64_MAX:
                raise InvalidSamplingParams("seed", seed, f"None, or an int in [{INT64_MIN}, {UINT64_MAX}]")
            put(self, "seed", None if seed == -1 else int(seed))
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < -1):
            raise InvalidSamplingParams("logprobs", self.logprobs,
                                        "None, -1 (whole vocabulary) or an int >= 0")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise InvalidSamplingParams("logit_bias", self.logit_bias, "a mapping token id -> float")
            bias: dict[int, float] = {}
            for token, value in self.logit_bias.items():
                if not is_int(token) or token < 0:
                    raise InvalidSamplingParams("logit_bias", token, "token ids are ints >= 0")
                if not is_real(value) or math.isnan(value):
                    raise InvalidSamplingParams(f"logit_bias[{token}]", value, "a float (clamped to [-100, 100])")
                bias[int(token)] = min(max(float(value), -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
            put(self, "logit_bias", MappingProxyType(bias) if bias else None)
        allowed = _token_tuple("allowed_token_ids", self.allowed_token_ids)
        if allowed is not None and not allowed:
            raise InvalidSamplingParams("allowed_token_ids", self.allowed_token_ids,
                                        "None or a non-empty sequence of token ids")
        put(self, "allowed_token_ids", allowed)
        put(self, "min_tokens", check_int("min_tokens", self.min_tokens, 0, allowed="an int >= 0"))
        put(self, "stop_token_ids", _token_tuple("stop_token_ids", self.stop_token_ids) or ())
        if self.max_tokens is not None:
            put(self, "max_tokens", check_int("max_tokens", self.max_tokens, 1, allowed="None or an int >= 1"))
        put(self, "n", check_int("n", self.n, 1, allowed="an int >= 1"))

    @property
    def greedy(self) -> bool:
        """Temperature 0: the lowest id among the maxima; min-p, top-k and top-p are ignored."""
        return self.temperature == 0.0

    def token_ids_used(self) -> Iterable[tuple[str, int]]:
        """(field name, token id) for every token id these params name, for the vocabulary check."""
        for token in self.logit_bias or ():
            yield "logit_bias", token
        for token in self.allowed_token_ids or ():
            yield "allowed_token_ids", token
        for token in self.stop_token_ids:
            yield "stop_token_ids", token


def check_params_for_vocab(params: SamplingParams, vocab_size: int, max_logprobs: int) -> None:
    """The checks that need the sampler: token ids against the vocabulary, logprobs against the cap."""
    for name, token in params.token_ids_used():
        check_token_ids(name, (token,), vocab_size)
    if params.logprobs is not None and params.logprobs > max_logprobs:
        raise InvalidSamplingParams("logprobs", params.logprobs,
                                    f"None, -1, or an int in [0, {max_logprobs}] (the sampler's max_logprobs)")
