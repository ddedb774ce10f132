"""tokensampler: the sampling stage of an LLM inference engine.

Given a batch of logits and each request's parameters and history, pick every request's next
token exactly as docs/semantics.md defines it, fast, on CPU or GPU, with per-slot state.
"""

from .api import sample
from .output import LogprobsOutput, SamplerOutput
from .params import InvalidSamplingParams, SamplingParams
from .sampler import Sampler

__all__ = ["InvalidSamplingParams", "LogprobsOutput", "Sampler", "SamplerOutput", "SamplingParams", "sample"]
__version__ = "0.1.0"
