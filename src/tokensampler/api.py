"""`sample(...)`: the stateless one-call form, equal to a fresh `Sampler` holding the rows."""

from __future__ import annotations

from typing import Sequence

import torch

from .output import SamplerOutput
from .params import InvalidSamplingParams, SamplingParams
from .sampler import Sampler


def _per_row(name: str, value, batch: int) -> list:
    if value is None:
        return [()] * batch
    rows = list(value)
    if len(rows) != batch:
        raise InvalidSamplingParams(name, f"{len(rows)} rows", f"one entry per logits row ({batch})")
    return rows


def sample(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams], *,
           prompt_token_ids: Sequence[Sequence[int]] | None = None,
           output_token_ids: Sequence[Sequence[int]] | None = None,
           positions: Sequence[int] | None = None, vocab_size: int | None = None,
           logprobs_mode: str = "raw_logprobs", eos_token_ids: Sequence[int] = ()) -> SamplerOutput:
    """Sample one token per row of `logits` ([B, Vp]) with no state kept between calls.

    params: one `SamplingParams` for every row, or a list with one per row.
    prompt_token_ids, output_token_ids: per-row histories (for penalties and min_tokens).
    positions: per-row position of the token sampled (default: prompt + output length).
    vocab_size: the real vocabulary (default Vp: no padding).
    Unseeded rows draw a fresh seed, as `Sampler.add_request` does.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise InvalidSamplingParams("logits", getattr(logits, "shape", logits), "a 2-d tensor [B, Vp]")
    batch, padded = logits.shape
    rows = [params] * batch if isinstance(params, SamplingParams) else _per_row("params", params, batch)
    prompts = _per_row("prompt_token_ids", prompt_token_ids, batch)
    outputs = _per_row("output_token_ids", output_token_ids, batch)
    pos = [None] * batch if positions is None else _per_row("positions", positions, batch)
    sampler = Sampler(padded if vocab_size is None else vocab_size, max_slots=max(batch, 1),
                      device=logits.device, padded_vocab_size=padded, logprobs_mode=logprobs_mode,
                      max_logprobs=max([p.logprobs or 0 for p in rows] + [20]), eos_token_ids=eos_token_ids)
    for b in range(batch):
        sampler.add_request(b, rows[b], prompts[b], output_token_ids=outputs[b], position=pos[b])
    return sampler.sample(logits)
