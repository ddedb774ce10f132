"""One `Sampler`-like object per backend, so a test runs the same calls on every path:

- "direct", "block": the CPU torch step (`backend="torch"`) with its direct route allowed / forced
  off (TorchStepConfig); "torch": the torch step with a given TorchStepConfig;
- "kernels": the Triton step (CPU tensors in Triton's interpreter, CUDA tensors when there is a GPU),
  forced with `Sampler(backend="triton")`, with small blocks (or a given KernelConfig);
- "split2", "split3": the vocabulary split over 2 / 3 ranks, one thread per rank (each rank gets its
  logits slice and the whole token bitmask; every rank must return the same output).

The adversarial campaign (tests/support/adversarial/) builds its samplers here too.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

import tests.support.split_cases as dc
from tokensampler import Sampler, SamplerOutput
from tokensampler.backends.torch_step.config import TorchStepConfig
from tokensampler.backends.triton.config import KernelConfig
from tokensampler.core.output import LogprobsOutput

BACKENDS = ("direct", "block", "kernels", "split2", "split3")
# small blocks and several splits per row: every multi-block path of the kernels runs
KERNELS = KernelConfig(prepare_block=32, select_block=64, logprobs_block=64, pivots=8, splits=2,
                                     num_warps=4, window_cap=64, window_block=32)


class RanksDisagree(AssertionError):
    """The ranks of a split returned different outputs or outcomes."""


def copy_output(out: SamplerOutput) -> SamplerOutput:
    """A copy of `out` that the sampler's next call cannot change (the kernels return views of buffers they reuse)."""
    lp = out.logprobs
    if lp is not None:
        lp = LogprobsOutput(*(t.clone() for t in (lp.token_logprobs, lp.token_ranks, lp.top_token_ids,
                                                  lp.top_logprobs)))
    return SamplerOutput(out.token_ids.clone(), out.valid.clone(), lp)


class KernelSampler:
    """A Sampler whose steps run the Triton kernels."""

    def __init__(self, vocab: int, kernel_config: KernelConfig = KERNELS, **kw: Any) -> None:
        self.sampler = Sampler(vocab, kernel_config=kernel_config, backend="triton", **kw)

    def sample(self, logits: torch.Tensor, *args: Any, **kw: Any) -> SamplerOutput:
        return copy_output(self.sampler.sample(logits, *args, **kw))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)


class SplitSamplers:
    """`world` Samplers over one thread exchange; every method runs on every rank at once."""

    def __init__(self, world: int, vocab: int, *, padded_vocab_size: int | None = None, **kw: Any) -> None:
        self.world = world
        self.padded = padded_vocab_size or vocab
        self.hub = dc.ThreadHub(world)
        self.exchanges = [dc.ThreadExchange(self.hub, r) for r in range(world)]
        self.samplers = dc.run_ranks(self.hub, lambda r: Sampler(vocab, padded_vocab_size=self.padded,
                                                                 group=self.exchanges[r], **kw))

    def on_ranks(self, fn: Callable[[Sampler], Any]) -> list[Any]:
        """fn(sampler) for every rank's sampler at once (one thread per rank); each rank's result."""
        return dc.run_ranks(self.hub, lambda r: fn(self.samplers[r]))

    def sample(self, logits: torch.Tensor, slots: Any = None, **kw: Any) -> SamplerOutput:
        """Each rank samples its slice of `logits` [B, padded]; rank 0's output, once every rank's equals it."""
        width = self.padded // self.world
        outs = dc.run_ranks(self.hub, lambda r: self.samplers[r].sample(logits[:, r * width:(r + 1) * width], slots,
                                                                         **kw))
        for rank, out in enumerate(outs[1:], 1):
            bad = dc.compare(f"rank {rank} vs rank 0", out, outs[0])
            if bad:
                raise RanksDisagree("; ".join(bad))
        return outs[0]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("samplers", "hub", "exchanges", "world", "padded"):
            raise AttributeError(name)
        return lambda *a, **k: self.on_ranks(lambda sampler: getattr(sampler, name)(*a, **k))[0]


def on_every_rank(sampler: Any, fn: Callable[[Any], Any]) -> list[Any]:
    """fn on each rank's sampler of a `make_sampler` result at once: one result per rank (one for an unsplit one)."""
    return sampler.on_ranks(fn) if isinstance(sampler, SplitSamplers) else [fn(sampler)]


def make_sampler(backend: str, vocab: int, *, step_config: TorchStepConfig | None = None,
                 kernel_config: KernelConfig = KERNELS, **kw: Any) -> Any:
    """A sampler of `backend` (see the module docstring) built with Sampler's keywords; `step_config`
    is the "torch" backend's, `kernel_config` the "kernels" backend's."""
    if backend in ("direct", "block"):
        return Sampler(vocab, step_config=TorchStepConfig(direct_route=backend == "direct"), backend="torch", **kw)
    if backend == "torch":
        return Sampler(vocab, step_config=step_config, backend="torch", **kw)
    if backend == "kernels":
        return KernelSampler(vocab, kernel_config, **kw)
    if backend.startswith("split"):
        return SplitSamplers(int(backend[len("split"):]), vocab, **kw)
    raise ValueError(backend)
