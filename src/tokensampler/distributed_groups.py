"""The transports and group layouts of the vocabulary split: `Exchange` (the one collective a
split step needs, an all-gather of a small tensor, with byte counters), `TorchExchange` over a
torch.distributed group, and `SamplingDP`, the layout of independent sampling groups.
Re-exported by `distributed.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .params import InvalidSamplingParams


# ================================================================== collectives
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
    """`Exchange` over a torch.distributed process group (gloo on CPU, NCCL on GPU)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise InvalidSamplingParams("group", group, "a group of an initialised torch.distributed")
        super().__init__()
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._dist.all_gather(parts, tensor, group=self.group)
        return torch.stack(parts)


def as_exchange(group: Any) -> Exchange:
    """A process group, or an `Exchange` (custom transports, tests), as an `Exchange`."""
    return group if isinstance(group, Exchange) else TorchExchange(group)


# ================================================================== data-parallel groups
@dataclass(frozen=True)
class SamplingDP:
    """`dp` independent sampling groups of `tp` ranks each in a world of dp * tp ranks.

    Group g holds ranks [g * tp, (g + 1) * tp) (the usual TP-inner layout). Rows are split across
    groups by slot, round robin: global slot s lives in group s % dp, at local slot s // dp.
    """

    tp: int
    dp: int

    def __post_init__(self) -> None:
        for name in ("tp", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidSamplingParams(name, value, "an int >= 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    def ranks_of(self, group: int) -> list[int]:
        return list(range(group * self.tp, (group + 1) * self.tp))

    def group_of_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise InvalidSamplingParams("rank", rank, f"an int in [0, {self.world_size})")
        return rank // self.tp

    def locate(self, global_slot: int) -> tuple[int, int]:
        """(group, local slot) of a global slot."""
        if isinstance(global_slot, bool) or not isinstance(global_slot, int) or global_slot < 0:
            raise InvalidSamplingParams("global_slot", global_slot, "an int >= 0")
        return global_slot % self.dp, global_slot // self.dp

    def global_slot(self, group: int, local_slot: int) -> int:
        return local_slot * self.dp + group

    def new_groups(self) -> list[Any]:
        """Create the dp process groups (every rank of the world must call this, in step)."""
        import torch.distributed as dist

        if dist.get_world_size() != self.world_size:
            raise InvalidSamplingParams("world_size", dist.get_world_size(), f"tp * dp = {self.world_size}")
        return [dist.new_group(self.ranks_of(g)) for g in range(self.dp)]


def sampling_dp(tp: int, dp: int) -> SamplingDP:
    """The layout of `dp` sampling groups of `tp` ranks (see `SamplingDP`)."""
    return SamplingDP(tp, dp)
