"""What one sampling step returns: `SamplerOutput` and its optional `LogprobsOutput`; what a
speculative verification returns: `SpeculativeOutput`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .constants import NEG_INF


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

    @classmethod
    def empty(cls, shape: tuple[int, ...], width: int, device: torch.device | str) -> LogprobsOutput:
        """The output before any row is filled in: value 0, rank 0, ids -1 and values -inf.

        shape: the leading dims, (B,) for a step or (B, K+1) for a speculative verification; width:
        N, the top-N entries per position (0 or more)."""
        width = max(width, 0)
        return cls(torch.zeros(shape, dtype=torch.float32, device=device),
                   torch.zeros(shape, dtype=torch.int64, device=device),
                   torch.full((*shape, width), -1, dtype=torch.int64, device=device),
                   torch.full((*shape, width), NEG_INF, dtype=torch.float32, device=device))


@dataclass
class SamplerOutput:
    """token_ids: int64 [B], always a real id in [0, vocab_size).
    valid: bool [B], False for a row where every id was removed (it gets its raw greedy id).
    logprobs: None when no row asked for logprobs.
    """

    token_ids: torch.Tensor
    valid: torch.Tensor
    logprobs: LogprobsOutput | None = None


@dataclass
class SpeculativeOutput:
    """What one speculative verification returns (`Sampler.sample_speculative`, docs/speculative.md).

    token_ids: int64 [B, K+1]; row b holds its emitted tokens first (positions pos_b .. pos_b +
      num_emitted[b] - 1), then -1. Every emitted id is a real id in [0, vocab_size).
    num_emitted: int64 [B], in [1, K+1]: the accepted drafts plus one (the correction at the first
      rejection, or the bonus token when every draft of the row was accepted).
    valid: bool [B, K+1], False at an emitted position whose row had no id left (the token is then
      the raw greedy id, as in `SamplerOutput.valid`); True elsewhere.
    logprobs: None when no row asked for logprobs; else a `LogprobsOutput` with one entry per
      position: token_logprobs float32 [B, K+1], token_ranks int64 [B, K+1], top_token_ids int64
      [B, K+1, N], top_logprobs float32 [B, K+1, N]. Positions past num_emitted (and rows that did
      not ask) hold value 0, rank 0, ids -1 and values -inf.
    """

    token_ids: torch.Tensor
    num_emitted: torch.Tensor
    valid: torch.Tensor
    logprobs: LogprobsOutput | None = None

    @property
    def num_accepted(self) -> torch.Tensor:
        """int64 [B]: how many drafts of each row were accepted (num_emitted - 1)."""
        return self.num_emitted - 1
