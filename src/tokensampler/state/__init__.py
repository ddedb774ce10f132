"""Per-slot sampler state on a vocabulary layout (the whole vocabulary, or one rank's slice)."""

from .layout import VocabLayout
from .slots import SamplerState

__all__ = ["SamplerState", "VocabLayout"]
