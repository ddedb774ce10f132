"""Steps 7-11 for a block of sampled rows without sorting the vocabulary.

`sample_rows` divides the rows by their temperature in place, finds each row's kept threshold
(`ops.select`), and draws the Gumbel argmax over the kept ids that can still win:

- rows whose winnable kept ids are few (the usual case: LLM logits are peaked) get a candidate
  list from one `topk` of that size, on which top-p and the noise are computed;
- rows with many winnable ids (flat logits) get top-p from a histogram pass and the noise from
  a dense blocked pass (`gumbel_argmax_dense`).

Every step reproduces the reference's float32/float64 operations on the same values, so the
token is the definition's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import gumbel, select

NEG_INF = float("-inf")
CANDIDATE_CAP = 8192  # largest candidate list gathered by topk before the dense route is used


@dataclass
class RowColumns:
    """Per-row parameters of a block of sampled rows (device tensors [R]) and host flags."""

    temperature: torch.Tensor  # float32
    min_p: torch.Tensor  # float32, 0 = off
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # float64, 1 = off
    keys: torch.Tensor  # int64 row keys of the noise
    any_min_p: bool
    any_top_k: bool
    any_top_p: bool


def apply_temperature(z: torch.Tensor, z_max: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """z /= T in place (float32 division, as the reference), then the +inf rule on rows where the
    division overflowed. Returns the rows' new max (fl(max z / T), division being monotone)."""
    z.div_(temperature[:, None])
    zt_max = z_max / temperature
    overflow = torch.isposinf(zt_max)
    if bool(overflow.any()):
        rows = overflow.nonzero().squeeze(-1)
        block = z[rows]
        z[rows] = torch.where(torch.isposinf(block), 0.0, NEG_INF)
        zt_max = zt_max.masked_fill(overflow, 0.0)
    return zt_max


def sample_rows(z: torch.Tensor, z_max: torch.Tensor, cols: RowColumns, *, exact_threshold: bool,
                candidate_cap: int = CANDIDATE_CAP) -> tuple[torch.Tensor, torch.Tensor]:
    """z: float32 [R, V] after penalties (every row has a finite or +inf max z_max [R]); modified in
    place to z / T. Returns (tokens int64 [R], tau float32 [R]). With `exact_threshold` tau is the
    exact kept threshold (kept = z >= tau, finite), as processed logprobs need; otherwise tau may
    be lower than it where the difference cannot change the token."""
    z_max = apply_temperature(z, z_max, cols.temperature)
    tau = torch.full_like(z_max, NEG_INF)
    if cols.any_min_p:
        tau = torch.maximum(tau, select.min_p_threshold(z, z_max, cols.min_p))
    if cols.any_top_k:
        tau = torch.maximum(tau, select.top_k_threshold(z, cols.top_k)[0])
    lower = torch.maximum(tau, select.win_floor(z_max))
    bound = None
    top_p_rows = cols.top_p < 1.0
    if cols.any_top_p:
        bound = cols.top_p * select.kept_mass(z, z_max, tau)
    width = int((z >= lower[:, None]).sum(dim=-1).max())
    if width <= candidate_cap:
        values, ids = torch.topk(z, max(width, 1), dim=-1, sorted=True)
        if bound is not None:
            tau_p, found = select.top_p_from_candidates(values, z_max, tau, bound)
            tau = torch.where(top_p_rows & found, torch.maximum(tau, tau_p), tau)
            if exact_threshold:
                tau = _histogram_rows(z, z_max, tau, bound, top_p_rows & ~found)
        values = values.masked_fill(values < torch.maximum(tau, lower)[:, None], NEG_INF)
        return gumbel.gumbel_argmax_candidates(values, ids, cols.keys), tau
    if bound is not None:
        tau = _histogram_rows(z, z_max, tau, bound, top_p_rows)
    return gumbel.gumbel_argmax_dense(z, torch.maximum(tau, lower), cols.keys), tau


def _histogram_rows(z: torch.Tensor, z_max: torch.Tensor, tau: torch.Tensor, bound: torch.Tensor,
                    rows_mask: torch.Tensor) -> torch.Tensor:
    """tau with the rows of `rows_mask` raised to their top-p threshold found by histogram."""
    if not bool(rows_mask.any()):
        return tau
    rows = rows_mask.nonzero().squeeze(-1)
    tau_p = select.top_p_by_histogram(z[rows], z_max[rows], tau[rows], bound[rows])
    tau = tau.clone()
    tau[rows] = torch.maximum(tau[rows], tau_p)
    return tau
