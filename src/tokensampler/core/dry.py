"""The DRY sampler's shared conventions (docs/semantics.md 5.1): the kept history's length and the
exponent cap, computed once here for the oracle and every implementation."""

from __future__ import annotations

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


def dry_window(last_n: int, history_length: int) -> int:
    """How many of the latest history tokens DRY reads: all (up to DRY_MAX_HISTORY) for -1, none for 0."""
    limit = DRY_MAX_HISTORY if last_n == -1 else last_n
    return min(limit, history_length)


# the longest breaker sequence (head and tail) a request may give; llama.cpp caps a tail at 20 tokens
DRY_MAX_BREAKER_LENGTH = 21
