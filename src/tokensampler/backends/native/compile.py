"""torch.compile switch of the CPU fast path: `TOKENSAMPLER_COMPILE=0` keeps everything eager.

Compiled: full-row reductions (`row_stats` counts and tail masses, the dense route's threshold
and race passes in `dense`, the logprob normaliser and rank counts in `logprobs`) and the
dense-route noise block (`gumbel.approx_scores`). Each result is either exact (counts, maxima),
a sum of the reference's own values in another order, or carries a proven error bound with an
exact recheck where it could change the answer, so compiled and eager runs give the same tokens
(docs/cpu-fast-path.md). Inductor's FX graph cache keeps the compiled artefacts across processes
(TORCHINDUCTOR_CACHE_DIR, default under ~/.cache/tokensampler).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

_COMPILED: dict[str, Callable] = {}
_COMPILE_SECONDS: dict[str, float] = {}
_LOCK = threading.RLock()


def enabled() -> bool:
    """True unless TOKENSAMPLER_COMPILE is 0/false/no/off."""
    return os.environ.get("TOKENSAMPLER_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> str:
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                                 os.path.join(os.path.expanduser("~"), ".cache", "tokensampler", "inductor"))


def maybe_compiled(name: str, fn: Callable) -> Callable:
    """`fn` compiled by inductor (dynamic shapes, cached per process and on disk) when enabled.

    Calls are serialised by one process-wide lock, a precaution: dynamo traces and compiles (and
    recompiles for a new shape) inside the call, and the samplers of a thread-per-rank vocabulary
    split run in one process."""
    if not enabled():
        return fn
    with _LOCK:
        compiled = _COMPILED.get(name)
        if compiled is None:
            import torch
            cache_dir()
            inner = torch.compile(fn, dynamic=True, fullgraph=True)

            def compiled(*args, _inner=inner):
                with _LOCK:
                    if name not in _COMPILE_SECONDS:
                        start = time.perf_counter()
                        result = _inner(*args)
                        _COMPILE_SECONDS[name] = time.perf_counter() - start  # the first call
                        return result
                    return _inner(*args)

            _COMPILED[name] = compiled
    return compiled


def report() -> dict:
    """What the bench records: whether compile was on, where its cache lives, the wall time of each
    compiled function's first call (compile or cache load included) and dynamo's compile seconds."""
    out = {"enabled": enabled(), "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
           "first_call_seconds": dict(_COMPILE_SECONDS)}
    if _COMPILED:
        try:
            from torch._dynamo.utils import compile_times
            out["dynamo_compile_times"] = compile_times(repr="str")
        except Exception:  # noqa: BLE001 - a private API: report what exists
            pass
    return out
