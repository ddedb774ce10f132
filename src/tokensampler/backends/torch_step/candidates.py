"""Steps 7-11 for a block of sampled rows without sorting the vocabulary.

`sample_rows` divides the rows by their temperature (in place, or where values are read when the
rows are the caller's logits), then:

1. `lower` = the z below which no id can win the Gumbel argmax (`select.win_floor`);
2. the ids with z >= lower are counted (`row_stats`, compiled; with the mass below them when
   every row needs it for top-p; a strided estimate first sends flat rows to step 3) and
   gathered once, unsorted (usually a few thousand: LLM logits are
   peaked); min-p, top-k and top-p thresholds come from this list wherever it provably holds them
   (top-p from a sorted head of it), else from full-row passes (`select`), and the noise is
   computed on the list only;
3. rows with too many winnable ids (flat logits) take the dense route: top-p by histogram, noise
   by the blocked pass of `gumbel_argmax_dense`.

Every value compared is computed by the same float32/float64 operations as the reference on the
same inputs, or carries an error bound with an exact recheck where it could matter (the compiled
mass), so the token is the definition's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from ...core.constants import NEG_INF, POS_INF
from ...core.order import saturate_posinf
from . import dense, gumbel, row_stats, select
from .config import DEFAULT, TorchStepConfig


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
    dense_buffer: Callable[[int], torch.Tensor] | None = None  # float32 of >= n elements, kept by the caller
    config: TorchStepConfig = DEFAULT
    compiled: bool = False  # the full-row passes compiled (the sampler's choice; the same tokens either way)


def apply_temperature(z: torch.Tensor, z_max: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """z /= T in place (float32 division, as the reference), then the +inf rule on rows where the
    division overflowed. Returns the rows' new max (fl(max z / T), division being monotone)."""
    z.div_(temperature[:, None])
    zt_max = z_max / temperature
    overflow = torch.isposinf(zt_max)
    if bool(overflow.any()):
        rows = overflow.nonzero().squeeze(-1)
        z[rows] = saturate_posinf(z[rows])
        zt_max = zt_max.masked_fill(overflow, 0.0)
    return zt_max


def sample_rows(z: torch.Tensor, z_max: torch.Tensor, cols: RowColumns, *, exact_threshold: bool,
                in_place: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Steps 7-11 (temperature, min-p, top-k, top-p, Gumbel argmax) for R sampled rows.

    Parameters
    ----------
    z: float32 [R, V], the rows after penalties (-inf = removed). Divided by T in place unless
        `in_place` is False.
    z_max: float32 [R], each row's max of `z` (finite, or +inf).
    cols: the rows' parameter columns, noise keys and `TorchStepConfig`.
    exact_threshold: return the exact kept threshold (processed logprobs need it).
    in_place: False for the caller's own logits: nothing is written, values are divided by T where
        they are read (bit for bit the in-place division); needs a finite max and no exact_threshold.

    Returns
    -------
    (tokens int64 [R], tau float32 [R]): the kept set of row r is {i : z_i / T >= tau_r}; with
    `exact_threshold` tau is exactly the definition's threshold, otherwise it may differ from it
    only below the winnable floor, where no id can win. None (in_place=False only) when a row needs
    a full-row route (flat rows, +inf after T): the caller then runs the in-place form."""
    config, compiled = cols.config, cols.compiled
    cap = config.candidate_cap
    cap = min(cap, max(1024, z.shape[1] // 8))  # a list near the row's size: the dense route is leaner
    scale = None
    if in_place:
        z_max = apply_temperature(z, z_max, cols.temperature)
    else:
        z_max = z_max / cols.temperature
        if bool(torch.isposinf(z_max).any()):
            return None
        scale = cols.temperature
    lower = select.win_floor(z_max)
    if cols.any_min_p:  # every id min-p keeps lies above this bound: the list will hold them all
        lower = torch.maximum(lower, select.min_p_floor(z_max, cols.min_p))
    list_floor = lower if scale is None else undivided_floor(lower, scale)
    count = tail = None
    listed = None
    probably_flat = bool((row_stats.estimated_count(z, list_floor) > cap).any())
    if probably_flat and scale is not None and not cols.any_top_k:
        return None  # the caller's block route takes flat rows (they need z / T written out)
    win_lower, head_route = lower, False
    if probably_flat and cols.any_top_p and not cols.any_top_k and bool((cols.top_p < 1.0).all()):
        # many winnable ids, but top-p may keep a few: list the head of the row (the ids at or above
        # the `top_p_head_chunks`-th largest chunk maximum); kept only if the top-p crossing is in it
        head_lower = torch.maximum(lower, select.head_floor(z, config.top_p_head_chunks))
        count, tail = row_stats.winnable_count_and_tail(z, z_max, head_lower, None, config, compiled)
        listed = select.gather_candidates(z, head_lower, cap, count=count, config=config, compiled=compiled)
        if listed is not None:
            lower = list_floor = head_lower
            head_route = True
    elif not probably_flat:
        if cols.any_top_p and not cols.any_top_k and not cols.any_min_p and bool((cols.top_p < 1.0).all()):
            count, tail = row_stats.winnable_count_and_tail(z, z_max, list_floor, scale, config, compiled)  # one pass
        listed = select.gather_candidates(z, list_floor, cap, count=count, scale=scale, config=config,
                                          compiled=compiled)
    if listed is None and cols.any_top_k:  # the exact k-th value bounds the list to the top-k set
        kth = select.top_k_threshold(z, cols.top_k)[0]  # division is monotone: the k-th of z / T
        lower = torch.maximum(lower, kth if scale is None else kth / scale)
        list_floor = lower if scale is None else undivided_floor(lower, scale)
        listed = select.gather_candidates(z, list_floor, cap, scale=scale, config=config, compiled=compiled)
    if listed is None:
        return None if scale is not None else _dense_route(z, z_max, lower, cols)
    values, ids, count = listed  # unsorted: each step sorts only the prefix it reads
    smallest = torch.where(values == NEG_INF, POS_INF, values).amin(dim=-1)  # listed values are finite
    top_p_rows = cols.top_p < 1.0
    need_exact = top_p_rows | exact_threshold  # top-p's total mass needs the exact tau below it
    tau = torch.full_like(z_max, NEG_INF)
    if cols.any_min_p:
        p = torch.exp(values - z_max[:, None])
        tau_list = torch.where(p >= cols.min_p[:, None], values, POS_INF).amin(dim=-1)
        # if the smallest listed id passes, the threshold may lie below the list
        beyond = (cols.min_p > 0) & (tau_list <= smallest) & need_exact
        if bool(beyond.any()):
            rows = beyond.nonzero().squeeze(-1)
            tau_list = tau_list.index_put((rows,), _on_rows(select.min_p_threshold, z, rows, scale, z_max[rows],
                                                            cols.min_p[rows]))
        tau = torch.maximum(tau, tau_list.masked_fill_(cols.min_p <= 0, NEG_INF))
    if cols.any_top_k:
        k = cols.top_k
        inside = k <= count
        largest = torch.topk(values, int(k.clamp(max=values.shape[-1]).max()), dim=-1).values
        tau_list = largest.gather(-1, (k - 1).clamp(min=0, max=largest.shape[-1] - 1)[:, None]).squeeze(-1)
        tau_list = torch.where(inside, tau_list, NEG_INF)
        beyond = (k > 0) & ~inside & need_exact
        if bool(beyond.any()):
            rows = beyond.nonzero().squeeze(-1)
            tau_list = tau_list.index_put((rows,), _on_rows(lambda zr, kr: select.top_k_threshold(zr, kr)[0],
                                                            z, rows, scale, k[rows]))
        tau = torch.maximum(tau, tau_list.masked_fill_(k <= 0, NEG_INF))
    if cols.any_top_p:
        tau, found = _top_p(z, z_max, values, tau, lower, list_floor, tail, cols.top_p, exact_threshold, scale,
                            config, compiled)
        if head_route and not bool(found.all()):  # a kept set reaching below the head: those rows whole
            if not bool(found.any()):
                return _dense_route(z, z_max, win_lower, cols)
            return _head_or_dense(z, z_max, win_lower, cols, values, ids, tau, found)
    noisy, ids = _kept_only(values.masked_fill(values < tau[:, None], NEG_INF), ids)
    return gumbel.gumbel_argmax_candidates(noisy, ids, cols.keys), tau


def _head_or_dense(z: torch.Tensor, z_max: torch.Tensor, lower: torch.Tensor, cols: RowColumns,
                   values: torch.Tensor, ids: torch.Tensor, tau: torch.Tensor, found: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The head route's rows: those whose top-p crossing lies in the head (`found`) from the list,
    the others by the dense route on their rows alone (a flat row does not send its block's other
    rows down the dense route)."""
    kept = found.nonzero().squeeze(-1)
    noisy, kept_ids = _kept_only(values[kept].masked_fill(values[kept] < tau[kept, None], NEG_INF), ids[kept])
    tokens = torch.empty_like(cols.keys)
    tokens[kept] = gumbel.gumbel_argmax_candidates(noisy, kept_ids, cols.keys[kept])
    rows = (~found).nonzero().squeeze(-1)
    sub = replace(cols, temperature=cols.temperature[rows], min_p=cols.min_p[rows],
                  top_k=cols.top_k[rows], top_p=cols.top_p[rows], keys=cols.keys[rows])
    tokens[rows], tau_rows = _dense_route(z[rows], z_max[rows], lower[rows], sub)
    return tokens, tau.index_put((rows,), tau_rows)


def _kept_only(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The list narrowed to its kept entries (values > -inf) when they are a small part of it: the
    noise is then computed for the kept ids only (top-k, peaked top-p)."""
    kept = int((values > NEG_INF).sum(dim=-1).max()) if values.numel() else 0
    if kept * 4 > values.shape[-1]:
        return values, ids
    top = torch.topk(values, max(kept, 1), dim=-1)
    return top.values, ids.gather(-1, top.indices)


def _top_p(z: torch.Tensor, z_max: torch.Tensor, values: torch.Tensor, tau: torch.Tensor, lower: torch.Tensor,
           list_floor: torch.Tensor, tail: torch.Tensor | None, top_p: torch.Tensor, exact_threshold: bool,
           scale: torch.Tensor | None = None, config: TorchStepConfig = DEFAULT, compiled: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tau, found): tau raised to the top-p threshold of the rows with top_p < 1 (step 10), from the
    unsorted candidate list `values` (every id >= lower; exactly the ids >= list_floor in z's own
    units); found: the crossing lies in the list (rows with top_p = 1 count as found).

    The total kept mass: from the list when tau lies inside it; when nothing else removed ids, the
    list's mass plus the tail below list_floor (`tail` if given, else `row_stats.tail_mass` for the
    rows that need it; compiled, within `row_stats.mass_error`); else an exact full-row pass. With
    an uncertain total the threshold is found at both ends of the interval; rows where they differ
    get the exact total and are searched again."""
    top_p_rows = top_p < 1.0
    head = _sorted_head(values, config.top_p_head)
    total = _list_mass(values, head, z_max, tau, top_p_rows & (tau >= lower))
    below_list = (tau < lower) & top_p_rows  # kept ids below the list: the total needs the whole row
    whole_row = below_list & torch.isneginf(tau)
    error = torch.zeros_like(total)
    if bool(whole_row.any()):
        if tail is None:
            tail = torch.zeros_like(total)
            rows = whole_row.nonzero().squeeze(-1)
            tail[rows] = row_stats.tail_mass(_rows_of(z, rows), z_max[rows], list_floor[rows],
                                             _rows_of(scale, rows), config, compiled)
        listed = torch.exp(values - z_max[:, None]).to(torch.float64).sum(dim=-1)  # -inf padding: 0
        total = torch.where(whole_row, listed + tail, total)
        error = torch.where(whole_row, row_stats.mass_error(tail, z.shape[1]), 0.0)
    partial = below_list & ~whole_row
    if bool(partial.any()):
        rows = partial.nonzero().squeeze(-1)
        total = total.index_put((rows,), select.kept_mass(_rows_of(z, rows), z_max[rows], tau[rows],
                                                          _rows_of(scale, rows), config))
    tau_p, found, unsure = _top_p_search(values, head, z_max, tau, top_p, total, error, top_p_rows,
                                         exact_threshold)
    if bool(unsure.any()):
        rows = unsure.nonzero().squeeze(-1)
        total = total.index_put((rows,), select.kept_mass(_rows_of(z, rows), z_max[rows], tau[rows],
                                                          _rows_of(scale, rows), config))
        error = error.masked_fill(unsure, 0.0)
        tau_p, found, _ = _top_p_search(values, head, z_max, tau, top_p, total, error, top_p_rows,
                                        exact_threshold)
    tau = torch.where(top_p_rows & found, torch.maximum(tau, tau_p), tau)
    if exact_threshold:
        tau = _histogram_rows(z, z_max, tau, top_p * total, top_p_rows & ~found, config=config)
    return tau, found | ~top_p_rows


def _sorted_head(values: torch.Tensor, width: int) -> torch.Tensor:
    """The `width` largest values of each row, descending (the whole list, sorted, if shorter)."""
    if width < values.shape[-1]:
        return torch.topk(values, width, dim=-1).values
    return torch.sort(values, dim=-1, descending=True).values


def _list_mass(values: torch.Tensor, head: torch.Tensor, z_max: torch.Tensor, tau: torch.Tensor,
               needed: torch.Tensor) -> torch.Tensor:
    """float64 [R]: the mass of the listed ids with z >= tau, on the rows `needed` (others: the
    head's part only); from the sorted head on rows whose kept ids all lie in it (tau above the
    head's last value), from the whole list elsewhere."""
    p_head = torch.where(head >= tau[:, None], torch.exp(head - z_max[:, None]), 0.0)
    total = p_head.to(torch.float64).sum(dim=-1)
    beyond = (head[:, -1] >= tau) & needed & (head.shape[-1] < values.shape[-1])
    if bool(beyond.any()):
        rows = beyond.nonzero().squeeze(-1)
        listed = values[rows]
        p = torch.where(listed >= tau[rows, None], torch.exp(listed - z_max[rows, None]), 0.0)
        total[rows] = p.to(torch.float64).sum(dim=-1)
    return total


def _top_p_search(values: torch.Tensor, head: torch.Tensor, z_max: torch.Tensor, tau: torch.Tensor,
                  top_p: torch.Tensor, total: torch.Tensor, error: torch.Tensor, top_p_rows: torch.Tensor,
                  exact_threshold: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tau_p, found, unsure): the threshold for the bound top_p * total, searched on the sorted
    head of the list (the whole list for rows whose bound lies past it), and the rows whose answer
    changes somewhere in top_p * [total - error, total + error]."""
    low_bound, high_bound = top_p * (total - error), top_p * (total + error)
    while True:
        mass_ge = select.masses_from_top(head, z_max, tau)
        tau_low, found_low = select.top_p_at(head, mass_ge, low_bound)
        tau_high, found_high = select.top_p_at(head, mass_ge, high_bound)
        if head.shape[-1] == values.shape[-1] or bool((found_high | ~top_p_rows).all()):
            break
        head = _sorted_head(values, values.shape[-1])
    unsure = (found_low != found_high) | (found_high & (tau_low != tau_high))
    if exact_threshold:  # the histogram search past the list needs the exact bound
        unsure |= ~found_high
    return tau_high, found_high, unsure & top_p_rows & (error > 0)


def _rows_of(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """The rows `rows` of t (t itself, no copy, when that is every row; None stays None)."""
    if t is None or rows.numel() == t.shape[0]:
        return t
    return t[rows]


def _on_rows(fn, z: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None, *args: torch.Tensor
             ) -> torch.Tensor:
    """fn on the rows `rows` of z / scale (z itself when scale is None)."""
    zr = _rows_of(z, rows)
    return fn(zr if scale is None else zr / scale[rows][:, None], *args)


def undivided_floor(lower: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [R]: a bound L on undivided values such that every z with fl(z / scale) >= lower
    has z >= L (a little below lower * scale: ids between the two only lengthen the list, which
    stays every id above one value)."""
    wide = lower.to(torch.float64)
    wide = (wide - wide.abs() * 2.0**-20) * scale.to(torch.float64) - 2.0**-100
    return torch.nextafter(wide.to(torch.float32), torch.tensor(NEG_INF))


def _dense_route(z: torch.Tensor, z_max: torch.Tensor, lower: torch.Tensor, cols: RowColumns
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Thresholds by full-row passes and the noise over the whole row (flat logits). With top-p
    rows: `dense.sample_dense`."""
    tau = torch.full_like(z_max, NEG_INF)
    if cols.any_min_p:
        tau = torch.maximum(tau, select.min_p_threshold(z, z_max, cols.min_p))
    if cols.any_top_k:
        tau = torch.maximum(tau, select.top_k_threshold(z, cols.top_k)[0])
    if not cols.any_top_p:
        return gumbel.gumbel_argmax_dense(z, torch.maximum(tau, lower), cols.keys, cols.config.dense_block,
                                          cols.compiled), tau
    buffer = None if cols.dense_buffer is None else cols.dense_buffer(z.numel())
    return dense.sample_dense(z, z_max, lower, tau, cols.top_p, cols.keys, p_buffer=buffer, config=cols.config,
                              compiled=cols.compiled)


def _histogram_rows(z: torch.Tensor, z_max: torch.Tensor, tau: torch.Tensor, bound: torch.Tensor | None,
                    rows_mask: torch.Tensor, top_p: torch.Tensor | None = None,
                    config: TorchStepConfig = DEFAULT) -> torch.Tensor:
    """tau with the rows of `rows_mask` raised to their top-p threshold found by histogram (bound
    None: top_p times the mass the histogram pass sums)."""
    if not bool(rows_mask.any()):
        return tau
    rows = rows_mask.nonzero().squeeze(-1)
    tau_p = _on_rows(lambda zr, *a: select.top_p_by_histogram(zr, *a, config=config), z, rows, None, z_max[rows],
                     tau[rows], None if bound is None else bound[rows], None if top_p is None else top_p[rows])
    tau = tau.clone()
    tau[rows] = torch.maximum(tau[rows], tau_p)
    return tau
