"""One pass per row before the candidate list: how many ids can still win, and the row's mass.

`winnable_count_and_mass(z, z_max, lower)` returns per row the number of ids with `z >= lower`
(the width of the candidate list) and the float64 sum of `p = exp(z - z_max)` over the whole row
(top-p's total when nothing else removed ids). With torch.compile both come from one vectorised
loop per row. Inductor's exp may differ from eager `torch.exp` (the reference's) by an ulp, so the
mass is returned with a bound on its distance to the reference's: `mass_error`. The caller decides
top-p at both ends of that interval and recomputes exactly (`select.kept_mass`) the rows where the
two ends disagree.
"""

from __future__ import annotations

import torch

from .. import compile as ts_compile
from . import select

# |exp_compiled(x) - exp_eager(x)| <= 2 ulp(p) <= 2^-22 p for a normal p (both within one ulp of
# exp; tests/test_row_stats.py measures it), so the masses differ by at most 2^-22 of the total,
# plus float64 summation order (n 2^-53, n < 2^24) and subnormal p (2^-148 each). 2^-20 covers all.
MASS_RELATIVE_ERROR = 2.0**-20
SUBNORMAL_ERROR = 2.0**-140  # per id


def _count_and_mass(z: torch.Tensor, z_max: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused form (compiled): one loop per row."""
    return _count(z, lower), _mass(z, z_max, scale)


def _count_and_mass_eager(z: torch.Tensor, z_max: torch.Tensor, lower: torch.Tensor,
                          scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager form (TOKENSAMPLER_COMPILE=0): the reference's exp, in column chunks."""
    return _count_eager(z, lower), select.kept_mass(z, z_max, torch.full_like(z_max, float("-inf")), scale)


def _count(z: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
    return (z >= lower[:, None]).sum(dim=-1)


def _count_eager(z: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
    """Column chunk by chunk: a bool sum converts its whole input to int first."""
    count = torch.zeros(z.shape[0], dtype=torch.int64, device=z.device)
    for start, stop in select.column_chunks(z):
        count += (z[:, start:stop] >= lower[:, None]).sum(dim=-1)
    return count


def winnable_count(z: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
    """int64 [R]: the ids with z >= lower (the count half of `winnable_count_and_mass`)."""
    if not ts_compile.enabled():
        return _count_eager(z, lower)
    return ts_compile.maybe_compiled("winnable_count", _count)(z, lower)


def winnable_count_and_mass(z: torch.Tensor, z_max: torch.Tensor, lower: torch.Tensor,
                            scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """z: float32 [R, V] (-inf = removed); z_max: float32 [R], finite; lower: float32 [R];
    scale: float32 [R] when the rows hold z * scale (undivided logits), else None.
    Returns (count int64 [R]: ids with z >= lower, in the rows' own units; mass float64 [R]: sum of
    exp(z / scale - z_max) over the row, within `mass_error` of the reference's sum)."""
    if not ts_compile.enabled():
        return _count_and_mass_eager(z, z_max, lower, scale)
    scale = torch.ones_like(z_max) if scale is None else scale  # x / 1 = x exactly
    return ts_compile.maybe_compiled("count_and_mass", _count_and_mass)(z, z_max, lower, scale)


def _mass(z: torch.Tensor, z_max: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.exp(z / scale[:, None] - z_max[:, None]).to(torch.float64).sum(dim=-1)


def whole_row_mass(z: torch.Tensor, z_max: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The mass half of `winnable_count_and_mass`, for the rows of a mixed block that need it."""
    if not ts_compile.enabled():
        return select.kept_mass(z, z_max, torch.full_like(z_max, float("-inf")), scale)
    scale = torch.ones_like(z_max) if scale is None else scale
    return ts_compile.maybe_compiled("whole_row_mass", _mass)(z, z_max, scale)


def mass_error(mass: torch.Tensor, vocab: int) -> torch.Tensor:
    """float64 [R]: a bound on |mass - the reference's float64 sum of the same p|."""
    return mass * MASS_RELATIVE_ERROR + vocab * SUBNORMAL_ERROR
