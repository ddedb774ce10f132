"""`VocabLayout`: which ids of the vocabulary one sampler holds: all of them, or one rank's slice.

With a vocabulary split over `world` ranks, rank r reads the logits columns
`[r * Vp / world, (r + 1) * Vp / world)` and keeps the state (penalty history, bias, allowed and
stop ids) of those ids only; ids >= V (padding, possibly spanning several ranks) are never held.
Without a split the one rank holds `[0, V)` and reads `Vp` columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class VocabLayout:
    """vocab_size V (real ids), padded_vocab_size Vp (the logits' full width), this rank and the world;
    `sliced` keeps the slice form for a group of one rank (its logits are the whole padded row)."""

    vocab_size: int
    padded_vocab_size: int
    rank: int = 0
    world: int = 1
    sliced: bool = False

    @property
    def split(self) -> bool:
        """True when this sampler holds a slice of a split vocabulary (a group of any size)."""
        return self.sliced or self.world > 1

    @property
    def columns(self) -> int:
        """The width of the logits this rank is given: Vp, or Vp / world of a split."""
        return self.padded_vocab_size // self.world

    @property
    def offset(self) -> int:
        """The global id of this rank's first column."""
        return self.rank * self.columns

    @property
    def real_width(self) -> int:
        """How many of this rank's columns are real ids (< V)."""
        return max(0, min(self.columns, self.vocab_size - self.offset))

    @property
    def width(self) -> int:
        """The width of the per-slot state: V unsplit (padding needs no state), the slice width split."""
        return self.vocab_size if not self.split else self.columns

    def holds(self, token: int) -> bool:
        return self.offset <= token < self.offset + self.real_width

    def local(self, ids: Iterable[int]) -> list[int]:
        """The global ids this rank holds, as local column indices (others dropped)."""
        return [t - self.offset for t in ids if self.holds(t)]

    def local_tensor(self, ids: torch.Tensor) -> torch.Tensor:
        """Global ids (any shape, -1 = padding) as local columns; ids held elsewhere become -1."""
        if not self.split:
            return ids
        local = ids - self.offset
        return torch.where((local >= 0) & (local < self.real_width), local, torch.full_like(ids, -1))

    def global_ids(self, device: torch.device | str) -> torch.Tensor:
        """int64 [columns]: the global id of each column this rank reads."""
        return torch.arange(self.offset, self.offset + self.columns, device=device)
