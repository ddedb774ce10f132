"""The sampling step as fused Triton kernels for CUDA (three launches, no sort, no host sync),
gated bit for bit against the reference; `config` holds their tunables without importing Triton
(which step runs is `backends.choice`)."""

from .config import MAX_KERNEL_LOGPROBS, KernelConfig, triton_available

__all__ = ["MAX_KERNEL_LOGPROBS", "KernelConfig", "triton_available"]
