"""Old import path of `tokensampler.engine.seeds` (re-exported here)."""

from .core.checks import check_slots
from .core.constants import POSITION_LIMIT
from .core.errors import InvalidSlotRemap
from .engine.seeds import SeedManager, check_slot_remap, check_streams, rank_local_slot_remap

__all__ = ["POSITION_LIMIT", "InvalidSlotRemap", "SeedManager", "check_slot_remap", "check_slots", "check_streams",
           "rank_local_slot_remap"]
