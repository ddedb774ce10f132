"""`SeedManager`: the host-side, authoritative noise coordinates (seed, stream, position) of each slot.

The noise of a token is a pure function of (seed, position, stream), so a request's random state
is three integers that move with it: `apply_slot_remap` moves them, `get_new_values` hands out the
coordinates of the next token and advances the position once. An unseeded request gets a random
seed drawn and recorded here, so every slot's state can be moved and replayed.
Also home of `check_slot_remap`, the validation every remap goes through before it is applied, and
`rank_local_slot_remap`, the part of a global lane-major remap one lane-parallel replica applies.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..core import rng
from ..core.checks import check_int, check_slots, int_list
from ..core.constants import INT64_MIN, POSITION_LIMIT, UINT64_MAX
from ..core.errors import InvalidSamplingParams, InvalidSlotRemap


def check_slot_remap(remap: Sequence[int] | torch.Tensor, num_slots: int) -> list[int]:
    """The remap as a list, after checking: `num_slots` ints in [0, num_slots), no two equal.

    `remap[i] = j` means new slot i takes old slot j's state, so it must be a permutation.
    """
    values = int_list("slot_remap", remap)
    if len(values) != num_slots:
        raise InvalidSlotRemap("slot_remap", f"{len(values)} entries", f"exactly {num_slots} entries")
    for new, old in enumerate(values):
        check_int(f"slot_remap[{new}]", old, 0, num_slots - 1, allowed=f"an old slot in [0, {num_slots})",
                  error=InvalidSlotRemap)
    if len(set(values)) != num_slots:
        taken = [j for j in set(values) if values.count(j) > 1]
        raise InvalidSlotRemap("slot_remap", values, f"distinct old slots (taken twice: {sorted(taken)})")
    return values


def rank_local_slot_remap(global_remap: Sequence[int] | torch.Tensor, lane: int, lane_stride: int,
                          local_width: int) -> list[int]:
    """The part of a global lane-major remap that one lane (replica) applies to its local slots.

    Entries [lane * lane_stride, (lane + 1) * lane_stride) of `global_remap`, minus the lane base,
    then the identity for the local slots past `lane_stride` up to `local_width` (the padded width).
    Raises `InvalidSamplingParams` when an entry leaves the lane or the sizes do not fit.
    """
    values = int_list("global_remap", global_remap)
    for name, value, low in (("lane", lane, 0), ("lane_stride", lane_stride, 1), ("local_width", local_width, 1)):
        check_int(name, value, low)
    if lane_stride > local_width:
        raise InvalidSamplingParams("lane_stride", lane_stride, f"at most local_width={local_width}")
    base = lane * lane_stride
    if len(values) < base + lane_stride:
        raise InvalidSamplingParams("global_remap", f"{len(values)} entries",
                                    f"at least {base + lane_stride} for lane {lane} with stride {lane_stride}")
    local = []
    for i, old in enumerate(values[base:base + lane_stride]):
        check_int(f"global_remap[{base + i}]", old, base, base + lane_stride - 1,
                  allowed=f"a slot of lane {lane}, in [{base}, {base + lane_stride})")
        local.append(old - base)
    return check_slot_remap(local + list(range(lane_stride, local_width)), local_width)


def check_streams(streams: Sequence[int] | None, count: int) -> list[int]:
    """`count` noise streams (default 0 each), each an int in [0, 2^32)."""
    stream_list = [0] * count if streams is None else list(streams)
    if len(stream_list) != count:
        raise InvalidSamplingParams("streams", f"{len(stream_list)} streams", f"one per slot ({count})")
    for stream in stream_list:
        check_int("stream", stream, 0, POSITION_LIMIT - 1, allowed=f"an int in [0, {POSITION_LIMIT})")
    return stream_list


def _check_seed(seed: int | None) -> int | None:
    if seed is None or seed == -1:
        return None
    check_int("seed", seed, INT64_MIN, UINT64_MAX, allowed=f"None, -1, or an int in [{INT64_MIN}, {UINT64_MAX}]")
    return seed


class SeedManager:
    """Per-slot seed, stream and position counter, on the host.

    seeds[s] is None for an empty slot; drawn[s] says the seed was drawn for an unseeded request.
    seed_source: draws a seed for an unseeded request (default: 63 random bits from `secrets`).
    """

    def __init__(self, num_slots: int, *, seed_source: Callable[[], int] | None = None) -> None:
        check_int("num_slots", num_slots, 1)
        self.num_slots = num_slots
        self._draw = seed_source if seed_source is not None else rng.fresh_seed
        self.seeds: list[int | None] = [None] * num_slots
        self.drawn: list[bool] = [False] * num_slots
        self.positions: list[int] = [0] * num_slots
        self.streams: list[int] = [0] * num_slots

    # ------------------------------------------------------------ seeding
    def reset_seed(self, seeds: Sequence[int | None], slots: Sequence[int], *,
                   streams: Sequence[int] | None = None) -> list[int]:
        """New requests: `seeds[i]` (None or -1: draw one) goes to `slots[i]`, position 0, stream
        `streams[i]` (default 0). Returns the effective seeds, in request order."""
        slot_list = check_slots("slots", slots, self.num_slots)
        seed_list = [_check_seed(s) for s in seeds]
        if len(seed_list) != len(slot_list):
            raise InvalidSamplingParams("seeds", f"{len(seed_list)} seeds", f"one per slot ({len(slot_list)})")
        stream_list = check_streams(streams, len(slot_list))
        out = []
        for slot, seed, stream in zip(slot_list, seed_list, stream_list):
            self._set(slot, seed, stream)
            out.append(self.seeds[slot])
        return out

    def reset_seed_from_slots(self, seeds: Sequence[int | None], slots: Sequence[int]) -> list[int]:
        """Seeds indexed by slot (`seeds[s]` for each s in `slots`): a slot already holding that seed
        (drawn or not) keeps its counter and stream (the same request continues); None keeps a
        slot's drawn seed.
        Any other slot starts afresh (new seed, drawn if None, position 0, stream 0).
        Returns the effective seeds of `slots`."""
        slot_list = check_slots("slots", slots, self.num_slots)
        if len(seeds) < (max(slot_list) + 1 if slot_list else 0):
            raise InvalidSamplingParams("seeds", f"{len(seeds)} seeds", "one per slot, indexed by slot")
        wanted = {slot: _check_seed(seeds[slot]) for slot in slot_list}
        out = []
        for slot in slot_list:
            seed = wanted[slot]
            held = self.seeds[slot]
            # an engine may echo the reported (drawn) seed back as an explicit one: the same request
            same = held is not None and ((seed is None and self.drawn[slot]) or seed == held)
            if not same:
                self._set(slot, seed, 0)
            out.append(self.seeds[slot])
        return out

    def _set(self, slot: int, seed: int | None, stream: int) -> None:
        self.drawn[slot] = seed is None
        self.seeds[slot] = self._draw() if seed is None else seed
        self.positions[slot] = 0
        self.streams[slot] = stream

    def align_seed_counters_to_positions(self, slots: Sequence[int], positions: Sequence[int]) -> None:
        """Set the position counter of `slots[i]` to `positions[i]` (the next token's position)."""
        slot_list = check_slots("slots", slots, self.num_slots)
        position_list = int_list("positions", positions)
        if len(position_list) != len(slot_list):
            raise InvalidSamplingParams("positions", f"{len(position_list)} positions",
                                        f"one per slot ({len(slot_list)})")
        for position in position_list:
            check_int("position", position, 0, POSITION_LIMIT - 1, allowed=f"an int in [0, {POSITION_LIMIT})")
        for slot, position in zip(slot_list, position_list):
            self.positions[slot] = position

    # ------------------------------------------------------------ stepping
    def get_new_values(self, slots: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """(seeds, positions, streams) of the next token of each slot, then each position advances
        by one: call exactly once per sampled token. Every slot must hold a seed."""
        slot_list = check_slots("slots", slots, self.num_slots)
        for slot in slot_list:
            if self.seeds[slot] is None:
                raise InvalidSamplingParams("slots", slot, "slots holding a seed (reset_seed first)")
            if self.positions[slot] + 1 >= POSITION_LIMIT:
                raise InvalidSamplingParams("position", self.positions[slot] + 1, f"below {POSITION_LIMIT}")
        seeds = [self.seeds[s] for s in slot_list]
        positions = [self.positions[s] for s in slot_list]
        streams = [self.streams[s] for s in slot_list]
        for slot in slot_list:
            self.positions[slot] += 1
        return seeds, positions, streams

    def advance(self, slots: Sequence[int], counts: Sequence[int]) -> None:
        """Advance the position of `slots[i]` by `counts[i]` tokens at once (a speculative step that
        emitted several tokens): the same as `counts[i]` calls of `get_new_values`. Checked first."""
        slot_list = check_slots("slots", slots, self.num_slots)
        count_list = int_list("counts", counts)
        if len(count_list) != len(slot_list):
            raise InvalidSamplingParams("counts", f"{len(count_list)} counts", f"one per slot ({len(slot_list)})")
        for slot, count in zip(slot_list, count_list):
            check_int("counts", count, 0, allowed="an int >= 0")
            if self.seeds[slot] is None:
                raise InvalidSamplingParams("slots", slot, "slots holding a seed (reset_seed first)")
            if self.positions[slot] + count >= POSITION_LIMIT:
                raise InvalidSamplingParams("position", self.positions[slot] + count, f"below {POSITION_LIMIT}")
        for slot, count in zip(slot_list, count_list):
            self.positions[slot] += count

    def apply_slot_remap(self, remap: Sequence[int] | torch.Tensor) -> None:
        """New slot i takes old slot `remap[i]`'s seed, stream and position (validated first)."""
        values = check_slot_remap(remap, self.num_slots)
        for name in ("seeds", "drawn", "positions", "streams"):
            old = getattr(self, name)
            setattr(self, name, [old[j] for j in values])

    def release_slot(self, slot: int) -> None:
        """Forget the slot's seed (idempotent)."""
        check_slots("slot", [slot], self.num_slots)
        self.seeds[slot] = None
        self.drawn[slot] = False
        self.positions[slot] = 0
        self.streams[slot] = 0

    def snapshot(self, slot: int) -> tuple[int | None, int, int]:
        """(seed, position, stream) of `slot`."""
        check_slots("slot", [slot], self.num_slots)
        return self.seeds[slot], self.positions[slot], self.streams[slot]
