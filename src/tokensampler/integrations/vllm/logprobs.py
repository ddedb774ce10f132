"""tokensampler's logprobs in vLLM's layout (`LogprobsTensors`).

vLLM's rows are `[sampled token, top 1, ..., top N]`: ids int32 [B, N + 1], values float32
[B, N + 1], and the sampled token's 1-based rank int64 [B] (ids with a value >= its value). Rows that
asked for fewer than the batch's N are padded by tokensampler with id -1; here the padding becomes
id 0 at -inf (vLLM reads only the first N + 1 entries of a request's row, but decodes the whole row).
"""

from __future__ import annotations

import torch
from vllm.v1.outputs import LogprobsTensors

from ...core.constants import NEG_INF
from ...core.output import LogprobsOutput


def to_vllm_logprobs(tokens: torch.Tensor, logprobs: LogprobsOutput | None) -> LogprobsTensors | None:
    """vLLM's `LogprobsTensors` of one step (None when no row asked for logprobs)."""
    if logprobs is None:
        return None
    padding = logprobs.top_token_ids < 0
    top_ids = logprobs.top_token_ids.masked_fill(padding, 0)
    top_values = logprobs.top_logprobs.masked_fill(padding, NEG_INF)
    ids = torch.cat([tokens[:, None], top_ids], dim=1).to(torch.int32)
    values = torch.cat([logprobs.token_logprobs[:, None], top_values], dim=1).to(torch.float32)
    return LogprobsTensors(ids, values, logprobs.token_ranks.to(torch.int64))
