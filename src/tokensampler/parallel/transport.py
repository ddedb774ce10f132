"""The one collective a vocabulary split needs: `Exchange` (an all-gather of a small tensor, with byte
counters), `TorchExchange`, its form over a torch.distributed process group, and `ThreadExchange`,
its form between the threads of one process (a rank per thread: tests, benchmarks, demos)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from ..core.errors import InvalidEnvironment


class Exchange:
    """The one collective a split step needs (all-gather of a small tensor), with byte counters.

    `bytes_sent` counts what this rank contributes, `bytes_received` what it gets from the others
    (payload only, no transport overhead); `calls` counts collectives.
    """

    rank: int = 0
    world_size: int = 1

    def __init__(self) -> None:
        self.reset_counters()

    def reset_counters(self) -> None:
        self.calls = 0
        self.bytes_sent = 0
        self.bytes_received = 0

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[*shape] on every rank -> [world_size, *shape], rank order, identical on every rank."""
        nbytes = tensor.numel() * tensor.element_size()
        self.calls += 1
        self.bytes_sent += nbytes
        self.bytes_received += nbytes * (self.world_size - 1)
        return self._all_gather(tensor.contiguous())

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TorchExchange(Exchange):
    """`Exchange` over a torch.distributed process group (gloo on CPU, NCCL on GPU).

    The group is held by a weak reference: torch.distributed's registry keeps it alive until
    `destroy_process_group`, and a sampler must not keep it alive after that (a gloo group freed
    only at interpreter shutdown aborts the process: "terminate called without an active
    exception"). A call after the group was destroyed raises `InvalidEnvironment`."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise InvalidEnvironment("group", group, "a group of an initialised torch.distributed")
        super().__init__()
        self._dist = dist
        self._group = weakref.ref(group) if group is not None else (lambda: None)
        self._default = group is None
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    @property
    def group(self) -> Any:
        """The process group (None: the default group)."""
        group = self._group()
        if group is None and not self._default:
            raise InvalidEnvironment("group", "destroyed", "a process group that is still initialised")
        return group

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._dist.all_gather(parts, tensor, group=self.group)
        return torch.stack(parts)


class ThreadHub:
    """What the threads of one in-process split share: a slot per rank and a barrier."""

    def __init__(self, world: int, timeout: float = 120.0) -> None:
        self.world = world
        self.parts: list[Any] = [None] * world
        self.barrier = threading.Barrier(world, timeout=timeout)


class ThreadExchange(Exchange):
    """All-gather between the threads of one process: rank `rank` of `hub` (one thread per rank, each
    with its own `Sampler(group=ThreadExchange(hub, rank))`). A rank that stops calling leaves the
    others waiting until the hub's barrier times out (threading.BrokenBarrierError)."""

    def __init__(self, hub: ThreadHub, rank: int) -> None:
        super().__init__()
        self.hub, self.rank, self.world_size = hub, rank, hub.world

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.hub.parts[self.rank] = tensor.clone()
        self.hub.barrier.wait()
        out = torch.stack(self.hub.parts)
        self.hub.barrier.wait()
        return out


def as_exchange(group: Any) -> Exchange:
    """A process group, or an `Exchange` (custom transports, tests), as an `Exchange`."""
    return group if isinstance(group, Exchange) else TorchExchange(group)
