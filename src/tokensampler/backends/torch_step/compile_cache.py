"""The compile cache of the torch step: its compiled functions, prepared once per input layout.

Whether a sampler compiles is its own choice, made when it is made (`Sampler(compile=...)`,
default TOKENSAMPLER_COMPILE, `backends.choice`); the step passes it to `maybe_compiled`, so
nothing here reads it. Every private torch API this needs is in `torch_private`.

Compiled: full-row reductions (`row_stats` counts and tail masses, the dense route's threshold
and race passes in `dense`, the logprob normaliser and rank counts in `logprobs`) and the
dense-route noise block (`gumbel.approx_scores`). Each result is either exact (counts, maxima),
a sum of the reference's own values in another order, or carries a proven error bound with an
exact recheck where it could change the answer, so compiled and eager runs give the same tokens
(docs/cpu-fast-path.md).

How a function is compiled (`CompiledFunction`): ahead of time, once per input layout, with
`torch.compile(...).aot_compile`, every size dynamic and none specialised to 0 or 1 (inductor's
backed-size-oblivious mode, the row count marked dynamic), so that one artefact serves every batch
size (0, 1 and 2 included) and a call never traces or recompiles. A layout is torch's thread count
(inductor's CPU loops are built for it) and, per tensor argument, its dtype, whether it is literally
contiguous (else whether its last dim is), and which of its other sizes are 0 or 1 (those are
specialised). Views are passed as plain aliases of their storage, so no guard looks at a view's
base, and a function is compiled on examples at storage offset 0 (`_at_offset_zero`), so that one
variant serves a tensor at any offset. Each artefact is saved under inductor's own cache directory
(`cache_dir()`: TORCHINDUCTOR_CACHE_DIR if the user set it, else inductor's default; tokensampler sets no
environment variable), in a folder keyed by the torch and tokensampler versions, the CPU capability
and the source of the compiled code; a later process loads it without tracing
(`torch.compiler.load_compiled_function`; inductor's once-per-process check of the CPU's vector ISA
is skipped while loading when a compilation on this machine passed it). A call whose inputs fail the
loaded function's guards runs eagerly (same tokens) and is counted in `report()`. Where
ahead-of-time compilation is not available, or TOKENSAMPLER_COMPILE_JIT is set when this module is
imported, the function is compiled just in time. When torch's internals do not behave as expected
(an attribute missing, an internal raising while a function is prepared or run), that function runs
eagerly from then on (same tokens) and one `CompileFallbackWarning` is emitted per process.
`Sampler.warmup` prepares every layout a sampler uses before serving (`warmup.warm`, which records
what it prepared so that the next process only loads).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from . import torch_private

_FUNCTIONS: dict[str, "CompiledFunction"] = {}
_LOCK = threading.RLock()
_SOURCE_KEY: list[str] = []
_JIT = bool(os.environ.get("TOKENSAMPLER_COMPILE_JIT"))  # just-in-time compilation (read once, at import)


def cache_dir() -> str:
    """Where inductor keeps its compiled artefacts (read only: this changes no environment variable)."""
    return torch_private.inductor_cache_dir()


def _source_key() -> str:
    """A digest of what the compiled code depends on: versions, CPU capability, the sources."""
    if not _SOURCE_KEY:
        digest = hashlib.sha256()
        for part in (torch.__version__, sys.version, platform.machine(),
                     torch.backends.cpu.get_cpu_capability()):
            digest.update(str(part).encode())
        package = Path(__file__).resolve().parents[2]
        sources = [*package.joinpath("backends", "torch_step").glob("*.py"), *package.joinpath("core").glob("*.py")]
        for path in sorted(sources):
            digest.update(path.read_bytes())
        _SOURCE_KEY.append(digest.hexdigest()[:20])
    return _SOURCE_KEY[0]


def artefact_dir() -> Path:
    """The folder of this installation's precompiled functions (under `cache_dir()`)."""
    return Path(cache_dir()) / "tokensampler" / _source_key()


def _record_isa() -> None:
    """After a compilation: note that inductor's CPU vector ISA check passed on this machine (the
    artefact folder is keyed by the CPU capability), so that loads skip re-running it."""
    marker = artefact_dir() / "isa-checked"
    if not marker.exists():
        try:
            name = torch_private.vec_isa_name()
        except Exception as error:  # noqa: BLE001 - a private API: loads then probe the ISA themselves
            torch_private.warn_fallback("the vector ISA is not recorded (loads probe it again)", error)
            return
        if name:
            marker.write_text(name)


@contextlib.contextmanager
def _probed_isa():
    """While loading: tell inductor the vector ISA is usable when a compilation on this machine
    found it so (`_record_isa`). Inductor otherwise checks it once per process by building and
    loading a probe library in child processes, about a second on a 2-core machine."""
    if not (artefact_dir() / "isa-checked").exists():
        yield
        return
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(torch_private.vec_isa_assumed_ok())
        except Exception as error:  # noqa: BLE001 - a private API: the load probes the ISA itself
            torch_private.warn_fallback("loads probe the vector ISA again", error)
        yield


def _plain(value: Any) -> Any:
    """A view as an alias of its storage with no base (guards then never read a base's sizes), the
    stride of a dim of size 0 or 1 (never used to address an element) set to the contiguous one, and
    an inference tensor (made under `torch.inference_mode`, as vLLM samples) as an ordinary alias (the
    guards check a tensor's dispatch keys). Called outside inference mode."""
    if not isinstance(value, torch.Tensor):
        return value
    strides, stride = list(value.stride()), 1
    for dim in range(value.dim() - 1, -1, -1):
        if value.shape[dim] <= 1:
            strides[dim] = stride
        stride *= max(value.shape[dim], 1)
    if not torch_private.is_view(value) and strides == list(value.stride()) and not value.is_inference():
        return value
    return value.new_empty(0).set_(value.untyped_storage(), value.storage_offset(), value.size(), strides)


def _at_offset_zero(value: Any) -> Any:
    """A tensor argument as a compilation example: itself at storage offset 0, else a copy with its
    sizes and strides at offset 0. A variant traced at offset 0 serves every offset (the call
    passes the data pointer; `test_warmup` checks it), but one traced on a row view such as
    `logits[1:2]` keeps the offset as a guarded symbol (`2 <= storage_offset`) and would refuse
    every tensor at offset 0, which would then run eagerly."""
    if not isinstance(value, torch.Tensor) or value.storage_offset() == 0:
        return value
    return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device).copy_(value)


def _layout(args: Sequence[Any], rows: Sequence[int]) -> tuple:
    """What selects a compiled variant: torch's intra-op thread count (inductor builds its loops for
    it, and a loaded artefact's guards refuse another), then per tensor, dtype, literal contiguity
    (or contiguous last dim, or neither), sizes 0/1 off the row dim."""
    key: list[Any] = [("threads", torch.get_num_threads())]
    for index, value in enumerate(args):
        if not isinstance(value, torch.Tensor):
            key.append(("value", type(value).__name__))
            continue
        expected, stride = [], 1
        for size in reversed(value.shape):
            expected.append(stride)
            stride *= size
        contiguous = ("contiguous" if tuple(value.stride()) == tuple(reversed(expected))
                      else "rows" if value.dim() and value.stride(-1) == 1 else "strided")
        small = tuple(min(size, 2) if dim or index not in rows else -1 for dim, size in enumerate(value.shape))
        key.append((str(value.dtype), contiguous, small))
    return tuple(key)


def _aot_available() -> bool:
    return torch_private.aot_available() and not _JIT


class CompiledFunction:
    """`fn` compiled per input layout (see the module docstring); called like `fn`.

    rows: the positions of the tensor arguments whose dim 0 is the row count (marked dynamic);
    unbacked: further (position, dim) pairs to mark unbacked (e.g. a reduction that must keep its
    sequential order)."""

    def __init__(self, name: str, fn: Callable, rows: Sequence[int] | None, unbacked: Sequence[tuple[int, int]]):
        self.name, self.fn = name, fn
        self.rows, self.unbacked = rows, tuple(unbacked)
        self._layouts: dict[str, tuple] = {}
        self.refusals: list[str] = []  # the first guard refusals (report)
        self.variants: dict[tuple, Callable] = {}
        self.files: dict[tuple, Path] = {}  # layout -> its artefact on disk (`save_manifest`)
        self.stats = {"loaded": 0, "compiled": 0, "fallbacks": 0, "seconds": 0.0}
        self.calls: dict[tuple, int] = {}  # layout -> calls of its variant (a first call costs more)
        self.eager: str | None = None  # why this function runs eagerly from now on (torch's internals failed)

    def __call__(self, *args: Any) -> Any:
        if self.eager is not None:
            return self.fn(*args)
        if torch.is_inference_mode_enabled():  # the artefacts are made and guarded outside it
            with torch.inference_mode(False):
                return self(*args)
        if torch.is_grad_enabled():  # ... and without autograd
            with torch.no_grad():
                return self(*args)
        args = tuple(_plain(a) for a in args)
        rows = range(len(args)) if self.rows is None else self.rows
        layout = _layout(args, rows)
        variant = self.variants.get(layout)
        if variant is None:
            with _LOCK:
                if layout not in self.variants:
                    try:
                        return self._prepare(layout, args, rows)
                    except Exception as error:  # noqa: BLE001 - torch's internals: eager from now on
                        return self._run_eagerly(error, args)
                variant = self.variants[layout]
        self._count_call(layout)
        try:
            return variant(*args)
        except Exception as error:  # noqa: BLE001 - a guard refusal (eager this call), or torch's internals
            if not torch_private.is_guard_refusal(error):
                return self._run_eagerly(error, args)
            self.stats["fallbacks"] += 1  # inputs this variant's guards do not cover: eager, same tokens
            if len(self.refusals) < 3:
                self.refusals.append(f"{layout!r}: {error}"[:2000])
            return self.fn(*args)

    def _run_eagerly(self, error: Exception, args: tuple) -> Any:
        """`fn` on `args`, and eagerly from now on: preparing or running a compiled variant raised
        `error` (torch's internals differ from what `torch_private` expects); one warning per process."""
        self.eager = f"{type(error).__name__}: {error}"[:2000]
        torch_private.warn_fallback(f"{self.name} runs eagerly", error)
        return self.fn(*args)

    def _path(self, layout: tuple) -> Path:
        path = artefact_dir() / f"{self.name}-{hashlib.sha256(repr(layout).encode()).hexdigest()[:16]}.bin"
        self._layouts[path.name] = layout
        return path

    def _layout_of(self, path: Path) -> tuple:
        return self._layouts[path.name]

    def preload(self, layout: tuple) -> bool:
        """Load the artefact of `layout` (no call: a refusal later runs eagerly). False if absent."""
        if layout in self.variants:
            return True
        with _LOCK:
            start = time.perf_counter()
            variant = self._load(self._path(layout))
            if variant is None:
                return False
            self.files[layout] = self._path(layout)
            self._keep(layout, variant, start, called=False)
            return True

    def _prepare(self, layout: tuple, args: tuple, rows: Sequence[int]) -> Any:
        """Load (or compile and save) the variant of `layout`, keep it, and return its result on `args`.
        A loaded artefact that refuses the inputs it was made for is compiled again."""
        start = time.perf_counter()
        if not _aot_available():
            variant = self._jit(rows)
        else:
            path = self._path(layout)
            variant = self._load(path)
            if variant is not None:
                self.files[layout] = path
                try:
                    result = variant(*args)
                except RuntimeError as error:
                    if not torch_private.is_guard_refusal(error):
                        raise
                    variant = None
                else:
                    self._keep(layout, variant, start)
                    return result
            if variant is None:
                variant = self._compile(path, args, rows)
        result = variant(*args)
        self._keep(layout, variant, start)
        return result

    def _keep(self, layout: tuple, variant: Callable, start: float, called: bool = True) -> None:
        self.stats["seconds"] += time.perf_counter() - start
        self.variants[layout] = variant
        if called:
            self._count_call(layout)

    def _count_call(self, layout: tuple) -> None:
        self.calls[layout] = self.calls.get(layout, 0) + 1

    def uncalled(self) -> list[tuple]:
        """The layouts of the variants held but not run yet."""
        return [layout for layout in self.variants if not self.calls.get(layout)]

    def _load(self, path: Path) -> Callable | None:
        if not path.is_file():
            return None
        try:
            with path.open("rb") as handle, _probed_isa():
                variant = torch_private.load_artefact(handle, self.fn.__globals__)
        except Exception:  # noqa: BLE001 - a stale or partly written artefact: compile it again
            return None
        self.stats["loaded"] += 1
        return variant

    def _compile(self, path: Path, args: tuple, rows: Sequence[int]) -> Callable:
        example = self._marked(tuple(_at_offset_zero(a) for a in args), rows)
        with torch_private.size_oblivious():
            variant = torch_private.aot_compile(self.fn, example)
        self.stats["compiled"] += 1
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.part")
            torch_private.save_artefact(variant, str(partial))
            os.replace(partial, path)
            self.files[self._layout_of(path)] = path
            _record_isa()
        except OSError:  # an unwritable cache: this process keeps its compiled function
            pass
        return variant

    def _marked(self, args: tuple, rows: Sequence[int]) -> tuple:
        """Fresh aliases of the tensor arguments with the row dims marked dynamic and `unbacked`
        marked unbacked (the marks stay off the caller's tensors)."""
        marked = tuple(a.new_empty(0).set_(a.untyped_storage(), a.storage_offset(), a.size(), a.stride())
                       if isinstance(a, torch.Tensor) else a for a in args)
        torch_private.mark(marked, rows, self.unbacked)
        return marked

    def _jit(self, rows: Sequence[int]) -> Callable:
        inner = torch.compile(self.fn, dynamic=True, fullgraph=True)
        self.stats["compiled"] += 1

        def call(*args: Any) -> Any:
            with _LOCK, torch_private.size_oblivious():  # dynamo may trace inside the call
                return inner(*self._marked(args, rows))
        return call


def register(name: str, fn: Callable, rows: Sequence[int] | None = None,
             unbacked: Sequence[tuple[int, int]] = ()) -> None:
    """Declare a compiled function at import (so that warm-up can load its artefacts by name).

    rows: positions of the arguments whose dim 0 is the row count (default: every tensor's)."""
    with _LOCK:
        _FUNCTIONS.setdefault(name, CompiledFunction(name, fn, rows, unbacked))


def maybe_compiled(name: str, fn: Callable, compiled: bool) -> Callable:
    """The registered `CompiledFunction` of `name` (registered now if it is not) when `compiled`
    (the sampler's choice), else `fn`."""
    if not compiled:
        return fn
    compiled = _FUNCTIONS.get(name)
    if compiled is None:
        register(name, fn)
        compiled = _FUNCTIONS[name]
    return compiled


def runs_eagerly(name: str) -> bool:
    """Whether the compiled function `name` fell back to eager for good (torch's internals failed)."""
    function = _FUNCTIONS.get(name)
    return function is not None and function.eager is not None


def _manifest(signature: str) -> Path:
    return artefact_dir() / f"warm-{hashlib.sha256(signature.encode()).hexdigest()[:16]}.json"


def call_counts() -> dict[str, dict[tuple, int]]:
    """Per compiled function, the calls of each variant so far (`save_manifest`'s `since`)."""
    return {name: dict(f.calls) for name, f in _FUNCTIONS.items()}


def save_manifest(signature: str, since: dict[str, dict[tuple, int]]) -> None:
    """Record which artefacts a warm-up with this `signature` used (`preload_manifest`): the variants
    called since `call_counts()` returned `since`. An artefact this process holds from another cache
    directory (the user changed TORCHINDUCTOR_CACHE_DIR since) is copied into the current one first,
    so the record is complete."""
    entries = []
    for name, function in sorted(_FUNCTIONS.items()):
        before = since.get(name, {})
        for layout, source in sorted(function.files.items(), key=lambda item: repr(item[0])):
            if function.calls.get(layout, 0) <= before.get(layout, 0):
                continue  # this process's, not the warm-up's (another sampler's, a test's)
            target = function._path(layout)
            if source != target and not target.is_file():
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    partial = target.with_suffix(f".{os.getpid()}.{threading.get_ident()}.part")
                    shutil.copyfile(source, partial)
                    os.replace(partial, target)
                except OSError:
                    continue
            entries.append([name, repr(layout)])
    path = _manifest(signature)
    try:
        partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.part")
        partial.write_text(json.dumps(entries))
        os.replace(partial, path)
    except OSError:
        pass


def preload_manifest(signature: str) -> bool:
    """Load every artefact a previous warm-up with this `signature` recorded. False (having loaded
    what it could) when there is no record or an artefact is missing or unreadable."""
    if not _aot_available():
        return False
    try:
        entries = json.loads(_manifest(signature).read_text())
    except (OSError, ValueError):
        return False
    complete = True
    for name, layout in entries:
        function = _FUNCTIONS.get(name)
        if function is None:  # registered at run time by the recording process only (not the step's)
            continue
        complete &= function.preload(ast.literal_eval(layout))
    return complete


def prepared() -> int:
    """How many variants this process has compiled or loaded so far (warm-up is complete when
    serving leaves this unchanged)."""
    return sum(f.stats["loaded"] + f.stats["compiled"] for f in _FUNCTIONS.values())


def uncalled() -> list[str]:
    """"name layout" of every variant loaded but not run yet (its first call, a few ms more than
    later ones, is still ahead)."""
    return [f"{name} {layout!r}" for name, f in sorted(_FUNCTIONS.items()) for layout in f.uncalled()]


def layouts() -> list[str]:
    """"name layout" of every variant this process holds (what a warm-up prepared, for reports)."""
    return [f"{name} {layout!r}" for name, f in sorted(_FUNCTIONS.items()) for layout in f.variants]


def report() -> dict:
    """What the bench records: where the artefacts live, and per compiled function its variants,
    loads, compilations, eager fallbacks (guard refusals), seconds spent preparing, and why it runs
    eagerly if torch's internals failed."""
    functions = {name: {"variants": len(f.variants),
                        "uncalled": len(f.uncalled()), **f.stats,
                        **({"refusals": f.refusals} if f.refusals else {}),
                        **({"eager": f.eager} if f.eager else {})}
                 for name, f in _FUNCTIONS.items()}
    try:
        where = cache_dir()
    except Exception as error:  # noqa: BLE001 - a private API
        where = f"unknown ({type(error).__name__})"
    return {"cache_dir": where, "ahead_of_time": _aot_available() if _FUNCTIONS else None,
            "functions": functions,
            "first_call_seconds": {name: f["seconds"] for name, f in functions.items()}}
