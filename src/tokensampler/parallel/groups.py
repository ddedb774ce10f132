"""`SamplingDP`: the layout of independent sampling groups (tensor-parallel ranks inside, data-parallel
groups outside) and the global slot -> (group, local slot) map."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.checks import check_int
from ..core.errors import InvalidEnvironment


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
            check_int(name, value, 1)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    def ranks_of(self, group: int) -> list[int]:
        return list(range(group * self.tp, (group + 1) * self.tp))

    def group_of_rank(self, rank: int) -> int:
        check_int("rank", rank, 0, self.world_size - 1, allowed=f"an int in [0, {self.world_size})")
        return rank // self.tp

    def locate(self, global_slot: int) -> tuple[int, int]:
        """(group, local slot) of a global slot."""
        check_int("global_slot", global_slot, 0)
        return global_slot % self.dp, global_slot // self.dp

    def global_slot(self, group: int, local_slot: int) -> int:
        return local_slot * self.dp + group

    def new_groups(self) -> list[Any]:
        """Create the dp process groups (every rank of the world must call this, in step)."""
        import torch.distributed as dist

        if dist.get_world_size() != self.world_size:
            raise InvalidEnvironment("world_size", dist.get_world_size(), f"tp * dp = {self.world_size}")
        return [dist.new_group(self.ranks_of(g)) for g in range(self.dp)]


def sampling_dp(tp: int, dp: int) -> SamplingDP:
    """The layout of `dp` sampling groups of `tp` ranks (see `SamplingDP`)."""
    return SamplingDP(tp, dp)
