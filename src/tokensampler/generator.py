"""Old import path of the engine contract: `tokensampler.engine` (re-exported here)."""

from .core.errors import InvalidSlotRemap, StaleSamplingState, TraceMismatch
from .engine.batch_params import (
                                  BatchSamplingParams,
                                  broadcast_sampling_params,
                                  chunk_sampling_params,
                                  format_sampling_params,
                                  scatter_sampling_params_to_slots,
                                  slice_sampling_params,
)
from .engine.generator import NEUTRAL_PARAMS, SAMPLING_MODES, SamplingGenerator
from .engine.seeds import SeedManager, rank_local_slot_remap
from .engine.tracing import TraceKey
from .parallel.agreement import call_key

__all__ = ["NEUTRAL_PARAMS", "SAMPLING_MODES", "BatchSamplingParams", "InvalidSlotRemap", "SamplingGenerator",
           "SeedManager", "StaleSamplingState", "TraceKey", "TraceMismatch", "broadcast_sampling_params",
           "call_key", "chunk_sampling_params", "format_sampling_params", "rank_local_slot_remap",
           "scatter_sampling_params_to_slots", "slice_sampling_params"]
