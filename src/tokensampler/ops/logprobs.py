"""Log-probabilities of a step: the sampled token's value and rank, and the top-N ids (step 2/12).

Values are `log_softmax` (or the logits themselves, in the `*_logits` modes) over `[0, V)`.
Ranks and the top-N order are taken on the scores the values come from, value then lower id,
so rounding to logprobs never creates or breaks a tie. The top-N comes from `topk` (no sort of
the vocabulary); ties cut at the N-th value are resolved by the lowest ids with one extra scan of
the rows where that happens.
"""

from __future__ import annotations

import torch

from ..output import LogprobsOutput

NEG_INF = float("-inf")


def log_softmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """log_softmax per row; a row with every id at -inf stays at -inf (instead of NaN)."""
    values = torch.log_softmax(scores, dim=-1)
    all_removed = scores.amax(dim=-1, keepdim=True) == NEG_INF
    return values.masked_fill_(all_removed, NEG_INF) if bool(all_removed.any()) else values


def top_n_ids(scores: torch.Tensor, num: torch.Tensor, width: int) -> torch.Tensor:
    """int64 [R, width]: per row the ids of the `num[r]` largest scores ordered by score descending
    then id ascending (a stable descending sort's first `num[r]`); positions >= num[r] are -1."""
    rows = scores.shape[0]
    values, ids = torch.topk(scores, width, dim=-1, sorted=True)
    last = values.gather(-1, (num.clamp(min=1) - 1)[:, None])  # the N-th value of each row
    position = torch.arange(width, device=scores.device)[None, :]
    listed_ties = ((values == last) & (position < num[:, None])).sum(dim=-1, dtype=torch.int32)
    all_ties = (scores == last).sum(dim=-1, dtype=torch.int32)
    for r in torch.nonzero((listed_ties != all_ties) & (num > 0)).flatten().tolist():
        n = int(num[r])
        above = ids[r][values[r] > last[r]]
        tied = torch.nonzero(scores[r] == last[r]).flatten()[: n - above.numel()]
        ids[r, :n] = torch.cat([above, tied])
        values[r, :n] = scores[r, ids[r, :n]]
    # order the listed ids by (score desc, id asc): sort by id, then a stable sort by score
    by_id = torch.sort(ids.masked_fill(position >= num[:, None], torch.iinfo(torch.int64).max), dim=-1)
    ids = by_id.values
    values = scores.gather(-1, ids.clamp(max=scores.shape[-1] - 1)).masked_fill(position >= num[:, None], NEG_INF)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    ids = ids.gather(-1, order)
    return ids.masked_fill_(position >= num[:, None], -1) if rows else ids


def gather_logprobs(scores: torch.Tensor, values: torch.Tensor, tokens: torch.Tensor,
                    num_logprobs: torch.Tensor, width: int) -> LogprobsOutput:
    """scores, values: float32 [B, V]; tokens: int64 [B]; num_logprobs: int64 [B] (N per row,
    rows that asked fewer are padded with id -1 / -inf); width: N of the output."""
    token_scores = scores.gather(-1, tokens[:, None])
    token_values = values.gather(-1, tokens[:, None]).squeeze(-1)
    ranks = (scores >= token_scores).sum(dim=-1, dtype=torch.int32).to(torch.int64)
    if width > 0:
        top_ids = top_n_ids(scores, num_logprobs, width)
        padding = top_ids < 0
        top_values = values.gather(-1, top_ids.clamp(min=0)).masked_fill_(padding, NEG_INF)
    else:
        top_ids = torch.empty((scores.shape[0], 0), dtype=torch.int64, device=scores.device)
        top_values = torch.empty((scores.shape[0], 0), dtype=torch.float32, device=scores.device)
    return LogprobsOutput(token_values, ranks, top_ids, top_values)
