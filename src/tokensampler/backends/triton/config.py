"""The Triton kernels' tunables (`KernelConfig`) and whether Triton is there; imports no Triton.

Which step a sampler runs is decided once, when it is made (`backends.choice.BackendChoice`). The
kernels return logprobs for N <= `MAX_KERNEL_LOGPROBS`; a step whose batch asks more runs the
torch step. `KERNEL_STAGES` names the stages the kernels mirror; a plan that needs another one runs
the torch step too (`covers`: the hand-off of a stage that has no mirror yet, docs/architecture.md
"Adding a stage").
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from ...core.checks import check_int
from ...core.errors import InvalidSamplingParams
from ...core.plan import EDIT_STAGES, FILTER_STAGES, FULL_ROW_STAGES, StepPlan

MAX_KERNEL_LOGPROBS = 20
# the stages of the definition the kernels mirror bit for bit (`kernels.prepare_kernel`: the edits,
# `kernels.select_kernel`: the filters); a stage added without a mirror is left out of this set. The
# full-row stages (dynamic temperature, top-n-sigma, typical-p, epsilon, eta, XTC) have no mirror:
# their plans run the torch step, whose full-row route implements them (`torch_step.extra_filters`).
# not mirrored: the full-row filters, and DRY (its matches over each slot's history)
KERNEL_STAGES = frozenset(EDIT_STAGES + FILTER_STAGES) - frozenset(FULL_ROW_STAGES) - {"dry"}

_triton_found: bool | None = None


def triton_available() -> bool:
    """True when the `triton` package can be imported (checked once per process, without importing it)."""
    global _triton_found
    if _triton_found is None:
        _triton_found = importlib.util.find_spec("triton") is not None
    return _triton_found


def covers(plan: StepPlan) -> bool:
    """Whether the kernels mirror every stage `plan` needs (`KERNEL_STAGES`); if not, the step is
    handed to the torch step, whose `stages` implement every stage."""
    return KERNEL_STAGES.issuperset(plan.edits() + plan.filters)


MAX_SPLITS = 64


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes and work split of the kernels (powers of two).

    splits: programs per row of the prepare kernel (0 = enough for ~4 programs per SM on CUDA,
    1 on CPU). pivots: thresholds tested per pass of the top-k / top-p search. window_cap: once the
    search window holds at most this many ids they are copied to a per-row list (read window_block
    at a time) and later passes read only the list.
    """

    prepare_block: int = 1024
    select_block: int = 512
    logprobs_block: int = 1024
    pivots: int = 16
    window_cap: int = 4096
    window_block: int = 512
    splits: int = 0
    num_warps: int = 8

    def __post_init__(self) -> None:
        for name in ("prepare_block", "select_block", "logprobs_block", "pivots", "window_cap", "window_block"):
            value = getattr(self, name)
            low = 32 if name == "logprobs_block" else 2
            if check_int(f"KernelConfig.{name}", value, low, allowed=f"a power of two >= {low}") & (value - 1):
                raise InvalidSamplingParams(f"KernelConfig.{name}", value, f"a power of two >= {low}")
        splits = check_int("KernelConfig.splits", self.splits, 0, MAX_SPLITS)
        if splits & (splits - 1):
            raise InvalidSamplingParams("KernelConfig.splits", splits, f"0 or a power of two <= {MAX_SPLITS}")
        check_int("KernelConfig.num_warps", self.num_warps, 1)
