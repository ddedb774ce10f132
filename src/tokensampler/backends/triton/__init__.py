"""The sampling step as fused Triton kernels for CUDA (three launches, no sort, no host sync),
gated bit for bit against the reference; `config` chooses the backend without importing Triton."""

from .config import (
                     BACKEND_ENV,
                     BACKENDS,
                     MAX_KERNEL_LOGPROBS,
                     KernelConfig,
                     interpreter_enabled,
                     requested_backend,
                     triton_available,
                     use_kernels,
)

__all__ = ["BACKENDS", "BACKEND_ENV", "MAX_KERNEL_LOGPROBS", "KernelConfig", "interpreter_enabled",
           "requested_backend", "triton_available", "use_kernels"]
