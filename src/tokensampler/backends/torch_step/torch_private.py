"""Every use of torch's private or experimental APIs, in one place (the compile cache's needs).

Tested with torch 2.13 (the range pyproject.toml declares). What is used, and why:

- `torch.compile(...).aot_compile`, `save_compiled_function`, `torch.compiler.load_compiled_function`
  (experimental): compile a function ahead of time once per input layout, save it, and load it in a
  later process without tracing (`aot_compile`, `save_artefact`, `load_artefact`).
- `torch._dynamo.decorators.mark_dynamic` / `mark_unbacked`: the row count dynamic, and a
  reduction length unbacked so that inductor keeps a sequential sum (`mark`).
- `torch.fx.experimental._config.backed_size_oblivious`: dynamic sizes not specialised to 0 or 1,
  so that one graph serves every batch size (`size_oblivious`).
- `torch._inductor.cpu_vec_isa.pick_vec_isa`: the vector ISA inductor compiles for (its float32
  lanes must be ATen's for the logprob normaliser's order; `vector_lanes`, read once per process:
  it reads ATEN_CPU_CAPABILITY on every call), and `torch._inductor.config` `cpp.vec_isa_ok`:
  skip inductor's once-per-process ISA probe (child processes, about a second) while loading
  artefacts made on this machine (`vec_isa_assumed_ok`).
- `torch._inductor.runtime.cache_dir_utils.default_cache_dir`: where inductor keeps its cache
  (`inductor_cache_dir`), so the artefacts live beside inductor's own.
- the text "GuardManager check failed" of the RuntimeError a loaded function raises when its
  guards refuse the inputs (`is_guard_refusal`).
- `Tensor._base`: whether a tensor is a view (`is_view`; guards would read a view's base).
- `torch._C._GLIBCXX_USE_CXX11_ABI`: the C++ ABI torch was built with, which the step's C++ passes
  must be compiled with (`cxx11_abi`, `native.py`).

A torch that behaves differently (an attribute missing, one of these raising) does not break a
step: the compile cache runs the function it was preparing eagerly from then on (the same tokens)
and `warn_fallback` emits one `CompileFallbackWarning` per process.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Any, BinaryIO, Callable, Iterator, Sequence

import torch

from ...core.errors import CompileFallbackWarning

_WARNED: list[str] = []  # the first fallback's message (one warning per process)
_LANES: list[int | None] = []  # `vector_lanes`, once per process
_LOCK = threading.Lock()


def warn_fallback(what: str, error: BaseException) -> None:
    """One `CompileFallbackWarning` per process: `what` happens (e.g. "winnable_count runs eagerly")
    because of `error`, raised by torch's internals."""
    with _LOCK:
        if _WARNED:
            return
        _WARNED.append(f"{what} ({type(error).__name__}: {error})"[:500])
    warnings.warn(f"tokensampler's compile cache: {_WARNED[0]}; torch {torch.__version__} does not behave as "
                  "the private torch APIs it uses expect (the tokens are unchanged)",
                  CompileFallbackWarning, stacklevel=3)


def aot_available() -> bool:
    """Whether this torch has ahead-of-time compilation with saved artefacts (else just in time)."""
    return hasattr(torch.compiler, "load_compiled_function")


def aot_compile(fn: Callable, example: tuple) -> Any:
    """`fn` compiled ahead of time (fullgraph, dynamic) for the marked `example` arguments; the
    result is callable and has `save_compiled_function(path)`."""
    return torch.compile(fn, fullgraph=True, dynamic=True).aot_compile((example, {}))


def save_artefact(variant: Any, path: str) -> None:
    """Write an `aot_compile` result to `path`."""
    variant.save_compiled_function(path)


def load_artefact(handle: BinaryIO, f_globals: dict) -> Callable:
    """A function saved by `save_artefact`, loaded from the open file `handle`."""
    return torch.compiler.load_compiled_function(handle, f_globals=f_globals)


def mark(tensors: Sequence[Any], dynamic: Sequence[int], unbacked: Sequence[tuple[int, int]]) -> None:
    """Mark dim 0 of `tensors[i]` dynamic for i in `dynamic` (0-d tensors and non-tensors are
    skipped), and dim d of `tensors[i]` unbacked for (i, d) in `unbacked`."""
    from torch._dynamo.decorators import mark_dynamic, mark_unbacked
    for index in dynamic:
        if isinstance(tensors[index], torch.Tensor) and tensors[index].dim():
            mark_dynamic(tensors[index], 0)
    for index, dim in unbacked:
        mark_unbacked(tensors[index], dim)


def size_oblivious() -> contextlib.AbstractContextManager:
    """While tracing: dynamic sizes backed (inductor schedules with the example's sizes as hints)
    but not specialised to 0 or 1, so that one graph serves every row count (with the row count
    unbacked instead, inductor's loops over a row ran several times slower: the dense route's race
    pass, 8.7 against 0.6 ms on 12 x 151,936). Where torch has no such switch: a no-op and one
    warning (sizes 0 and 1 are then specialised: calls of other sizes may run eagerly, counted as
    guard refusals)."""
    import torch.fx.experimental._config as fx_config
    if not hasattr(fx_config, "backed_size_oblivious"):
        warn_fallback("row counts 0 and 1 are specialised", AttributeError(
            "torch.fx.experimental._config has no attribute 'backed_size_oblivious'"))
        return contextlib.nullcontext()
    return fx_config.patch(backed_size_oblivious=True)


def is_guard_refusal(error: BaseException) -> bool:
    """True when `error` is a loaded function's guards refusing its inputs."""
    return isinstance(error, RuntimeError) and "GuardManager check failed" in str(error)


def inductor_cache_dir() -> str:
    """Inductor's cache directory: TORCHINDUCTOR_CACHE_DIR if set, else inductor's default (read
    only: this changes no environment variable)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()


def _pick_vec_isa() -> Any:
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    return pick_vec_isa()


def vector_lanes() -> int | None:
    """float32 lanes of the vector ISA inductor compiles CPU code for (0: none usable), read once
    per process; None when this torch cannot say (then nothing relies on them)."""
    failed = None
    with _LOCK:
        if not _LANES:
            try:
                isa = _pick_vec_isa()
                _LANES.append(isa.nelements(torch.float32) if isa else 0)
            except Exception as error:  # noqa: BLE001 - a private API: without it, the exact path
                _LANES.append(None)
                failed = error
    if failed is not None:
        warn_fallback("the logprob normaliser runs eagerly", failed)
    return _LANES[0]


def vec_isa_name() -> str:
    """The name of inductor's vector ISA on this machine ("" when there is none)."""
    isa = _pick_vec_isa()
    return str(isa) if isa else ""


@contextlib.contextmanager
def vec_isa_assumed_ok() -> Iterator[None]:
    """While loading artefacts made on this machine: tell inductor its vector ISA is usable, so it
    does not probe it (a build and load of a library in child processes)."""
    import torch._inductor.config as inductor_config
    with inductor_config.patch({"cpp.vec_isa_ok": True}):
        yield


def is_view(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a view of another (True where this torch cannot say: an alias is safe)."""
    return getattr(tensor, "_base", tensor) is not None


def cxx11_abi() -> int:
    """1 if torch's C++ library uses the C++11 ABI of libstdc++ (a library linked to it must too)."""
    return int(torch._C._GLIBCXX_USE_CXX11_ABI)
