"""Log-probabilities of a step: the sampled token's value and rank, and the top-N ids (step 2/12).

Values are `log_softmax` (or the logits themselves, in the `*_logits` modes) over `[0, V)`.
Ranks and the top-N order are taken on the scores the values come from, value then lower id,
so rounding to logprobs never creates or breaks a tie.
"""

from __future__ import annotations

import torch

from ..output import LogprobsOutput

NEG_INF = float("-inf")


def log_softmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """log_softmax per row; a row with every id at -inf stays at -inf (instead of NaN)."""
    values = torch.log_softmax(scores, dim=-1)
    all_removed = torch.isneginf(scores).all(dim=-1, keepdim=True)
    return values.masked_fill(all_removed, NEG_INF)


def gather_logprobs(scores: torch.Tensor, values: torch.Tensor, tokens: torch.Tensor,
                    num_logprobs: torch.Tensor, width: int) -> LogprobsOutput:
    """scores, values: float32 [B, V]; tokens: int64 [B]; num_logprobs: int64 [B] (N per row,
    rows that asked fewer are padded with id -1 / -inf); width: N of the output."""
    token_scores = scores.gather(-1, tokens[:, None])
    token_values = values.gather(-1, tokens[:, None]).squeeze(-1)
    ranks = (scores >= token_scores).sum(dim=-1)
    if width > 0:
        top_ids = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :width]
        top_values = values.gather(-1, top_ids)
        padding = torch.arange(width, device=scores.device)[None, :] >= num_logprobs[:, None]
        top_ids = top_ids.masked_fill(padding, -1)
        top_values = top_values.masked_fill(padding, NEG_INF)
    else:
        top_ids = torch.empty((scores.shape[0], 0), dtype=torch.int64, device=scores.device)
        top_values = torch.empty((scores.shape[0], 0), dtype=torch.float32, device=scores.device)
    return LogprobsOutput(token_values, ranks, top_ids, top_values)
