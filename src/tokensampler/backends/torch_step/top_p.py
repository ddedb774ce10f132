"""Top-p's threshold from a candidate list (`list_top_p`), for the list routes of `candidates`.

The total kept mass comes from the list when the threshold lies inside it; when nothing else
removed ids, from the list's mass plus the tail below the list (compiled, within
`row_stats.mass_error`, with an exact recheck of the rows whose answer changes inside that bound);
else from an exact full-row pass. The threshold is searched on a sorted head of the list first.
Rows whose crossing lies below the list get it from the histogram where the exact threshold is
asked for (processed logprobs).
"""

from __future__ import annotations

from typing import Callable

import torch

from . import row_stats, select
from .config import DEFAULT, TorchStepConfig


def list_top_p(z: torch.Tensor, z_max: torch.Tensor, values: torch.Tensor, tau: torch.Tensor, lower: torch.Tensor,
               list_floor: torch.Tensor, tail: torch.Tensor | None, top_p: torch.Tensor, *, exact_threshold: bool,
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
            tail[rows] = row_stats.tail_mass(rows_of(z, rows), z_max[rows], list_floor[rows],
                                             rows_of(scale, rows), config, compiled)
        listed = torch.exp(values - z_max[:, None]).to(torch.float64).sum(dim=-1)  # -inf padding: 0
        total = torch.where(whole_row, listed + tail, total)
        error = torch.where(whole_row, row_stats.mass_error(tail, z.shape[1]), 0.0)
    partial = below_list & ~whole_row
    if bool(partial.any()):
        rows = partial.nonzero().squeeze(-1)
        total = total.index_put((rows,), select.kept_mass(rows_of(z, rows), z_max[rows], tau[rows],
                                                          rows_of(scale, rows), config))
    tau_p, found, unsure = _top_p_search(values, head, z_max, tau, top_p, total, error, top_p_rows,
                                         exact_threshold=exact_threshold)
    if bool(unsure.any()):
        rows = unsure.nonzero().squeeze(-1)
        total = total.index_put((rows,), select.kept_mass(rows_of(z, rows), z_max[rows], tau[rows],
                                                          rows_of(scale, rows), config))
        error = error.masked_fill(unsure, 0.0)
        tau_p, found, _ = _top_p_search(values, head, z_max, tau, top_p, total, error, top_p_rows,
                                        exact_threshold=exact_threshold)
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
                  top_p: torch.Tensor, total: torch.Tensor, error: torch.Tensor, top_p_rows: torch.Tensor, *,
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


def _histogram_rows(z: torch.Tensor, z_max: torch.Tensor, tau: torch.Tensor, bound: torch.Tensor | None,
                    rows_mask: torch.Tensor, top_p: torch.Tensor | None = None,
                    config: TorchStepConfig = DEFAULT) -> torch.Tensor:
    """tau with the rows of `rows_mask` raised to their top-p threshold found by histogram (bound
    None: top_p times the mass the histogram pass sums)."""
    if not bool(rows_mask.any()):
        return tau
    rows = rows_mask.nonzero().squeeze(-1)
    tau_p = on_rows(lambda zr, *a: select.top_p_by_histogram(zr, *a, config=config), z, rows, None, z_max[rows],
                     tau[rows], None if bound is None else bound[rows], None if top_p is None else top_p[rows])
    tau = tau.clone()
    tau[rows] = torch.maximum(tau[rows], tau_p)
    return tau

def rows_of(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """The rows `rows` of t (t itself, no copy, when that is every row; None stays None)."""
    if t is None or rows.numel() == t.shape[0]:
        return t
    return t[rows]


def on_rows(fn: Callable[..., torch.Tensor], z: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None,
            *args: torch.Tensor) -> torch.Tensor:
    """fn on the rows `rows` of z / scale (z itself when scale is None)."""
    zr = rows_of(z, rows)
    return fn(zr if scale is None else zr / scale[rows][:, None], *args)
