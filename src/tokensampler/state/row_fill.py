"""`fill_rows`: whole rows of a per-slot tensor set to one value (clearing the history rows of the
slots an admission replaces), as contiguous blocks where the slots run consecutively."""

from __future__ import annotations

import contextlib

import torch

from ..core.threads import caller_threads

MAX_FILL_RUNS = 16  # more runs than this: one index fill
THREADED_FILL_BYTES = 2**25  # from 32 MiB, on the caller's threads


def consecutive_runs(slots: list[int]) -> list[tuple[int, int]]:
    """[start, stop) of each run of consecutive values in `slots`, in order ([3, 4, 5, 9] -> [(3, 6), (9, 10)])."""
    runs: list[tuple[int, int]] = []
    for slot in slots:
        if runs and runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], slot + 1)
        else:
            runs.append((slot, slot + 1))
    return runs


def fill_rows(tensor: torch.Tensor, slots: torch.Tensor, value: bool | int) -> None:
    """Rows `slots` (int64 [n]) of `tensor` set to `value`. On the CPU a few runs of consecutive
    slots (an admitted burst fills the free slots in order) are filled as contiguous blocks: an index
    fill of many rows takes several times as long as a fill of the same bytes. Inside
    `single_threaded` (an admission) a fill of at least `THREADED_FILL_BYTES` runs on the caller's
    threads (a smaller one gains less from them than it loses waiting for a thread that lost its core)."""
    large = slots.numel() * tensor[0].numel() * tensor.element_size() >= THREADED_FILL_BYTES
    with caller_threads() if large else contextlib.nullcontext():  # memory-bound: the caller's threads
        if tensor.device.type == "cpu":
            runs = consecutive_runs(slots.tolist())
            if len(runs) <= MAX_FILL_RUNS:
                for start, stop in runs:
                    tensor[start:stop].fill_(value)
                return
        tensor.index_fill_(0, slots, value)
