"""`TokenSamplerRejectionSampler`: vLLM's rejection sampler, verifying drafts with tokensampler.

vLLM scores K+1 positions per request in one forward and calls the runner's `rejection_sampler`
with the flattened logits of every drafted position and every bonus position. Here they become
tokensampler's `[B, K+1, V]` target logits (row i: its n_i drafted positions, then its bonus
position at index n_i; K = the batch's longest draft) and `[B, K]` drafts (-1 after n_i), and the
persistent batch's `SamplingGenerator` verifies them (`sample_speculative`, docs/speculative.md):
match mode for drafts without probabilities (n-gram and other proposers: the emitted tokens are
exactly the tokens tokensampler gives without speculation), rejection mode with the draft's
probabilities. The output is vLLM's: `[B, K+1]` int32 token ids with -1 after the emitted ones, and
logprobs for every position (vLLM keeps those of the emitted tokens). This is vLLM's
`rejection_sample_method='standard'`; its other acceptance rules ('synthetic', 'block') are refused
before the runner gets this sampler (`guard.check_speculative_config`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.rejection_sampler import RejectionSampler as VllmRejectionSampler

from ...core.output import LogprobsOutput
from .logprobs import to_vllm_logprobs
from .processors import apply_custom
from .sampler import TokenSamplerSampler


def _layout(metadata: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows int64 [B, K+1]: the flat logits row of each request's positions; drafts int64 [B, K])."""
    counts = torch.as_tensor(metadata.num_draft_tokens, dtype=torch.int64, device=device)
    batch, width = counts.numel(), int(metadata.max_spec_len)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(width + 1, device=device)[None, :]
    drafted = position < counts[:, None]
    flat = (starts[:, None] + position).clamp(max=max(int(metadata.target_logits_indices.numel()) - 1, 0))
    target = metadata.target_logits_indices.to(device=device, dtype=torch.int64)
    bonus = metadata.bonus_logits_indices.to(device=device, dtype=torch.int64)[:, None].expand(batch, width + 1)
    rows = torch.where(drafted, target[flat] if target.numel() else bonus, bonus)
    draft_ids = metadata.draft_token_ids.to(device=device, dtype=torch.int64)
    drafts = torch.where(drafted[:, :width], draft_ids[flat[:, :width]] if draft_ids.numel() else -1, -1)
    return rows, drafts


class TokenSamplerRejectionSampler(VllmRejectionSampler):
    """vLLM's `RejectionSampler` verifying with tokensampler (its sampler: a `TokenSamplerSampler`)."""

    def __init__(self, sampler: TokenSamplerSampler, spec_config: Any = None, device: Any = None) -> None:
        super().__init__(sampler, spec_config, device)

    def forward(self, metadata: Any, draft_probs: torch.Tensor | None, logits: torch.Tensor,
                sampling_metadata: Any) -> SamplerOutput:
        sampler: TokenSamplerSampler = self.sampler
        runner = sampler.runner()
        batch = runner.input_batch
        rows_in_batch = batch.num_reqs
        state = sampler.state()
        state.follow(batch.req_ids[:rows_in_batch], runner.requests.__getitem__)
        logits = apply_custom(logits, sampling_metadata.logitsprocs)
        rows, drafts = _layout(metadata, logits.device)
        target = logits[rows]  # [B, K+1, V]
        probs = None
        if draft_probs is not None:
            counts = torch.as_tensor(metadata.num_draft_tokens, dtype=torch.int64, device=logits.device)
            width = drafts.shape[1]
            probs = draft_probs.new_zeros(drafts.shape[0], width, draft_probs.shape[-1])
            take = torch.arange(width, device=logits.device)[None, :] < counts[:, None]
            probs[take] = draft_probs
        record = (~runner.discard_request_mask.np[:rows_in_batch].astype(bool)).tolist()
        active = [b for b, keep in enumerate(record) if keep]
        out = state.generator.sample_speculative(target, drafts, draft_probs=probs, active_slots=active)
        sampler.steps += 1
        tokens = out.token_ids
        logprobs = None
        if out.logprobs is not None:
            flat = LogprobsOutput(*(t.reshape(-1, *t.shape[2:]) for t in (
                out.logprobs.token_logprobs, out.logprobs.token_ranks, out.logprobs.top_token_ids,
                out.logprobs.top_logprobs)))
            logprobs = to_vllm_logprobs(tokens.reshape(-1).clamp(min=0), flat)
            logprobs = LogprobsTensors(*logprobs[:3])
        return SamplerOutput(sampled_token_ids=tokens.to(torch.int32), logprobs_tensors=logprobs)
