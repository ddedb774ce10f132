"""Peak extra host memory of one call, for `tokensampler bench`'s memory column (CPU).

torch's CPU allocator has no peak counter, so the call runs once under `torch.profiler` with
`profile_memory=True`: every op reports the bytes it allocated and kept (self), every free outside
an op is a `[memory]` event; the running sum in time order gives the peak above the memory held
before the call. Transient buffers an op allocates and frees inside itself are not seen (they are
small for the ops a step uses: a sort of a candidate list, a reduction's partials).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null: the profiler's C++ side prints "USDT: ... profiler_start"
    and "profiler_stop" lines straight to it."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated above the starting point while `fn()` runs (its result is dropped
    before the profile ends, so what it returns counts while it is alive)."""
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage != 0),
                    key=lambda e: e.time_range.start)
    running = peak = 0
    for event in events:
        running += event.self_cpu_memory_usage
        peak = max(peak, running)
    return peak


def step_memory_report(step: Callable[[], object], logits: torch.Tensor, vocab: int,
                       held_bytes: Callable[[], int] = lambda: 0) -> dict:
    """{"peak_extra_bytes", "held_bytes", "logits_fp32_bytes", "ratio"}: the step's peak extra
    memory (what it allocates during the call, plus the workspace `held_bytes()` it keeps between
    calls) against one float32 buffer of the logits' real size (batch x vocab x 4 bytes)."""
    step()  # warm: the workspace exists, and is counted through held_bytes
    peak = peak_extra_bytes(step)
    held = held_bytes()
    reference = logits.shape[0] * vocab * 4
    return {"peak_extra_bytes": peak, "held_bytes": held, "logits_fp32_bytes": reference,
            "ratio": (peak + held) / reference}
