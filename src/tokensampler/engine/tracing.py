"""Captured sampling steps: one CUDA graph per `TraceKey`, replayed on the same logits tensor.

A captured step bakes in its step plan (which rows are greedy, which filters run), so each trace
also records the rows' parameters and is captured again when they change. A key is bound to the
logits tensor it was captured with: replaying with another raises `TraceMismatch`. Off CUDA, and
for a vocabulary-split sampler (its step reads the ranks' agreement on the host), the same
bookkeeping runs and the step is eager; on CUDA a step that cannot be captured runs eagerly.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import TraceMismatch
from ..core.output import SamplerOutput
from ..core.plan import StepPlan
from ..sampler import Sampler


@dataclass(frozen=True)
class TraceKey:
    """One captured step per key (the rest of the step plan is checked at replay)."""

    penalties: bool
    logprobs: bool
    force_argmax: bool
    batch: int


@dataclass
class _Trace:
    logits_id: tuple           # (data_ptr, shape, stride, dtype, device) of the static input
    signature: tuple           # the rows' parameters the step plan was made from
    graph: Any = None          # torch.cuda.CUDAGraph, or None for an eager step
    record: torch.Tensor | None = None
    output: SamplerOutput | None = None
    replays: int = field(default=0)


def _tensor_id(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device


class StepTracer:
    """The captured steps of one `Sampler`, by key."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.device = sampler.device
        self._traces: dict[TraceKey, _Trace] = {}
        self.captures = 0

    def keys(self) -> list[TraceKey]:
        """The keys of the steps captured now."""
        return list(self._traces)

    def clear(self) -> None:
        """Drop every captured step."""
        self._traces.clear()

    def check(self, logits: torch.Tensor, force_argmax: bool) -> None:
        """Raise `TraceMismatch` where `step` would, changing nothing (a split generator checks
        this before its ranks agree to step)."""
        self._lookup(logits, force_argmax)

    def _lookup(self, logits: torch.Tensor, force_argmax: bool) -> tuple[TraceKey, _Trace | None, StepPlan]:
        batch = logits.shape[0]
        plan = self.sampler.plan_rows(batch)
        key = TraceKey(plan.penalties, plan.wants_logprobs, force_argmax, batch)
        trace = self._traces.get(key)
        if trace is not None and trace.logits_id != _tensor_id(logits):
            raise TraceMismatch("logits", _tensor_id(logits)[:2],
                                f"the tensor the step {key} was captured with (data_ptr, shape) "
                                f"{trace.logits_id[:2]}: copy the new logits into it")
        return key, trace, plan

    def step(self, logits: torch.Tensor, record: torch.Tensor, force_argmax: bool) -> SamplerOutput:
        """Sample `logits` (row b = slot b) through the captured step of its key; `record` is the
        bool [B] host mask of the rows to count."""
        key, trace, plan = self._lookup(logits, force_argmax)
        signature = plan.rows
        if trace is None or trace.signature != signature:
            trace = self._capture(logits, plan)
            self._traces[key] = trace
        trace.replays += 1
        if trace.graph is None:
            return self.sampler.sample(logits, record=record.to(self.device))
        trace.record.copy_(record, non_blocking=True)
        trace.graph.replay()
        return trace.output

    def _capture(self, logits: torch.Tensor, plan: StepPlan) -> _Trace:
        """A CUDA graph of the step on CUDA (eager when capture fails, off CUDA, or for a step that
        is not capturable, e.g. a split step, which syncs on the host). Capturing runs nothing;
        the warm-up step records no token (its record mask is all False)."""
        self.captures += 1
        trace = _Trace(_tensor_id(logits), plan.rows)
        if self.device.type != "cuda" or not self.sampler.backends.choose(logits, plan).capturable:
            return trace
        record = torch.zeros(logits.shape[0], dtype=torch.bool, device=self.device)
        try:
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.sampler.sample(logits, record=record)  # warm-up, changes no state
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                output = self.sampler.sample(logits, record=record)
        except Exception as error:  # noqa: BLE001 - any capture failure (a host sync, an allocation): run eagerly
            warnings.warn(f"tokensampler: the sampling step could not be captured ({error!r}); running it "
                          "eagerly", RuntimeWarning, stacklevel=3)
            return trace
        trace.graph, trace.record, trace.output = graph, record, output
        return trace

