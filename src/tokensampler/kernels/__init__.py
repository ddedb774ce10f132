"""Old import path of the Triton backend, `tokensampler.backends.triton` (re-exported here)."""

from ..backends.triton.config import (BACKEND_ENV, BACKENDS, MAX_KERNEL_LOGPROBS, KernelConfig, interpreter_enabled,
                                      requested_backend, triton_available, use_kernels)

__all__ = ["BACKENDS", "BACKEND_ENV", "MAX_KERNEL_LOGPROBS", "KernelConfig", "interpreter_enabled",
           "requested_backend", "triton_available", "use_kernels"]
