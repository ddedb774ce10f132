"""What the plugin refuses when vLLM admits a request: a request no token can satisfy.

vLLM applies `allowed_token_ids` and `bad_words` one after the other; when every allowed id is also
a one-token bad word, no token is left, and vLLM's own sampler then returns a token outside the
allowed ids with HTTP 200. With the plugin such a request is refused when it is admitted (in the
API-server process, where vLLM tokenises the bad words), with a 400 that names both fields. A
multi-token bad word bans its last token only after its prefix, so it never empties the set alone.
The tokensampler fields of `extra_args` are checked there too (a bad one: a 400 naming it), after
DRY's string breakers are turned into token-id sequences with the model's tokenizer.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Sequence

from ...core.dry import breakers_from_strings
from ...core.errors import InvalidSamplingParams
from ...core.params import SamplingParams
from .params import BREAKERS, extra_fields


def every_allowed_id_banned(allowed: Iterable[int] | None, bad_words: Sequence[Sequence[int]] | None) -> bool:
    """Whether the one-token bad words ban every id of a non-empty `allowed` (None: no allow-list)."""
    ids = set(allowed or ())
    banned = {int(word[0]) for word in bad_words or () if len(word) == 1}
    return bool(ids) and ids <= banned


def check_allowed_against_bad_words(params: Any) -> None:
    """Refuse vLLM `SamplingParams` (bad words already tokenised) whose allowed ids are all banned,
    with vLLM's validation error (the client gets a 400)."""
    if not every_allowed_id_banned(params.allowed_token_ids, params.bad_words_token_ids):
        return
    from vllm.exceptions import VLLMValidationError

    raise VLLMValidationError(
        f"allowed_token_ids {sorted(set(params.allowed_token_ids))} are all banned by bad_words "
        f"{list(params.bad_words)}: no token can be sampled (allow an id that no one-token bad word bans)",
        parameter="allowed_token_ids", value=sorted(set(params.allowed_token_ids)))


def check_extra_args(params: Any) -> None:
    """Refuse vLLM `SamplingParams` whose tokensampler `extra_args` fields are bad (not a number, or
    out of range), with vLLM's validation error naming the field (the client gets a 400)."""
    try:
        fields = extra_fields(getattr(params, "extra_args", None))
        if fields:
            SamplingParams(**fields)
    except InvalidSamplingParams as error:
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError(f"extra_args: {error}") from None


_TOKEN_TEXTS: dict[int, tuple[Any, list[str]]] = {}  # id(tokenizer) -> (tokenizer, each id's text)


def token_texts(tokenizer: Any) -> list[str]:
    """Each id's text, `decode([id])` with special tokens (computed once per tokenizer)."""
    held = _TOKEN_TEXTS.get(id(tokenizer))
    if held is None or held[0] is not tokenizer:
        ids = [[i] for i in range(len(tokenizer))]
        texts = list(tokenizer.batch_decode(ids)) if hasattr(tokenizer, "batch_decode") else \
            [tokenizer.decode(i) for i in ids]
        held = _TOKEN_TEXTS[id(tokenizer)] = (tokenizer, texts)
    return held[1]


@functools.lru_cache(maxsize=64)
def _expanded(key: int, strings: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    tokenizer = _TOKEN_TEXTS[key][0]
    return breakers_from_strings(strings, _TOKEN_TEXTS[key][1],
                                 lambda text: tokenizer.encode(text, add_special_tokens=False))


def tokenize_breakers(params: Any, tokenizer: Any) -> None:
    """DRY's breakers of a vLLM request given as strings (`extra_args["dry_sequence_breakers"]`),
    replaced by token-id sequences as llama.cpp builds them (`core.dry.breakers_from_strings`, with
    the model's tokenizer); called in the API server, where vLLM tokenises the bad words. Breakers
    that are not strings are refused there (vLLM's validation error: a 400), so the token ids the
    engine receives are the tokenizer's."""
    extra = getattr(params, "extra_args", None)
    value = (extra or {}).get(BREAKERS)
    if isinstance(value, str):
        value = [value]
    if value is None:
        return
    if not (isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value)):
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError(f"extra_args: {BREAKERS}={value!r} is invalid: allowed a list of strings",
                                  parameter=BREAKERS, value=value)
    token_texts(tokenizer)
    extra[BREAKERS] = [list(b) for b in _expanded(id(tokenizer), tuple(value))]
