"""The `Sampler` (one step for a batch of slots, with their state) and `sample` (the stateless form)."""

from .sampler import Sampler
from .stateless import sample

__all__ = ["Sampler", "sample"]
