"""`SeedManager`: the seeding policy and the noise coordinates (seed, stream, position) of each slot.

The noise of a token is a pure function of (seed, position, stream), so a request's random state
is three integers that move with it: `apply_slot_remap` moves them, `get_new_values` hands out the
coordinates of the next token and advances the position once. An unseeded request gets a random
seed drawn here, so every slot's state can be moved and replayed. A manager keeps the integers
itself, or is a view of a `Sampler`'s slots (the `SamplingGenerator`'s is): then the sampler's slot
state is their only copy, and the device steps advance the positions there.
Also home of `check_slot_remap`, the validation every remap goes through before it is applied, and
`rank_local_slot_remap`, the part of a global lane-major remap one lane-parallel replica applies.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Sequence

import torch

from ..core import rng
from ..core.checks import check_int, check_slots, int_list
from ..core.constants import INT64_MIN, POSITION_LIMIT, UINT64_MAX
from ..core.errors import InvalidSamplingParams, InvalidSlotRemap
from ..sampler import Sampler


def check_slot_remap(remap: Sequence[int] | torch.Tensor, num_slots: int) -> list[int]:
    """The remap as a list, after checking: `num_slots` ints in [0, num_slots), no two equal.

    `remap[i] = j` means new slot i takes old slot j's state, so it must be a permutation.
    O(num_slots), in C for a valid remap of plain ints (the entry-by-entry checks run only to name
    the first bad entry).
    """
    values = int_list("slot_remap", remap)
    if len(values) != num_slots:
        raise InvalidSlotRemap("slot_remap", f"{len(values)} entries", f"exactly {num_slots} entries")
    if set(map(type, values)) == {int} and min(values) >= 0 and max(values) < num_slots \
            and len(set(values)) == num_slots:
        return values
    for new, old in enumerate(values):
        check_int(f"slot_remap[{new}]", old, 0, num_slots - 1, allowed=f"an old slot in [0, {num_slots})",
                  error=InvalidSlotRemap)
    if len(set(values)) != num_slots:
        taken = [j for j, count in Counter(values).items() if count > 1]
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
    """Per-slot seed, stream and position counter: the seeding policy of an engine's slots.

    seeds[s] is None for an empty slot; drawn[s] says the seed was drawn for an unseeded request.
    seed_source: draws a seed for an unseeded request (default: 63 random bits from `secrets`).
    sampler: None (default), the manager keeps its own host lists (for an engine that samples on
      the host); a `Sampler`, the manager is a view of that sampler's slots (`SamplingGenerator`'s
      `seed_manager`): every read asks the sampler (`records_of`, and `positions_of`: one device
      read for the positions) and every write goes to it (`set_noise`,
      `advance`), so nothing is kept twice. `seeds`, `drawn`, `positions` and `streams` are then
      fresh lists on every read (writing into them changes nothing), and `apply_slot_remap` is
      refused: a remap moves a slot's whole state (`Sampler.move_slots`, through the generator).
    """

    def __init__(self, num_slots: int, *, seed_source: Callable[[], int] | None = None,
                 sampler: Sampler | None = None) -> None:
        check_int("num_slots", num_slots, 1)
        if sampler is not None:
            if not isinstance(sampler, Sampler):
                raise InvalidSamplingParams("sampler", sampler, "None or a Sampler")
            check_int("num_slots", num_slots, 1, sampler.max_slots, allowed=f"at most the sampler's "
                      f"max_slots ({sampler.max_slots})")
        self.num_slots = num_slots
        self._draw = seed_source if seed_source is not None else rng.fresh_seed
        self._sampler = sampler
        if sampler is None:
            self._seeds: list[int | None] = [None] * num_slots
            self._drawn: list[bool] = [False] * num_slots
            self._positions: list[int] = [0] * num_slots
            self._streams: list[int] = [0] * num_slots

    # ------------------------------------------------------------ the record (own, or the sampler's)
    @property
    def seeds(self) -> list[int | None]:
        if self._sampler is None:
            return self._seeds
        return [r.seed for r in self._sampler.records_of(range(self.num_slots))]

    @property
    def drawn(self) -> list[bool]:
        if self._sampler is None:
            return self._drawn
        return [r.drawn for r in self._sampler.records_of(range(self.num_slots))]

    @property
    def positions(self) -> list[int]:
        if self._sampler is None:
            return self._positions
        return self._sampler.positions_of(range(self.num_slots))

    @property
    def streams(self) -> list[int]:
        if self._sampler is None:
            return self._streams
        return [r.stream for r in self._sampler.records_of(range(self.num_slots))]

    def _write(self, slots: list[int], seeds: list[int | None], drawn: list[bool], positions: list[int | None],
               streams: list[int | None]) -> None:
        """Write checked values (None: keep the slot's position / stream)."""
        if not slots:
            return
        if self._sampler is not None:
            kept = self._held(slots)[2] if any(t is None for t in streams) else streams
            self._sampler.set_noise(slots, seeds, positions,
                                    [k if t is None else t for k, t in zip(kept, streams)], drawn=drawn)
            return
        for slot, seed, was_drawn, position, stream in zip(slots, seeds, drawn, positions, streams):
            self._seeds[slot], self._drawn[slot] = seed, was_drawn
            if position is not None:
                self._positions[slot] = position
            if stream is not None:
                self._streams[slot] = stream

    def _held(self, slots: list[int]) -> tuple[list[int | None], list[bool], list[int]]:
        """(seeds, drawn, streams) of `slots` alone: a view reads the sampler's records of those
        slots only, so a call costs O(len(slots)) however many slots there are."""
        if self._sampler is None:
            return [self._seeds[s] for s in slots], [self._drawn[s] for s in slots], [self._streams[s] for s in slots]
        records = self._sampler.records_of(slots)
        return [r.seed for r in records], [r.drawn for r in records], [r.stream for r in records]

    def _advance(self, slots: list[int], counts: list[int]) -> None:
        if self._sampler is not None:
            self._sampler.advance(slots, counts)
            return
        for slot, count in zip(slots, counts):
            self._positions[slot] += count

    # ------------------------------------------------------------ seeding
    def reset_seed(self, seeds: Sequence[int | None], slots: Sequence[int], *,
                   streams: Sequence[int] | None = None, positions: Sequence[int] | None = None) -> list[int]:
        """New requests: `seeds[i]` (None or -1: draw one) goes to `slots[i]`, position
        `positions[i]` (default 0), stream `streams[i]` (default 0). Returns the effective seeds,
        in request order."""
        slot_list = check_slots("slots", slots, self.num_slots)
        seed_list = [_check_seed(s) for s in seeds]
        if len(seed_list) != len(slot_list):
            raise InvalidSamplingParams("seeds", f"{len(seed_list)} seeds", f"one per slot ({len(slot_list)})")
        stream_list = check_streams(streams, len(slot_list))
        position_list = [0] * len(slot_list) if positions is None else self._check_positions(positions, slot_list)
        drawn = [seed is None for seed in seed_list]
        out = [self._draw() if seed is None else seed for seed in seed_list]
        self._write(slot_list, out, drawn, position_list, stream_list)
        return out

    @staticmethod
    def _check_positions(positions: Sequence[int], slot_list: list[int]) -> list[int]:
        position_list = int_list("positions", positions)
        if len(position_list) != len(slot_list):
            raise InvalidSamplingParams("positions", f"{len(position_list)} positions",
                                        f"one per slot ({len(slot_list)})")
        for position in position_list:
            check_int("position", position, 0, POSITION_LIMIT - 1, allowed=f"an int in [0, {POSITION_LIMIT})")
        return position_list

    def reset_seed_from_slots(self, seeds: Sequence[int | None], slots: Sequence[int]) -> list[int]:
        """Seeds indexed by slot (`seeds[s]` for each s in `slots`): a slot already holding that seed
        (drawn or not) keeps its counter and stream (the same request continues); None keeps a
        slot's drawn seed.
        Any other slot starts afresh (new seed, drawn if None, position 0, stream 0).
        Returns the effective seeds of `slots`."""
        slot_list = check_slots("slots", slots, self.num_slots)
        if len(seeds) < (max(slot_list) + 1 if slot_list else 0):
            raise InvalidSamplingParams("seeds", f"{len(seeds)} seeds", "one per slot, indexed by slot")
        wanted = [_check_seed(seeds[slot]) for slot in slot_list]
        held_seeds, held_drawn, _ = self._held(slot_list)
        out, fresh, fresh_seeds, fresh_drawn = [], [], [], []
        for slot, seed, held, was_drawn in zip(slot_list, wanted, held_seeds, held_drawn):
            # an engine may echo the reported (drawn) seed back as an explicit one: the same request
            same = held is not None and ((seed is None and was_drawn) or seed == held)
            if not same:
                held = self._draw() if seed is None else seed
                fresh.append(slot)
                fresh_seeds.append(held)
                fresh_drawn.append(seed is None)
            out.append(held)
        self._write(fresh, fresh_seeds, fresh_drawn, [0] * len(fresh), [0] * len(fresh))
        return out

    def align_seed_counters_to_positions(self, slots: Sequence[int], positions: Sequence[int]) -> None:
        """Set the position counter of `slots[i]` to `positions[i]` (the next token's position)."""
        slot_list = check_slots("slots", slots, self.num_slots)
        position_list = self._check_positions(positions, slot_list)
        seeds, drawn, _ = self._held(slot_list)
        self._write(slot_list, seeds, drawn, position_list, [None] * len(slot_list))

    # ------------------------------------------------------------ stepping
    def get_new_values(self, slots: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """(seeds, positions, streams) of the next token of each slot, then each position advances
        by one: call exactly once per sampled token. Every slot must hold a seed."""
        slot_list = check_slots("slots", slots, self.num_slots)
        seeds, positions, streams = self._coordinates(slot_list, [1] * len(slot_list))
        self._advance(slot_list, [1] * len(slot_list))
        return seeds, positions, streams

    def advance(self, slots: Sequence[int], counts: Sequence[int]) -> None:
        """Advance the position of `slots[i]` by `counts[i]` tokens at once (a speculative step that
        emitted several tokens): the same as `counts[i]` calls of `get_new_values`. Checked first."""
        slot_list = check_slots("slots", slots, self.num_slots)
        count_list = int_list("counts", counts)
        if len(count_list) != len(slot_list):
            raise InvalidSamplingParams("counts", f"{len(count_list)} counts", f"one per slot ({len(slot_list)})")
        for count in count_list:
            check_int("counts", count, 0, allowed="an int >= 0")
        self._coordinates(slot_list, count_list)
        self._advance(slot_list, count_list)

    def _coordinates(self, slots: list[int], counts: list[int]) -> tuple[list[int], list[int], list[int]]:
        """(seeds, positions, streams) of `slots`, after checking each holds a seed and stays below
        the position limit after `counts` more tokens."""
        seeds, _, streams = self._held(slots)
        for slot, seed in zip(slots, seeds):
            if seed is None:
                raise InvalidSamplingParams("slots", slot, "slots holding a seed (reset_seed first)")
        held = self.positions if self._sampler is None else self._sampler.positions_of(slots)
        positions = [held[s] for s in slots] if self._sampler is None else held
        for position, count in zip(positions, counts):
            if position + count >= POSITION_LIMIT:
                raise InvalidSamplingParams("position", position + count, f"below {POSITION_LIMIT}")
        return seeds, positions, streams

    def apply_slot_remap(self, remap: Sequence[int] | torch.Tensor) -> None:
        """New slot i takes old slot `remap[i]`'s seed, stream and position (validated first)."""
        values = check_slot_remap(remap, self.num_slots)
        if self._sampler is not None:
            raise InvalidSamplingParams("apply_slot_remap", "a view of a Sampler's slots",
                                        "a SeedManager of its own (a remap of a Sampler's slots moves their "
                                        "whole state: Sampler.move_slots, or the generator's slot_remap)")
        for name in ("_seeds", "_drawn", "_positions", "_streams"):
            old = getattr(self, name)
            setattr(self, name, [old[j] for j in values])

    def release_slot(self, slot: int) -> None:
        """Forget the slot's seed (idempotent)."""
        check_slots("slot", [slot], self.num_slots)
        self.release_slots([slot])

    def release_slots(self, slots: Sequence[int]) -> None:
        """Forget the seeds of `slots` (idempotent), all at once."""
        slot_list = check_slots("slots", slots, self.num_slots)
        count = len(slot_list)
        self._write(slot_list, [None] * count, [False] * count, [0] * count, [0] * count)

    def snapshot(self, slot: int) -> tuple[int | None, int, int]:
        """(seed, position, stream) of `slot`."""
        check_slots("slot", [slot], self.num_slots)
        if self._sampler is not None:
            sampler = self._sampler
            return sampler.seed_of(slot), sampler.position_of(slot), sampler.stream_of(slot)
        return self._seeds[slot], self._positions[slot], self._streams[slot]
