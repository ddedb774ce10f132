"""`Step`: the one interface every backend implements.

    step.run(logits, plan, record=None, token_bitmask=None) -> SamplerOutput

runs steps 1-13 of docs/semantics.md for the rows of `logits` (row b samples slot
`plan.slots[b]`, already checked by the `Sampler`) and records each token into its slot's history,
except on rows where the bool [B] `record` is False. `token_bitmask` (int32 [B, W >= ceil(V / 32)],
xgrammar's layout, checked by the `Sampler`) removes, for this step only, every id whose bit is 0
(on a split each rank reads the bits of its own columns). Aliasing rule, the same for every backend:
the returned tensors are valid until the next `run` of the same step; a backend may return views
of buffers it reuses (the Triton step does, so that a step can be replayed as a CUDA graph), so a
caller copies what it keeps longer.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..core.output import SamplerOutput
from ..core.plan import StepPlan


class Step(Protocol):
    """One sampling step on a `SamplerState`; `capturable` says whether it can be captured in a
    CUDA graph (no host synchronisation, no allocation after its first run)."""

    capturable: bool

    def run(self, logits: torch.Tensor, plan: StepPlan, record: torch.Tensor | None = None,
            token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        ...
