"""The ranks of a vLLM worker that must sample identically: its tensor-parallel group.

In vLLM 0.32 every rank of a tensor-parallel group runs the sampler on the same logits, and each
rank feeds its own sampled token back into its own persistent batch as the next input; only rank
0's output reaches the scheduler. So every choice the sampler makes must be the same on every rank.
tokensampler's choices are pure functions of the logits, the request and its seed, except the seed
an unseeded request draws at admission: `agreed_seed_source` makes that draw the same on every
rank, from 63 bits drawn on rank 0 and shared once (one all-gather over the group's CPU group when
the batch state is made, none per step). With pipeline parallelism only the last stage samples,
and its tensor-parallel group is the group that must agree.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any, Callable

from ...parallel.agreement import Agreement


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """This worker's tensor-parallel group (vLLM's `GroupCoordinator`): its rank, size and groups."""

    rank: int
    world_size: int
    cpu_group: Any     # gloo: host-side agreement
    device_group: Any  # the group the logits travel on (gloo on CPU, NCCL on GPU)


def tensor_parallel() -> TensorParallel | None:
    """This worker's tensor-parallel group, or None with one rank (or outside a vLLM worker)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_tp_group()
    if group.world_size <= 1:
        return None
    return TensorParallel(group.rank_in_group, group.world_size, group.cpu_group, group.device_group)


def agreed_seed_source(tp: TensorParallel | None) -> Callable[[], int] | None:
    """Seeds for unseeded requests, the same sequence on every rank of `tp` (None: one rank, the
    generator's own fresh seeds). Collective: every rank of the group calls it together."""
    if tp is None:
        return None
    shared = Agreement.over(tp.cpu_group).shared_random_bits()
    return functools.partial(random.Random(shared).getrandbits, 63)
