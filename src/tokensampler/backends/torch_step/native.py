"""The step's C++ passes (`native_gather.cpp`): the candidate list, the dense route's top-p bracket,
the ids a penalised slot has seen and a token bitmask, each in one pass over the rows.

`select.gather_candidates` lists every id at or above a row's floor. In torch operations that is a
compare writing a bool mask of the rows' size, two compactions and the placement arithmetic: six
parallel regions and a full extra write. The C++ pass reads each row once, compares 32 values at a
time (AVX2) and writes only the hits, on torch's own thread pool (one region). Its result is the same
tensors, bit for bit: the same float32 compare (NaN false) and the same float32 division. The dense
route's bracket (`dense._extract`: the values between two thresholds) is the same kind of pass.
Likewise
`penalties.penalty_edits` lists the ids each penalised slot has seen (prompt mask or output count):
in torch, a bool copy of every slot's counts, an or, and a compaction; in C++, one pass over the two
rows per slot. And `masking.remove_by_bitmask` applies a token bitmask: in torch, a table lookup of
every byte into a buffer and a minimum; in C++, each word read once, words of ones skipped.

Both files share their rows between threads through `native_rows.h`: the calling thread and
helper threads of the library's own, which sleep between calls and are never waited for (a row a
late helper holds is computed by the caller), or torch's threads in one parallel region.

The library is built the first time a compiling sampler needs it (`Sampler(compile=True)`, the
default: a C++ compiler is inductor's requirement too), with `CXX` (else `c++`, else `g++`) against
torch's headers and libraries, into inductor's cache directory in a folder keyed
by the torch version, the CPU capability and the source, then loaded with `torch.ops.load_library`;
a later process only loads it (about 8 s to build on the 2-core machine, once). Where it cannot be
built or loaded (no compiler, not Linux, an error), `gather_op()`, `range_op()`, `seen_op()` and `bitmask_op()`
return None, one `CompileFallbackWarning` says why, and the torch operations run instead (same
tokens). An eager sampler (`compile=False`) never uses it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from ...core.errors import CompileFallbackWarning
from . import torch_private

SOURCES = (Path(__file__).with_name("native_gather.cpp"), Path(__file__).with_name("native_sample.cpp"))
HEADERS = (Path(__file__).with_name("native_rows.h"),)  # included by the sources: part of the cache key
LIBRARY = "tokensampler_native"
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}  # "ops": the loaded library's namespace, or None


def _flags() -> list[str]:
    """Compiler flags: optimised, no fast-math and no contraction into fused multiply-adds (each
    division, product and compare stays one IEEE operation, as torch's), torch's ABI,
    OpenMP (at::parallel_for's region; it resolves to the libgomp torch already loaded), AVX2 where
    torch's own kernels use it."""
    from torch.utils import cpp_extension

    flags = ["-O3", "-ffp-contract=off", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={torch_private.cxx11_abi()}"]
    if platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags.append("-mavx2")
    for path in cpp_extension.include_paths():
        flags += ["-I", path]
    for path in cpp_extension.library_paths():
        flags += ["-L", path, f"-Wl,-rpath,{path}"]
    return flags


def library_path() -> Path:
    """Where the built library is kept: keyed by torch, the platform, the flags and the source."""
    from .compile_cache import cache_dir

    digest = hashlib.sha256()
    for part in (torch.__version__, platform.machine(), torch.backends.cpu.get_cpu_capability(),
                 " ".join(_flags()), *(source.read_bytes() for source in (*SOURCES, *HEADERS))):
        digest.update(part if isinstance(part, bytes) else str(part).encode())
    return Path(cache_dir()) / "tokensampler_native" / digest.hexdigest()[:20] / "tokensampler_native.so"


def build(target: Path) -> None:
    """Compile the source into `target` (built in a temporary folder beside it, then renamed: a
    concurrent process never loads a half-written file). Raises on failure."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (CXX, c++ or g++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *map(str, SOURCES), "-o", str(built), *_flags(), "-lc10", "-ltorch_cpu", "-ltorch"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)


def rows_layout(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """A CPU tensor of `dtype` whose rows are contiguous (2-D, last stride 1): what the passes read."""
    return tensor.device.type == "cpu" and tensor.dtype == dtype and tensor.dim() == 2 and tensor.stride(1) == 1


def vector_layout(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """A contiguous 1-D CPU tensor of `dtype` (a per-row value the passes read)."""
    return tensor.device.type == "cpu" and tensor.dtype == dtype and tensor.dim() == 1 and tensor.is_contiguous()


def gather_op() -> Callable | None:
    """`torch.ops.tokensampler_native.gather_at_or_above`, built or loaded on first use; None where it
    cannot be (then one `CompileFallbackWarning`, and the caller runs torch's operations)."""
    ops = _library()
    return None if ops is None else ops.gather_at_or_above


def range_op() -> Callable | None:
    """`torch.ops.tokensampler_native.gather_in_range` (the dense route's top-p bracket), as `gather_op`."""
    ops = _library()
    return None if ops is None else ops.gather_in_range


def seen_op() -> Callable | None:
    """`torch.ops.tokensampler_native.seen_ids` (the ids each penalised slot has seen), as `gather_op`."""
    ops = _library()
    return None if ops is None else ops.seen_ids


def penalty_op() -> Callable | None:
    """`torch.ops.tokensampler_native.penalty_cells` (step 5 at the seen ids), as `gather_op`."""
    ops = _library()
    return None if ops is None else ops.penalty_cells


def bitmask_op() -> Callable | None:
    """`torch.ops.tokensampler_native.remove_by_bitmask` (a token bitmask applied in place), as `gather_op`."""
    ops = _library()
    return None if ops is None else ops.remove_by_bitmask


def sample_op() -> Callable | None:
    """`torch.ops.tokensampler_native.sample_rows` (steps 6-11 for whole rows: `fused`), as `gather_op`."""
    ops = _library()
    return None if ops is None else ops.sample_rows


def _library() -> Any:
    if "ops" in _STATE:
        return _STATE["ops"]
    with _LOCK:
        if "ops" not in _STATE:
            _STATE["ops"] = _load()
    return _STATE["ops"]


def _load() -> Any:
    if platform.system() != "Linux":
        return None  # built and tested on Linux only
    try:
        if not hasattr(getattr(torch.ops, LIBRARY), "sample_rows"):
            target = library_path()
            if not target.exists():
                build(target)
            torch.ops.load_library(str(target))
        return getattr(torch.ops, LIBRARY)
    except Exception as error:  # noqa: BLE001 - any failure: the torch operations run instead
        warnings.warn(f"tokensampler's C++ candidate pass is not available ({error}); the step uses torch "
                      "operations instead (same tokens)", CompileFallbackWarning, stacklevel=4)
        return None
