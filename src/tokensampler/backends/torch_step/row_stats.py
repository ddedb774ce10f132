"""Full-row reductions around the candidate list: how many ids can still win, and the mass below them.

`winnable_count(z, floor)`: per row, the number of ids with `z >= floor` (the width of the
candidate list). `tail_mass(z, z_max, floor)`: the float64 sum of `p = exp(z - z_max)` over the
other ids (the tail). Top-p's total, when nothing else removed ids, is that tail plus the list's
own mass (eager exp on the list: the reference's values). With torch.compile each is one
vectorised loop per row. Inductor's exp may differ from eager `torch.exp` by an ulp, so the tail
comes with a bound on its distance to the reference's sum of the same p: `mass_error`. The caller
decides top-p at both ends of that interval and recomputes exactly (`select.kept_mass`) the rows
where the two ends disagree; the tail is a small part of a peaked row's mass (ids that cannot win),
so that happens rarely.
"""

from __future__ import annotations

import torch

from . import compile_cache
from .config import DEFAULT, TorchStepConfig
from .indexing import column_chunks

# |exp_compiled(x) - exp_eager(x)| <= 2 ulp(p) <= 2^-22 p for a normal p (both within one ulp of
# exp; tests/test_row_stats.py measures at most 2 ulps), so the tails differ by at most 2^-22 of
# the tail, plus float64 summation order (n 2^-53, n < 2^24) and subnormal p (2^-148 each).
MASS_RELATIVE_ERROR = 2.0**-21
SUBNORMAL_ERROR = 2.0**-140  # per id


def _tail(z: torch.Tensor, z_max: torch.Tensor, floor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    p = torch.exp(z / scale[:, None] - z_max[:, None])
    return torch.where(z >= floor[:, None], 0.0, p).to(torch.float64).sum(dim=-1)


def _count(z: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    return (z >= floor[:, None]).sum(dim=-1)


def _count_and_tail(z: torch.Tensor, z_max: torch.Tensor, floor: torch.Tensor, scale: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Both in one loop per row (compiled)."""
    return _count(z, floor), _tail(z, z_max, floor, scale)


compile_cache.register("winnable_count", _count)
compile_cache.register("count_and_tail", _count_and_tail)
compile_cache.register("tail_mass", _tail)


def _count_eager(z: torch.Tensor, floor: torch.Tensor, chunk: int) -> torch.Tensor:
    """Column chunk by chunk: a bool sum converts its whole input to int first."""
    count = torch.zeros(z.shape[0], dtype=torch.int64, device=z.device)
    for start, stop in column_chunks(z, chunk):
        count += (z[:, start:stop] >= floor[:, None]).sum(dim=-1)
    return count


def _tail_eager(z: torch.Tensor, z_max: torch.Tensor, floor: torch.Tensor, scale: torch.Tensor | None,
                chunk: int) -> torch.Tensor:
    """The reference's exp, column chunk by chunk."""
    total = torch.zeros(z.shape[0], dtype=torch.float64, device=z.device)
    for start, stop in column_chunks(z, chunk):
        zc = z[:, start:stop]
        p = (zc if scale is None else zc / scale[:, None]).sub(z_max[:, None]).exp_()
        total += p.masked_fill_(zc >= floor[:, None], 0.0).sum(dim=-1, dtype=torch.float64)
    return total


def winnable_count(z: torch.Tensor, floor: torch.Tensor, config: TorchStepConfig = DEFAULT,
                   compiled: bool = False) -> torch.Tensor:
    """z: float32 [R, V]; floor: float32 [R]. Returns int64 [R]: the ids with z >= floor.
    compiled: one compiled loop per row (the sampler's choice), else column chunks eagerly."""
    if not compiled:
        return _count_eager(z, floor, config.column_chunk)
    return compile_cache.maybe_compiled("winnable_count", _count, True)(z, floor)


def winnable_count_and_tail(z: torch.Tensor, z_max: torch.Tensor, floor: torch.Tensor,
                            scale: torch.Tensor | None = None, config: TorchStepConfig = DEFAULT,
                            compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(`winnable_count`, `tail_mass`) from one pass (compiled: one vectorised loop per row)."""
    if not compiled:
        return _count_eager(z, floor, config.column_chunk), _tail_eager(z, z_max, floor, scale, config.column_chunk)
    scale = torch.ones_like(z_max) if scale is None else scale
    return compile_cache.maybe_compiled("count_and_tail", _count_and_tail, True)(z, z_max, floor, scale)


def estimated_count(z: torch.Tensor, floor: torch.Tensor, stride: int = 16, rows: list[int] | None = None
                    ) -> torch.Tensor:
    """int64 [R]: the ids with z >= floor estimated from one id in `stride` (a cheap strided read:
    tells flat rows, whose list would be too long, from peaked ones before any full pass). rows: the
    rows of z the R floors are for (None: every row)."""
    sample = z[:, ::stride] if rows is None else z[:, ::stride][rows]
    return (sample >= floor[:, None]).sum(dim=-1, dtype=torch.int32).to(torch.int64) * stride


def tail_mass(z: torch.Tensor, z_max: torch.Tensor, floor: torch.Tensor, scale: torch.Tensor | None = None,
              config: TorchStepConfig = DEFAULT, compiled: bool = False) -> torch.Tensor:
    """z: float32 [R, V] (-inf = removed); z_max: float32 [R], finite; floor: float32 [R], in the
    rows' own units; scale: float32 [R] when the rows hold z * scale (undivided logits), else None.
    Returns float64 [R]: the sum of exp(z / scale - z_max) over the ids with z < floor, within
    `mass_error(tail)` of the reference's sum (compiled: one loop per row, else column chunks)."""
    if not compiled:
        return _tail_eager(z, z_max, floor, scale, config.column_chunk)
    scale = torch.ones_like(z_max) if scale is None else scale
    return compile_cache.maybe_compiled("tail_mass", _tail, True)(z, z_max, floor, scale)


def mass_error(tail: torch.Tensor, vocab: int) -> torch.Tensor:
    """float64 [R]: a bound on |tail - the reference's float64 sum of the same p|."""
    return tail * MASS_RELATIVE_ERROR + vocab * SUBNORMAL_ERROR
