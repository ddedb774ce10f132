"""One request's sampling parameters, validated when they are made.

`SamplingParams` is a frozen dataclass: every field is checked in `__post_init__` and a bad value
raises `InvalidSamplingParams` (a `ValueError`) naming the field, the value and the allowed range.
Token ids are checked later, against the vocabulary, when a `Sampler` admits the request.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from .checks import as_list, check_bool, check_int, check_real, check_token_ids, is_int, is_real
from .constants import INT64_MIN, LOGIT_BIAS_LIMIT, UINT64_MAX
from .dry import DRY_MAX_BREAKER_LENGTH, DRY_MAX_HISTORY
from .errors import InvalidSamplingParams


def _token_tuple(name: str, ids: Iterable[Any] | None) -> tuple[int, ...] | None:
    if ids is None:
        return None
    out = tuple(as_list(name, ids, "a sequence of int token ids"))
    for token in out:
        if not is_int(token) or token < 0:
            raise InvalidSamplingParams(name, token, "token ids are ints >= 0")
    return out


_FLOAT32_MAX = 3.4028234663852886e38


def _float32_usable(value: float) -> bool:
    """Whether `value` is at most float32's largest finite value and, unless 0, does not round to 0
    in float32 (what the float32 steps divide and multiply by): a temperature or repetition penalty
    rounding to 0 or inf would make NaN of 0 / 0, -inf / inf or -inf * 0 in the definition."""
    if value == 0.0:
        return True
    return abs(value) <= _FLOAT32_MAX and struct.unpack("f", struct.pack("f", value))[0] != 0.0


_FLOAT32_RANGE = "whose float32 value is finite and non-zero (about 1.4e-45 to 3.4e38)"


def _bad_words(ids: Any) -> tuple[tuple[int, ...], ...]:
    """`bad_words_token_ids` as a tuple of non-empty tuples of ids (None or empty: no bad word)."""
    if ids is None:
        return ()
    words = []
    for word in as_list("bad_words_token_ids", ids, "a sequence of non-empty sequences of int token ids"):
        if word is None:
            raise InvalidSamplingParams("bad_words_token_ids", word, "a sequence of non-empty sequences of token ids")
        tokens = _token_tuple("bad_words_token_ids", word)
        if not tokens:
            raise InvalidSamplingParams("bad_words_token_ids", word, "non-empty sequences of token ids")
        words.append(tokens)
    return tuple(words)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    """`stop` as a tuple of non-empty strings (OpenAI's string or list of strings; None: none)."""
    if stop is None:
        return ()
    allowed = "None, a non-empty string or a sequence of non-empty strings"
    strings = (stop,) if isinstance(stop, str) else tuple(as_list("stop", stop, allowed))
    if not all(isinstance(s, str) and s for s in strings):
        raise InvalidSamplingParams("stop", stop, allowed)
    return strings


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request (see docs/semantics.md for the exact meaning).

    temperature: 0 (greedy: the lowest id among the maxima), or > 0 with a positive finite float32
      value (about 1.4e-45 to 3.4e38).
    top_k: 0 or -1 = off (stored as 0), else >= 1.
    top_p: in (0, 1]; 1 = off.       min_p: in [0, 1]; 0 = off.
    presence_penalty, frequency_penalty: in [-2, 2], on output tokens only.
    repetition_penalty: > 0 with a positive finite float32 value, on prompt and output tokens; 1 = off.
    seed: any int in the signed or unsigned 64-bit range; None or -1 = a fresh random seed at admission.
    logprobs: None = none; 0 = the sampled token only; N >= 1 = also the top N; -1 = the whole vocabulary.
    logit_bias: token id -> bias, each value clamped to [-100, 100].
    allowed_token_ids: if given (non-empty), every other id is removed.
    min_tokens, stop_token_ids: while fewer than `min_tokens` tokens were generated, the stop ids and
      the sampler's EOS ids are removed; min_tokens <= max_tokens when both are given (vLLM's rule).
    max_tokens, n: for the layers above the sampler; choice `i` of a request uses noise stream `i`.
    bad_words_token_ids: sequences of token ids (vLLM's): a one-token bad word is always removed; a
      longer one removes its last token while the request's output (not the prompt) ends with its
      other tokens.
    stop, ignore_eos: for the layers above the sampler (OpenAI's): stop strings end the completion
      (not returned in its text); ignore_eos = EOS is not a stop condition. The sampler itself does
      not read them (EOS ids are still removed below min_tokens, as in vLLM).
    The full-row samplers (docs/semantics.md steps 7 and 10.1-10.5; sampled rows only, like min-p):
    dynatemp_range: >= 0, 0 = off; T varies in [max(0, T - range), T + range] with the entropy.
    dynatemp_exponent: >= 0 (finite). top_n_sigma: None (or -1) = off, else n >= 0.
    typical_p: in (0, 1]; 1 = off.   epsilon_cutoff, eta_cutoff: in [0, 1); 0 = off.
    xtc_probability: in [0, 1]; 0 = off.   xtc_threshold: in [0, 1].
    DRY (docs/semantics.md 5.1, on greedy rows too): dry_multiplier >= 0 (finite float32), 0 = off;
    dry_base >= 1 (finite float32); dry_allowed_length int >= 1; dry_penalty_last_n: -1 = the whole
    history (prompt + output, at most DRY_MAX_HISTORY = 8192 tokens), 0 = off, else the last n tokens
    (at most 8192); dry_sequence_breakers: token-id sequences (head, *tail) a match cannot cross.
    Mirostat v2 (docs/semantics.md 10.6, sampled rows only): mirostat_tau: None (or -1) = off, else the
    target surprise in bits, a float >= 0 (at most 3.4e38); mirostat_eta: the learning rate, a float >= 0
    (at most 3.4e38). The slot's mu starts at 2 * tau.
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
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    top_n_sigma: float | None = None
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[tuple[int, ...], ...] = ()
    mirostat_tau: float | None = None
    mirostat_eta: float = 0.1

    def __post_init__(self) -> None:
        put = object.__setattr__
        bound = f"0 (greedy) or a float >= 0 {_FLOAT32_RANGE}"
        put(self, "temperature", check_real("temperature", self.temperature, 0.0, math.inf, allowed=bound))
        if not _float32_usable(self.temperature):
            raise InvalidSamplingParams("temperature", self.temperature, bound)
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise InvalidSamplingParams("top_k", self.top_k, "0 or -1 (off), or an int >= 1")
        put(self, "top_k", 0 if self.top_k == -1 else int(self.top_k))
        put(self, "top_p", check_real("top_p", self.top_p, 0.0, 1.0, low_open=True,
                                       allowed="a float in (0, 1]"))
        put(self, "min_p", check_real("min_p", self.min_p, 0.0, 1.0, allowed="a float in [0, 1]"))
        for name in ("presence_penalty", "frequency_penalty"):
            put(self, name, check_real(name, getattr(self, name), -2.0, 2.0,
                                        allowed="a float in [-2, 2]"))
        bound = f"a float > 0 {_FLOAT32_RANGE}"
        put(self, "repetition_penalty",
            check_real("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True, allowed=bound))
        if not _float32_usable(self.repetition_penalty):
            raise InvalidSamplingParams("repetition_penalty", self.repetition_penalty, bound)
        put(self, "seed", _checked_seed(self.seed))
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
            if self.min_tokens > self.max_tokens:  # vLLM's rule: min_tokens <= max_tokens
                raise InvalidSamplingParams("min_tokens", self.min_tokens,
                                            f"an int in [0, max_tokens={self.max_tokens}]")
        put(self, "n", check_int("n", self.n, 1, allowed="an int >= 1"))
        put(self, "bad_words_token_ids", _bad_words(self.bad_words_token_ids))
        put(self, "stop", _stop_strings(self.stop))
        check_bool("ignore_eos", self.ignore_eos)
        _check_full_row_fields(self)
        _check_dry_fields(self)

    def with_seed(self, seed: int | None) -> "SamplingParams":
        """These parameters with another `seed` (None or -1: drawn at admission), which alone is
        checked: every other field already was. An engine admitting many requests that differ only
        in their seeds validates their common fields once (`engine.batch_params`)."""
        out = object.__new__(SamplingParams)
        out.__dict__.update(self.__dict__)
        object.__setattr__(out, "seed", _checked_seed(seed))
        return out

    def __reduce__(self) -> tuple:
        """Pickled (and deep-copied) as its fields, remade by the constructor: `logit_bias` is a
        read-only mapping proxy, which cannot be pickled itself."""
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values["logit_bias"] = None if self.logit_bias is None else dict(self.logit_bias)
        return (_remake_params, (values,))

    @property
    def bad_words_depth(self) -> int:
        """How many of the latest output tokens the bad words look at: longest bad word - 1 (0: none)."""
        return max((len(w) for w in self.bad_words_token_ids), default=1) - 1

    @property
    def greedy(self) -> bool:
        """Temperature 0: the lowest id among the maxima; min-p, top-k and top-p are ignored."""
        return self.temperature == 0.0

    @property
    def full_row_fields(self) -> tuple[tuple[str, Any], ...]:
        """(field, value) of each full-row sampler this sampled row turns on (steps 7, 10.1-10.6;
        none on a greedy row, which ignores them)."""
        if self.greedy:
            return ()
        on = (("dynatemp_range", self.dynatemp_range > 0), ("top_n_sigma", self.top_n_sigma is not None),
              ("typical_p", self.typical_p < 1), ("epsilon_cutoff", self.epsilon_cutoff > 0),
              ("eta_cutoff", self.eta_cutoff > 0), ("xtc_probability", self.xtc_probability > 0),
              ("mirostat_tau", self.mirostat_tau is not None))
        return tuple((name, getattr(self, name)) for name, used in on if used)

    def token_ids_used(self) -> Iterable[tuple[str, int]]:
        """(field name, token id) for every token id these params name, for the vocabulary check."""
        for token in self.logit_bias or ():
            yield "logit_bias", token
        for token in self.allowed_token_ids or ():
            yield "allowed_token_ids", token
        for token in self.stop_token_ids:
            yield "stop_token_ids", token
        for word in self.bad_words_token_ids:
            for token in word:
                yield "bad_words_token_ids", token
        for breaker in self.dry_sequence_breakers:
            for token in breaker:
                yield "dry_sequence_breakers", token

    @property
    def dry(self) -> bool:
        """Whether DRY (step 5.1) is on: a multiplier > 0 and a window (dry_penalty_last_n != 0)."""
        return self.dry_multiplier > 0.0 and self.dry_penalty_last_n != 0


def _checked_seed(seed: Any) -> int | None:
    """`seed` as stored: None (-1 too) or an int in the signed or unsigned 64-bit range."""
    if seed is None:
        return None
    if not is_int(seed) or not INT64_MIN <= seed <= UINT64_MAX:
        raise InvalidSamplingParams("seed", seed, f"None, or an int in [{INT64_MIN}, {UINT64_MAX}]")
    return None if seed == -1 else int(seed)


def _check_full_row_fields(params: SamplingParams) -> None:
    """The fields of the full-row samplers (steps 7 and 10.1-10.6), checked and stored as floats."""
    put = object.__setattr__
    finite = f"a float >= 0 {_FLOAT32_RANGE}"
    dyn = check_real("dynatemp_range", params.dynatemp_range, 0.0, _FLOAT32_MAX, allowed=finite)
    if not _float32_usable(dyn) or params.temperature + dyn > _FLOAT32_MAX:
        raise InvalidSamplingParams("dynatemp_range", params.dynatemp_range,
                                    f"{finite}, with temperature + dynatemp_range <= {_FLOAT32_MAX}")
    put(params, "dynatemp_range", dyn)
    put(params, "dynatemp_exponent", check_real("dynatemp_exponent", params.dynatemp_exponent, 0.0,
                                                _FLOAT32_MAX, allowed="a finite float >= 0"))
    sigma = params.top_n_sigma
    if sigma is not None:
        allowed = f"None or -1 (off), or a float >= 0 (at most {_FLOAT32_MAX})"
        if is_real(sigma) and sigma == -1:
            sigma = None
        else:
            sigma = check_real("top_n_sigma", sigma, 0.0, _FLOAT32_MAX, allowed=allowed)
        put(params, "top_n_sigma", sigma)
    put(params, "typical_p", check_real("typical_p", params.typical_p, 0.0, 1.0, low_open=True,
                                         allowed="a float in (0, 1]"))
    for name in ("epsilon_cutoff", "eta_cutoff"):
        put(params, name, check_real(name, getattr(params, name), 0.0, 1.0, high_open=True,
                                      allowed="a float in [0, 1)"))
    for name in ("xtc_probability", "xtc_threshold"):
        put(params, name, check_real(name, getattr(params, name), 0.0, 1.0, allowed="a float in [0, 1]"))
    tau = params.mirostat_tau
    if tau is not None:
        allowed = f"None or -1 (off), or a float >= 0 (at most {_FLOAT32_MAX})"
        tau = None if is_real(tau) and tau == -1 else check_real("mirostat_tau", tau, 0.0, _FLOAT32_MAX,
                                                                  allowed=allowed)
        put(params, "mirostat_tau", tau)
    put(params, "mirostat_eta", check_real("mirostat_eta", params.mirostat_eta, 0.0, _FLOAT32_MAX,
                                           allowed=f"a float >= 0 (at most {_FLOAT32_MAX})"))


def _check_dry_fields(params: SamplingParams) -> None:
    """The DRY fields (docs/semantics.md 5.1), checked and stored as floats, ints and id tuples."""
    put = object.__setattr__
    put(params, "dry_multiplier", check_real("dry_multiplier", params.dry_multiplier, 0.0, _FLOAT32_MAX,
                                             allowed=f"a float >= 0 (at most {_FLOAT32_MAX}); 0 = off"))
    put(params, "dry_base", check_real("dry_base", params.dry_base, 1.0, _FLOAT32_MAX,
                                       allowed=f"a float >= 1 (at most {_FLOAT32_MAX})"))
    put(params, "dry_allowed_length", check_int("dry_allowed_length", params.dry_allowed_length, 1,
                                                allowed="an int >= 1"))
    put(params, "dry_penalty_last_n", check_int("dry_penalty_last_n", params.dry_penalty_last_n, -1,
                                                DRY_MAX_HISTORY, allowed=f"-1 (the whole history), 0 (off) "
                                                f"or an int in [1, {DRY_MAX_HISTORY}]"))
    breakers = params.dry_sequence_breakers
    allowed = f"a sequence of non-empty sequences of token ids, each at most {DRY_MAX_BREAKER_LENGTH} long"
    out = []
    for seq in as_list("dry_sequence_breakers", breakers, allowed):
        if isinstance(seq, (str, bytes)):
            raise InvalidSamplingParams("dry_sequence_breakers", seq, allowed)
        tokens = _token_tuple("dry_sequence_breakers", seq)
        if not tokens or len(tokens) > DRY_MAX_BREAKER_LENGTH:
            raise InvalidSamplingParams("dry_sequence_breakers", seq, allowed)
        out.append(tokens)
    put(params, "dry_sequence_breakers", tuple(out))


def _remake_params(values: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**values)


def check_params_for_vocab(params: SamplingParams, vocab_size: int, max_logprobs: int, split: bool = False) -> None:
    """The checks that need the sampler: token ids against the vocabulary, logprobs against the cap.
    `split` (a vocabulary-split sampler) adds no check: every field runs on a split (the full-row
    samplers on the rows gathered whole, `backends/split/full_rows.py`)."""
    for name, token in params.token_ids_used():
        check_token_ids(name, (token,), vocab_size)
    if params.logprobs is not None and params.logprobs > max_logprobs:
        raise InvalidSamplingParams("logprobs", params.logprobs,
                                    f"None, -1, or an int in [0, {max_logprobs}] (the sampler's max_logprobs)")
