"""What one sampling step returns: `SamplerOutput` and its optional `LogprobsOutput`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogprobsOutput:
    """Log-probabilities of one step, all on the sampler's device.

    token_logprobs: float32 [B], the sampled token's value in the sampler's `logprobs_mode`.
    token_ranks: int64 [B], 1-based: how many real ids have a value >= the sampled token's.
    top_token_ids: int64 [B, N] and top_logprobs: float32 [B, N], N = the largest `logprobs` asked
      in the batch (the vocabulary size for -1), sorted by value then id; a row that asked for fewer
      is padded with id -1 and value -inf.
    """

    token_logprobs: torch.Tensor
    token_ranks: torch.Tensor
    top_token_ids: torch.Tensor
    top_logprobs: torch.Tensor


@dataclass
class SamplerOutput:
    """token_ids: int64 [B], always a real id in [0, vocab_size).
    valid: bool [B], False for a row where every id was removed (it gets its raw greedy id).
    logprobs: None when no row asked for logprobs.
    """

    token_ids: torch.Tensor
    valid: torch.Tensor
    logprobs: LogprobsOutput | None = None
