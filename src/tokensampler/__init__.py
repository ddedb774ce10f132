"""tokensampler: the sampling stage of an LLM inference engine.

Given a batch of logits and each request's parameters and history, pick every request's next
token exactly as docs/semantics.md defines it, fast, on CPU or GPU, with per-slot state.
"""

from .api import sample
from .batch_params import BatchSamplingParams
from .generation_config import GenerationDefaults, InvalidRequest, load_generation_defaults, resolve_request
from .generator import SamplingGenerator, StaleSamplingState
from .output import LogprobsOutput, SamplerOutput
from .params import InvalidSamplingParams, SamplingParams
from .sampler import Sampler
from .seeds import SeedManager

__all__ = [
    "BatchSamplingParams", "GenerationDefaults", "InvalidRequest", "InvalidSamplingParams", "LogprobsOutput",
    "Sampler", "SamplerOutput", "SamplingGenerator", "SamplingParams", "SeedManager", "StaleSamplingState",
    "load_generation_defaults", "resolve_request", "sample",
]
__version__ = "0.1.0"
