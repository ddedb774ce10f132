"""vLLM's logits processors the plugin runs: the custom ones (per-request, user-supplied).

vLLM's built-in min-tokens, logit-bias and min-p processors are not run: tokensampler implements
those steps of the definition itself. Every other processor edits whole logits rows before
tokensampler's pipeline, as without the plugin.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)

BUILTIN_PROCESSORS = (MinTokensLogitsProcessor, LogitBiasLogitsProcessor, MinPLogitsProcessor)


def custom_processors(logitsprocs: Any) -> list[Any]:
    """The processors of vLLM's `LogitsProcessors` (or None) that are not built in."""
    return [p for p in (logitsprocs.all if logitsprocs is not None else ()) if not isinstance(p, BUILTIN_PROCESSORS)]


def apply_custom(logits: torch.Tensor, logitsprocs: Any) -> torch.Tensor:
    """`logits` after every custom processor, in vLLM's order."""
    for processor in custom_processors(logitsprocs):
        logits = processor.apply(logits)
    return logits
