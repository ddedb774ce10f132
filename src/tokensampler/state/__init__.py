"""Per-slot sampler state on a vocabulary layout (the whole vocabulary, or one rank's slice)."""

from .layout import VocabLayout
from .slots import SamplerState, SlotRecord

__all__ = ["SamplerState", "SlotRecord", "VocabLayout"]
