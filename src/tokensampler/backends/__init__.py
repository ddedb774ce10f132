"""The backends of one sampling step, behind one interface (`base.Step`), chosen in one place.

- `torch_step`: torch ops, sort-free, the CPU fast path (and the torch path on CUDA);
- `triton`: fused Triton kernels for CUDA logits;
- `split`: the vocabulary split over a group, a few small all-gathers per step.

The choice is made once, when the sampler is made (`choice.BackendChoice`: the `backend=` and
`compile=` arguments, or the environment's defaults read then), and `Backends` keeps it.
`Backends.choose` applies it without reading anything else: a sampler whose layout is a slice runs
the split step; otherwise the kernels when the choice says so (by default: CUDA logits with Triton
importable), the batch asks at most 20 logprobs and the kernels mirror every stage of the plan
(`triton.config.covers`); everything else runs the torch step. Steps are
made on first use and keep their buffers from call to call.
"""

from __future__ import annotations

import torch

from ..core.plan import StepPlan
from ..parallel.agreement import Agreement
from ..state import SamplerState
from .base import Step
from .choice import BackendChoice
from .torch_step.config import TorchStepConfig
from .torch_step.step import TorchStep
from .triton.config import KernelConfig, covers

__all__ = ["BackendChoice", "Backends", "Step"]


class Backends:
    """The steps one sampler can run, on its state; `choose` picks the one for a call.

    choice: the sampler's resolved `BackendChoice` (default: the torch step, eager)."""

    def __init__(self, state: SamplerState, logprobs_mode: str, agreement: Agreement,
                 step_config: TorchStepConfig | None = None, kernel_config: KernelConfig | None = None,
                 choice: BackendChoice | None = None) -> None:
        self.state = state
        self.logprobs_mode = logprobs_mode
        self.agreement = agreement
        self.kernel_config = kernel_config
        self.choice = BackendChoice("torch", False, False) if choice is None else choice
        self.torch_step = TorchStep(state, logprobs_mode, step_config, compiled=self.choice.compile)
        self._kernels: Step | None = None
        self._split: Step | None = None

    def choose(self, logits: torch.Tensor, plan: StepPlan) -> Step:
        """The step that runs `plan` on `logits` (as the sampler's choice says: nothing is read)."""
        if self.state.layout.split:
            return self.split
        if self.choice.use_kernels(plan.logprobs_width) and covers(plan):
            return self.kernels
        return self.torch_step

    def warmup(self) -> dict:
        """Run the torch step's routes once (`torch_step.warmup.warm`) on a scratch state, when its
        compiled reductions are on (`choice.compile`) and this sampler holds the whole vocabulary
        (the split step and the Triton kernels compile nothing through torch.compile)."""
        from .torch_step.warmup import warm

        layout = self.state.layout
        if layout.split or not self.choice.compile:
            return {"seconds": 0.0, "steps": 0}
        return warm(layout.vocab_size, layout.padded_vocab_size, self.logprobs_mode, self.torch_step.config,
                    self.state.device)

    @property
    def kernels(self) -> Step:
        """The fused Triton step (imports Triton on first use)."""
        if self._kernels is None:
            from .triton.launcher import KernelStep
            self._kernels = KernelStep(self.state, self.logprobs_mode, self.kernel_config)
        return self._kernels

    @property
    def split(self) -> Step:
        """The split step over the agreement's exchange."""
        if self._split is None:
            from .split.step import SplitStep
            self._split = SplitStep(self.state, self.logprobs_mode, self.agreement.exchange)
        return self._split
