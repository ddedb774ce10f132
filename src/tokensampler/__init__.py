"""tokensampler: the sampling stage of an LLM inference engine.

Given a batch of logits and each request's parameters and history, pick every request's next
token exactly as docs/semantics.md defines it, fast, on CPU or GPU, with per-slot state.
"""

import warnings

# numpy is optional (every numpy pass has a torch route); torch warns once at import when it is
# missing. That one warning is silenced (only if torch is imported here first, e.g. by the CLI).
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

from .core.errors import (
                          CompileFallbackWarning,
                          InvalidCheckpoint,
                          InvalidEnvironment,
                          InvalidRequest,
                          InvalidSamplingParams,
                          InvalidSlotRemap,
                          SplitMismatch,
                          StaleSamplingState,
                          TokenSamplerError,
                          TraceMismatch,
                          UnsupportedOnSplit,
)
from .core.output import LogprobsOutput, SamplerOutput, SpeculativeOutput
from .core.params import SamplingParams
from .engine.batch_params import (
                          BatchSamplingParams,
                          broadcast_sampling_params,
                          chunk_sampling_params,
                          format_sampling_params,
                          scatter_sampling_params_to_slots,
                          slice_sampling_params,
)
from .engine.generator import SamplingGenerator
from .engine.seeds import SeedManager, rank_local_slot_remap
from .engine.tracing import TraceKey
from .sampler import Sampler, sample
from .serving.generation_config import GenerationDefaults, load_generation_defaults, resolve_request

__all__ = [
    "BatchSamplingParams", "CompileFallbackWarning", "GenerationDefaults", "InvalidCheckpoint", "InvalidEnvironment",
    "InvalidRequest",
    "InvalidSamplingParams", "InvalidSlotRemap", "LogprobsOutput", "Sampler", "SamplerOutput", "SamplingGenerator",
    "SamplingParams", "SeedManager", "SpeculativeOutput", "SplitMismatch", "StaleSamplingState", "TokenSamplerError",
    "TraceKey", "TraceMismatch", "UnsupportedOnSplit", "broadcast_sampling_params", "chunk_sampling_params",
    "format_sampling_params",
    "load_generation_defaults", "rank_local_slot_remap", "resolve_request", "sample",
    "scatter_sampling_params_to_slots", "slice_sampling_params",
]
__version__ = "0.1.0"
