"""Steps 7-11 for a block of sampled rows without sorting the vocabulary.

`sample_rows` divides the rows by their temperature in place, then:

1. `lower` = the z below which no id can win the Gumbel argmax (`select.win_floor`);
2. the ids with z >= lower are gathered once (usually a few thousand: LLM logits are peaked) and
   sorted; min-p, top-k and top-p thresholds come from this list wherever it provably holds them,
   else from full-row passes (`select`), and the noise is computed on the list only;
3. rows with too many winnable ids (flat logits) take the dense route: top-p by histogram, noise
   by the blocked pass of `gumbel_argmax_dense`.

Every value compared is computed by the same float32/float64 operations as the reference on the
same inputs, so the token is the definition's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import gumbel, select

NEG_INF = float("-inf")
CANDIDATE_CAP = 16384  # largest candidate list per row before the dense route is used


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
                candidate_cap: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """z: float32 [R, V] after penalties (each row with a finite or +inf max `z_max`); modified in
    place to z / T. Returns (tokens int64 [R], tau float32 [R]). With `exact_threshold` tau is the
    exact kept threshold (kept = z >= tau, finite), as processed logprobs need; otherwise tau may
    differ from it only below the winnable floor, where it cannot change the token."""
    cap = CANDIDATE_CAP if candidate_cap is None else candidate_cap
    cap = min(cap, max(1024, z.shape[1] // 8))  # a list near the row's size: the dense route is leaner
    z_max = apply_temperature(z, z_max, cols.temperature)
    lower = select.win_floor(z_max)
    if cols.any_min_p:  # every id min-p keeps lies above this bound: the list will hold them all
        lower = torch.maximum(lower, select.min_p_floor(z_max, cols.min_p))
    ordered = cols.any_top_p  # top-p scans the list from the top; nothing else needs an order
    listed = select.gather_candidates(z, lower, cap, sort=ordered)
    if listed is None and cols.any_top_k:  # the exact k-th value bounds the list to the top-k set
        lower = torch.maximum(lower, select.top_k_threshold(z, cols.top_k)[0])
        listed = select.gather_candidates(z, lower, cap, sort=ordered)
    if listed is None:
        return _dense_route(z, z_max, lower, cols)
    values, ids, count = listed
    smallest = torch.where(values == NEG_INF, float("inf"), values).amin(dim=-1)  # listed values are finite
    top_p_rows = cols.top_p < 1.0
    need_exact = top_p_rows | exact_threshold  # top-p's total mass needs the exact tau below it
    tau = torch.full_like(z_max, NEG_INF)
    if cols.any_min_p:
        p = torch.exp(values - z_max[:, None])
        tau_list = torch.where(p >= cols.min_p[:, None], values, float("inf")).amin(dim=-1)
        # if the smallest listed id passes, the threshold may lie below the list
        beyond = (cols.min_p > 0) & (tau_list <= smallest) & need_exact
        if bool(beyond.any()):
            rows = beyond.nonzero().squeeze(-1)
            tau_list = tau_list.index_put((rows,), _on_rows(select.min_p_threshold, z, rows, z_max[rows],
                                                            cols.min_p[rows]))
        tau = torch.maximum(tau, tau_list.masked_fill_(cols.min_p <= 0, NEG_INF))
    if cols.any_top_k:
        k = cols.top_k
        inside = k <= count
        largest = values if ordered else torch.topk(values, int(k.clamp(max=values.shape[-1]).max()), dim=-1).values
        tau_list = largest.gather(-1, (k - 1).clamp(min=0, max=largest.shape[-1] - 1)[:, None]).squeeze(-1)
        tau_list = torch.where(inside, tau_list, NEG_INF)
        beyond = (k > 0) & ~inside & need_exact
        if bool(beyond.any()):
            rows = beyond.nonzero().squeeze(-1)
            tau_list = tau_list.index_put((rows,), _on_rows(lambda zr, kr: select.top_k_threshold(zr, kr)[0],
                                                            z, rows, k[rows]))
        tau = torch.maximum(tau, tau_list.masked_fill_(k <= 0, NEG_INF))
    if cols.any_top_p:
        total = torch.where(values >= tau[:, None], torch.exp(values - z_max[:, None]), 0.0).sum(
            dim=-1, dtype=torch.float64)
        full_row = (tau < lower) & top_p_rows  # kept ids below the list: the total needs the whole row
        if bool(full_row.any()):
            rows = full_row.nonzero().squeeze(-1)
            total = total.index_put((rows,), _on_rows(select.kept_mass, z, rows, z_max[rows], tau[rows]))
        bound = cols.top_p * total
        tau_p, found = select.top_p_from_candidates(values, z_max, tau, bound)
        tau = torch.where(top_p_rows & found, torch.maximum(tau, tau_p), tau)
        if exact_threshold:
            tau = _histogram_rows(z, z_max, tau, bound, top_p_rows & ~found)
    noisy = values.masked_fill(values < tau[:, None], NEG_INF)
    return gumbel.gumbel_argmax_candidates(noisy, ids, cols.keys), tau


def _on_rows(fn, z: torch.Tensor, rows: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
    """fn on the rows `rows` of z only (all of them without a copy when that is every row)."""
    if rows.numel() == z.shape[0]:
        return fn(z, *args)
    return fn(z[rows], *args)


def _dense_route(z: torch.Tensor, z_max: torch.Tensor, lower: torch.Tensor,
                 cols: RowColumns) -> tuple[torch.Tensor, torch.Tensor]:
    """Thresholds by full-row passes and the noise over the whole row (flat logits)."""
    tau = torch.full_like(z_max, NEG_INF)
    if cols.any_min_p:
        tau = torch.maximum(tau, select.min_p_threshold(z, z_max, cols.min_p))
    if cols.any_top_k:
        tau = torch.maximum(tau, select.top_k_threshold(z, cols.top_k)[0])
    if cols.any_top_p:  # the histogram pass also gives the kept mass
        tau = _histogram_rows(z, z_max, tau, None, cols.top_p < 1.0, cols.top_p)
    return gumbel.gumbel_argmax_dense(z, torch.maximum(tau, lower), cols.keys), tau


def _histogram_rows(z: torch.Tensor, z_max: torch.Tensor, tau: torch.Tensor, bound: torch.Tensor | None,
                    rows_mask: torch.Tensor, top_p: torch.Tensor | None = None) -> torch.Tensor:
    """tau with the rows of `rows_mask` raised to their top-p threshold found by histogram (bound
    None: top_p times the mass the histogram pass sums)."""
    if not bool(rows_mask.any()):
        return tau
    rows = rows_mask.nonzero().squeeze(-1)
    tau_p = _on_rows(lambda zr, *a: select.top_p_by_histogram(zr, *a), z, rows, z_max[rows], tau[rows],
                     None if bound is None else bound[rows], None if top_p is None else top_p[rows])
    tau = tau.clone()
    tau[rows] = torch.maximum(tau[rows], tau_p)
    return tau
