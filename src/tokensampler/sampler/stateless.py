"""`sample`: one sampling step with no state kept between calls (a fresh `Sampler` holding the rows)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..core.checks import as_list
from ..core.errors import InvalidSamplingParams
from ..core.output import SamplerOutput
from ..core.params import SamplingParams
from .sampler import Sampler


def per_row(name: str, value: Any, batch: int) -> list:
    if value is None:
        return [()] * batch
    rows = as_list(name, value, f"None or a sequence with one entry per logits row ({batch})")
    if len(rows) != batch:
        raise InvalidSamplingParams(name, f"{len(rows)} rows", f"one entry per logits row ({batch})")
    return rows


def sample(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams], *,
           prompt_token_ids: Sequence[Sequence[int]] | None = None,
           output_token_ids: Sequence[Sequence[int]] | None = None,
           positions: Sequence[int] | None = None, vocab_size: int | None = None,
           logprobs_mode: str = "raw_logprobs", eos_token_ids: Sequence[int] = (),
           token_bitmask: torch.Tensor | None = None, backend: str | None = None,
           compile: bool | None = None) -> SamplerOutput:
    """Sample one token per row of `logits` ([B, Vp]) with no state kept between calls: equal to a
    fresh `Sampler` holding the rows.

    params: one `SamplingParams` for every row, or a list with one per row.
    prompt_token_ids, output_token_ids: per-row histories (for penalties and min_tokens).
    positions: per-row position of the token sampled (default: prompt + output length).
    vocab_size: the real vocabulary (default Vp: no padding).
    Unseeded rows draw a fresh seed, as `Sampler.add_request` does.
    token_bitmask: optional int32 [B, W >= ceil(V / 32)] (xgrammar's layout), as in `Sampler.sample`.
    backend, compile: the step's backend and torch.compile choice, as in `Sampler` (None: the
    environment's defaults).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise InvalidSamplingParams("logits", getattr(logits, "shape", logits), "a 2-d tensor [B, Vp]")
    batch, padded = logits.shape
    if isinstance(params, SamplingParams):
        rows = [params] * batch
    else:
        allowed = f"a SamplingParams, or a sequence of them with one per logits row ({batch})"
        rows = as_list("params", params, allowed)
        if len(rows) != batch or not all(isinstance(p, SamplingParams) for p in rows):
            raise InvalidSamplingParams("params", params, allowed)
    prompts = per_row("prompt_token_ids", prompt_token_ids, batch)
    outputs = per_row("output_token_ids", output_token_ids, batch)
    pos = [None] * batch if positions is None else per_row("positions", positions, batch)
    sampler = Sampler(padded if vocab_size is None else vocab_size, max_slots=max(batch, 1),
                      device=logits.device, padded_vocab_size=padded, logprobs_mode=logprobs_mode,
                      max_logprobs=max([p.logprobs or 0 for p in rows] + [20]), eos_token_ids=eos_token_ids,
                      backend=backend, compile=compile)
    for b in range(batch):
        sampler.add_request(b, rows[b], prompts[b], output_token_ids=outputs[b], position=pos[b])
    return sampler.sample(logits, token_bitmask=token_bitmask)
