"""One `Sampler`-like object per backend, so a test runs the same calls on every path:

- "direct", "block": the CPU torch step (`backend="torch"`) with its direct route allowed / forced
  off (TorchStepConfig);
- "kernels": the Triton step (CPU tensors in Triton's interpreter, CUDA tensors when there is a GPU),
  forced with `Sampler(backend="triton")`, with small blocks;
- "split2", "split3": the vocabulary split over 2 / 3 ranks, one thread per rank (each rank gets its
  logits slice and the whole token bitmask; every rank must return the same output).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

import tests.support.split_cases as dc
from tokensampler import Sampler
from tokensampler.backends.torch_step.config import TorchStepConfig
from tokensampler.backends.triton.config import KernelConfig

BACKENDS = ("direct", "block", "kernels", "split2", "split3")
# small blocks and several splits per row: every multi-block path of the kernels runs
KERNELS = KernelConfig(prepare_block=32, select_block=64, logprobs_block=64, pivots=8, splits=2,
                                     num_warps=4, window_cap=64, window_block=32)


class KernelSampler:
    """A Sampler whose steps run the Triton kernels."""

    def __init__(self, vocab: int, **kw: Any) -> None:
        self.sampler = Sampler(vocab, kernel_config=KERNELS, backend="triton", **kw)

    def sample(self, logits: torch.Tensor, *args: Any, **kw: Any):
        out = self.sampler.sample(logits, *args, **kw)
        return type(out)(out.token_ids.clone(), out.valid.clone(), out.logprobs)  # views of reused buffers

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)


class SplitSamplers:
    """`world` Samplers over one thread exchange; every method runs on every rank at once."""

    def __init__(self, world: int, vocab: int, *, padded_vocab_size: int | None = None, **kw: Any) -> None:
        self.world = world
        self.padded = padded_vocab_size or vocab
        self.hub = dc.ThreadHub(world)
        self.exchanges = [dc.ThreadExchange(self.hub, r) for r in range(world)]
        self.samplers = self._all(lambda r: Sampler(vocab, padded_vocab_size=self.padded, group=self.exchanges[r],
                                                    **kw))

    def _all(self, fn: Callable[[int], Any]) -> list[Any]:
        results: list[Any] = [None] * self.world
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                errors.append(exc)
                self.hub.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def sample(self, logits: torch.Tensor, slots: Any = None, **kw: Any):
        width = self.padded // self.world
        outs = self._all(lambda r: self.samplers[r].sample(logits[:, r * width:(r + 1) * width], slots, **kw))
        for out in outs[1:]:
            assert not dc.compare("split ranks", out, outs[0])
        return outs[0]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("samplers", "hub", "exchanges", "world", "padded"):
            raise AttributeError(name)
        return lambda *a, **k: self._all(lambda r: getattr(self.samplers[r], name)(*a, **k))[0]


def make_sampler(backend: str, vocab: int, **kw: Any) -> Any:
    """A sampler of `backend` (see the module docstring) built with Sampler's keywords."""
    if backend == "direct":
        return Sampler(vocab, step_config=TorchStepConfig(direct_route=True), backend="torch", **kw)
    if backend == "block":
        return Sampler(vocab, step_config=TorchStepConfig(direct_route=False), backend="torch", **kw)
    if backend == "kernels":
        return KernelSampler(vocab, **kw)
    if backend.startswith("split"):
        return SplitSamplers(int(backend[len("split"):]), vocab, **kw)
    raise ValueError(backend)
