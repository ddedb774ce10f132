"""The decode contract an engine drives: `SamplingGenerator` (slots, remaps, host/device
switches), `SeedManager`, the columnar `BatchSamplingParams` and its helpers, captured steps."""

from .batch_params import (
                           BatchSamplingParams,
                           broadcast_sampling_params,
                           chunk_sampling_params,
                           format_sampling_params,
                           scatter_sampling_params_to_slots,
                           slice_sampling_params,
)
from .generator import SamplingGenerator
from .seeds import SeedManager, rank_local_slot_remap
from .tracing import StepTracer, TraceKey

__all__ = ["BatchSamplingParams", "SamplingGenerator", "SeedManager", "StepTracer", "TraceKey",
           "broadcast_sampling_params", "chunk_sampling_params", "format_sampling_params", "rank_local_slot_remap",
           "scatter_sampling_params_to_slots", "slice_sampling_params"]
