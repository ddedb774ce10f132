"""The DRY sampler's shared conventions (docs/semantics.md 5.1): the kept history's length and the
exponent cap, computed once here for the oracle and every implementation."""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence

import torch

# the most history tokens DRY reads (dry_penalty_last_n = -1 reads the last DRY_MAX_HISTORY tokens of
# prompt + output; llama.cpp's -1 reads the model's context size)
DRY_MAX_HISTORY = 8192
_FLOAT_MAX_LOG = 88.7228391  # llama.cpp's FLOAT_MAX_LOG (a float32 constant)


def dry_max_exponent(base: float) -> int:
    """llama.cpp's cap of `L - allowed_length`: `int(88.7228391f / logf(base))` in float32 for
    base > 1.000001 (float32), else 0 (no cap)."""
    b = torch.tensor(base, dtype=torch.float32)
    if not bool(b > torch.tensor(1.000001, dtype=torch.float32)):
        return 0
    return int(torch.tensor(_FLOAT_MAX_LOG, dtype=torch.float32) / torch.log(b))


def dry_penalty(multiplier: float, base: float, allowed_length: int, length: int) -> float:
    """The penalty of a repeat of `length` tokens, as llama.cpp computes it: `m * b^e` with the
    float32 `m` and `b` and `e = length - allowed_length` (capped by `dry_max_exponent`), in double
    (`std::pow`), stored in a float32 (`const float penalty`): the float32 value, returned as a float.
    The logit then loses it in float32 (`logit -= penalty`), which a float64 difference of the two
    float32 values rounded once to float32 computes exactly."""
    m = float(torch.tensor(multiplier, dtype=torch.float32))
    b = float(torch.tensor(base, dtype=torch.float32))
    cap = dry_max_exponent(base)
    exponent = length - allowed_length
    if cap > 0 and exponent > cap:
        exponent = cap
    return float(torch.tensor(m * b ** exponent, dtype=torch.float64).to(torch.float32))


@lru_cache(maxsize=256)
def single_token_breakers(breakers: tuple[tuple[int, ...], ...]) -> frozenset[int]:
    """The ids that are a whole sequence breaker on their own: DRY never penalises them (llama.cpp
    skips an id whose breakers include one with an empty tail)."""
    return frozenset(b[0] for b in breakers if len(b) == 1)


def dry_window(last_n: int, history_length: int) -> int:
    """How many of the latest history tokens DRY reads: all (up to DRY_MAX_HISTORY) for -1, none for 0."""
    limit = DRY_MAX_HISTORY if last_n == -1 else last_n
    return min(limit, history_length)


# the longest breaker sequence (head and tail) a request may give; llama.cpp caps a tail at 20 tokens
DRY_MAX_BREAKER_LENGTH = 21


def breakers_from_strings(strings: Sequence[str], token_texts: Sequence[str],
                          tokenize: Callable[[str], Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """DRY's sequence breakers from strings, as llama.cpp builds them at init
    (`get_overlapping_token_sequences`): for each string s, every id whose text contains s is a
    one-token breaker; every id whose text ends with a proper prefix of s (at each place its text
    has s's first character) is a head whose tail is `tokenize` of the rest of s (at most
    DRY_MAX_BREAKER_LENGTH - 1 tokens). Duplicates are dropped; the order is by id.

    token_texts: the text of each id (`detokenize([id])`, special tokens included);
    tokenize: a string's ids without special tokens. Empty strings are skipped."""
    out: dict[tuple[int, ...], None] = {}
    for s in strings:
        if not s:
            continue
        for token, word in enumerate(token_texts):
            if s in word:
                out[(token,)] = None
                continue
            pos = word.find(s[0])
            while pos != -1:
                rest = word[pos:]
                if s.startswith(rest):  # the text's end is a proper prefix of s
                    tail = tuple(int(t) for t in tokenize(s[len(rest):]))[:DRY_MAX_BREAKER_LENGTH - 1]
                    out[(token, *tail)] = None
                pos = word.find(s[0], pos + 1)
    return tuple(out)
