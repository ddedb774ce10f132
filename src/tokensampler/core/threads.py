"""Torch's intra-op thread count around host bookkeeping: one thread for many small operations,
the caller's threads again for a large memory-bound one inside them.

Admitting a burst of requests is many small tensor operations (index writes, compactions) and a
few fills of whole history rows. Each operation torch runs on its thread pool is a parallel region
that ends when its slowest thread does: when another process holds one of the cores, a region
waits for the thread that lost its core, and a burst of small regions takes several times as long.
`single_threaded` runs such a block on one thread; `caller_threads` gives a large fill inside it
the caller's threads back (a few regions, each long enough to be worth them). Where the process
has replaced `torch.set_num_threads` (vLLM's CPU worker makes it a no-op that warns: its threads
are bound to cores), both leave the thread count alone (`thread_count_owned`). Measured on the
2-core machine, 1,024 admissions (V = 32,000), quiet / beside one busy process: all on two threads
31 / 45-146 ms; all on one 41 / 41-44 ms; one thread with the fills on two 31 / 49-56 ms.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

# torch's count is the calling thread's (OpenMP's nthreads-var is per thread): each Python thread
# keeps its own stack of the counts its `single_threaded` blocks replaced, innermost last
_local = threading.local()


def _replaced() -> list[int]:
    if not hasattr(_local, "replaced"):
        _local.replaced = []
    return _local.replaced


def thread_count_owned() -> bool:
    """Whether this process lets a library change torch's thread count: `torch.set_num_threads` is
    still torch's own (`torch._C.set_num_threads`), not an engine's replacement."""
    return torch.set_num_threads is getattr(torch._C, "set_num_threads", None)


def _set_threads(threads: int) -> None:
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run the block with `torch.set_num_threads(1)`, then restore the caller's thread count (where
    `thread_count_owned()`; else the block runs on the threads it has).

    With torch's OpenMP build the count is the calling thread's: another Python thread's torch
    operations keep theirs (on another build the setting may be the process's). Example::

        with single_threaded():
            generator.apply_prefill_state(...)   # its row fills: `caller_threads`
    """
    if not thread_count_owned():
        yield
        return
    threads = torch.get_num_threads()
    _replaced().append(threads)
    _set_threads(1)
    try:
        yield
    finally:
        _replaced().pop()
        _set_threads(threads)


@contextlib.contextmanager
def caller_threads() -> Iterator[None]:
    """Inside `single_threaded`, the thread count it replaced, for one large operation (outside
    it: no change)."""
    replaced = _replaced()
    if not replaced:
        yield
        return
    inner = torch.get_num_threads()
    _set_threads(replaced[-1])
    try:
        yield
    finally:
        _set_threads(inner)
