"""Triton kernels for the sampling step, and the choice of backend for a step.

`use_kernels` decides, without importing Triton, whether `Sampler.sample` runs the fused Triton
step (`kernels.launcher.KernelStep`) or the torch step: Triton for CUDA logits when Triton is
importable, unless `TOKENSAMPLER_BACKEND=torch`; `TOKENSAMPLER_BACKEND=triton` forces the kernels,
which on CPU tensors needs `TRITON_INTERPRET=1` (how the tests run them without a GPU).
The kernels return logprobs for N <= 20; a step whose batch asks more runs the torch step.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ..params import InvalidSamplingParams

BACKEND_ENV = "TOKENSAMPLER_BACKEND"
BACKENDS = ("auto", "torch", "triton")
MAX_KERNEL_LOGPROBS = 20

_triton_found: bool | None = None


def triton_available() -> bool:
    """True when the `triton` package can be imported (checked once, without importing it)."""
    global _triton_found
    if _triton_found is None:
        _triton_found = importlib.util.find_spec("triton") is not None
    return _triton_found


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def requested_backend() -> str:
    """The backend named by TOKENSAMPLER_BACKEND ("auto" when unset or empty)."""
    name = os.environ.get(BACKEND_ENV, "").strip().lower() or "auto"
    if name not in BACKENDS:
        raise InvalidSamplingParams(BACKEND_ENV, name, f"one of {BACKENDS}")
    return name


def use_kernels(logits: torch.Tensor, logprobs_width: int) -> bool:
    """Whether a step on `logits` whose widest logprobs request is `logprobs_width` runs the kernels."""
    backend = requested_backend()
    if backend == "torch" or logprobs_width > MAX_KERNEL_LOGPROBS:
        return False
    if backend == "auto":
        return logits.is_cuda and triton_available()
    if not triton_available() or not (logits.is_cuda or interpreter_enabled()):
        raise InvalidSamplingParams(BACKEND_ENV, backend, "triton only with Triton installed and CUDA logits "
                                    "(CPU logits need TRITON_INTERPRET=1)")
    return True
