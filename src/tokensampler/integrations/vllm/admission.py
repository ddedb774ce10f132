"""What the plugin refuses when vLLM admits a request: a request no token can satisfy.

vLLM applies `allowed_token_ids` and `bad_words` one after the other; when every allowed id is also
a one-token bad word, no token is left, and vLLM's own sampler then returns a token outside the
allowed ids with HTTP 200. With the plugin such a request is refused when it is admitted (in the
API-server process, where vLLM tokenises the bad words), with a 400 that names both fields. A
multi-token bad word bans its last token only after its prefix, so it never empties the set alone.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from ...core.errors import InvalidSamplingParams
from ...core.params import SamplingParams
from .params import extra_fields


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
