"""Steps 7-11 for a group of sampled rows without sorting the vocabulary: the thresholds routes.

`sample_rows` is a group's dispatcher. Its probe, `measure_rows` (or the step's, which passes the
facts in), reads the rows' values in the form `routes.Values` names: in place (z /= T, then the
+inf rule) or divided where read (the caller's logits: nothing written, z / T computed where a value
is read, bit for bit the in-place division). It gives the rows' max of z / T, `lower` = the z below
which no id can win the Gumbel argmax (`select.win_floor`, raised to min-p's floor) and a strided
estimate of the ids above it; `routes.choose_thresholds` picks the route from those facts:

- `Thresholds.LIST` (`_list_route`): the ids with z >= lower are counted (`row_stats`, compiled;
  with the mass below them when every row needs it for top-p) and gathered once, unsorted (usually
  a few thousand: LLM logits are peaked); min-p, top-k and top-p thresholds come from this list
  wherever it provably holds them (top-p from a sorted head of it), else from full-row passes
  (`select`), and the noise is computed on the list only;
- `Thresholds.TOP_K_LIST` (`_top_k_list_route`): the list of the ids above the exact k-th value;
- `Thresholds.HEAD` (`_head_route`): top-p rows with many winnable ids list the head of the row
  (the ids at or above the `top_p_head_chunks`-th largest 64-id chunk maximum); rows whose top-p
  crossing lies below the head continue, alone, on
- `Thresholds.DENSE` (`_dense_route`): flat rows, top-p by histogram, noise by the blocked pass of
  `gumbel_argmax_dense`.

A list longer than the cap hands its group on (`routes.after_overflow`). The dense route reads z / T
written out, so a group read where divided that reaches it is returned to the caller as a
`routes.Handoff` (the step then runs the group in place).

Every value compared is computed by the same float32/float64 operations as the reference on the
same inputs, or carries an error bound with an exact recheck where it could matter (the compiled
mass), so the token is the definition's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ...core.constants import NEG_INF, POS_INF
from ...core.order import saturate_posinf
from . import dense, gumbel, row_stats, select
from .config import DEFAULT, TorchStepConfig
from .indexing import column_chunks
from .routes import Draw, Filters, Handoff, RowFacts, Thresholds, Values, after_overflow, choose_thresholds
from .top_p import list_top_p, on_rows, rows_of

Listed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (values float32 [R, W], ids int64 [R, W], count [R])


@dataclass
class RowColumns:
    """Per-row parameters of a group of sampled rows (device tensors [R]) and host flags."""

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
    taken: Counter | None = None  # counts each (Thresholds, Values) run, when given (the step's record)
    any_full_row: bool = False  # some row has a full-row stage (the step runs `Thresholds.FULL_ROW`)

    def filters(self) -> Filters:
        """The host flags of the group's filters (`every_top_p` read from the device when some row has top-p)."""
        every = self.any_top_p and bool((self.top_p < 1.0).all())
        return Filters(self.any_min_p, self.any_top_k, self.any_top_p, every, self.any_full_row)

    def rows(self, rows: torch.Tensor) -> RowColumns:
        """The columns of the rows `rows` (the group's flags kept)."""
        return replace(self, temperature=self.temperature[rows], min_p=self.min_p[rows], top_k=self.top_k[rows],
                       top_p=self.top_p[rows], keys=self.keys[rows])


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


def measure_rows(z: torch.Tensor, z_max: torch.Tensor, cols: RowColumns, values: Values,
                 rows: list[int] | None = None) -> RowFacts:
    """A group's probe: the `routes.RowFacts` its thresholds route is chosen from.

    z: float32 [R, V], the group's rows after penalties (-inf = removed); read where divided, also
    a larger z of which the group is the rows `rows` (the estimate then reads their strided samples:
    no copy of the rows). z_max: float32 [R], the group's row maxima (finite, or +inf). In place, z
    is divided by T here: every in-place route starts from z / T."""
    cap = min(cols.config.candidate_cap, max(1024, z.shape[1] // 8))  # a list near the row's size: dense is leaner
    filters = cols.filters()
    if values is Values.IN_PLACE:
        assert rows is None, "an in-place group is its own z"
        scale, z_max = None, apply_temperature(z, z_max, cols.temperature)
    else:
        scale, z_max = cols.temperature, z_max / cols.temperature
        if bool(torch.isposinf(z_max).any()):
            return RowFacts(values, filters, z_max, scale, cap, overflow=True)
    lower = select.win_floor(z_max)
    if cols.any_min_p:  # every id min-p keeps lies above this bound: the list will hold them all
        lower = torch.maximum(lower, select.min_p_floor(z_max, cols.min_p))
    list_floor = lower if scale is None else undivided_floor(lower, scale)
    flat = bool((row_stats.estimated_count(z, list_floor, rows=rows) > cap).any())
    return RowFacts(values, filters, z_max, scale, cap, lower=lower, list_floor=list_floor, flat=flat)


def sample_rows(z: torch.Tensor, z_max: torch.Tensor, cols: RowColumns, *, exact_threshold: bool,
                values: Values = Values.IN_PLACE, facts: RowFacts | None = None) -> Draw | Handoff:
    """Steps 7-11 (temperature, min-p, top-k, top-p, Gumbel argmax) for R sampled rows.

    Parameters
    ----------
    z: float32 [R, V], the rows after penalties (-inf = removed).
    z_max: float32 [R], each row's max of `z` (finite, or +inf).
    cols: the rows' parameter columns, noise keys and `TorchStepConfig`.
    exact_threshold: return the exact kept threshold (processed logprobs need it).
    values: `Values.IN_PLACE` divides z by T in place; `Values.DIVIDED_WHERE_READ` (the caller's
        own logits) writes nothing and divides values where they are read.
    facts: the group's `measure_rows(z, z_max, cols, values)` when the caller has probed it.

    Returns
    -------
    `Draw(tokens int64 [R], tau float32 [R])`: the kept set of row r is {i : z_i / T >= tau_r}; with
    `exact_threshold` tau is exactly the definition's threshold, otherwise it may differ from it
    only below the winnable floor, where no id can win. Read where divided, a `Handoff` to
    `Thresholds.DENSE` instead when the group needs z / T written out (flat rows, +inf after T, a
    list over its cap): nothing was written, and the caller runs the group in place."""
    if facts is None:
        facts = measure_rows(z, z_max, cols, values)
    if facts.overflow:
        return Handoff(Thresholds.DENSE, None)
    return _run(z, facts, cols, choose_thresholds(facts), facts.lower, exact_threshold=exact_threshold)


def _run(z: torch.Tensor, facts: RowFacts, cols: RowColumns, route: Thresholds, lower: torch.Tensor, *,
         exact_threshold: bool) -> Draw | Handoff:
    """The group on `route` from the floor `lower`, each handoff followed: the whole group to the
    next route, or some rows alone (the others' draw kept)."""
    while True:
        if route is Thresholds.FULL_ROW or (route is Thresholds.DENSE and facts.values is Values.DIVIDED_WHERE_READ):
            return Handoff(route, lower)  # run by the caller (the full-row route), or in place
        if cols.taken is not None:
            cols.taken[route, facts.values] += 1
        outcome = _ROUTES[route](z, facts, cols, lower, exact_threshold=exact_threshold)
        if isinstance(outcome, Draw):
            return outcome
        if outcome.rows is None or outcome.done is None:
            route, lower = outcome.route, outcome.lower
            continue
        rows = outcome.rows
        part = replace(facts, z_max=facts.z_max[rows], scale=rows_of(facts.scale, rows), lower=facts.lower[rows],
                       list_floor=facts.list_floor[rows])
        rest = _run(z[rows], part, cols.rows(rows), outcome.route, outcome.lower[rows], exact_threshold=exact_threshold)
        if isinstance(rest, Handoff):
            return Handoff(rest.route, outcome.lower)
        tokens, tau = outcome.done
        tokens[rows] = rest.tokens
        return Draw(tokens, tau.index_put((rows,), rest.tau))


def _list_route(z: torch.Tensor, facts: RowFacts, cols: RowColumns, lower: torch.Tensor, *,
                exact_threshold: bool) -> Draw | Handoff:
    """`Thresholds.LIST`: every id above the winnable floor listed (with the tail mass from the same
    pass when every row is a top-p row and nothing else filters)."""
    f, count, tail = facts.filters, None, None
    if f.every_top_p and not f.top_k and not f.min_p:
        count, tail = row_stats.winnable_count_and_tail(z, facts.z_max, facts.list_floor, facts.scale,
                                                        config=cols.config, compiled=cols.compiled)  # one pass
    listed = select.gather_candidates(z, facts.list_floor, facts.cap, count=count, scale=facts.scale,
                                      config=cols.config, compiled=cols.compiled)
    if listed is None:
        return Handoff(after_overflow(Thresholds.LIST, f), lower)
    tau, _ = _list_thresholds(z, facts, cols, listed, lower, facts.list_floor, tail, exact_threshold=exact_threshold)
    return _draw_listed(listed, tau, cols.keys)


def _top_k_list_route(z: torch.Tensor, facts: RowFacts, cols: RowColumns, lower: torch.Tensor, *,
                      exact_threshold: bool) -> Draw | Handoff:
    """`Thresholds.TOP_K_LIST`: the exact k-th value bounds the list to the top-k set."""
    scale = facts.scale
    kth = select.top_k_threshold(z, cols.top_k)[0]  # division is monotone: the k-th of z / T
    lower = torch.maximum(lower, kth if scale is None else kth / scale)
    list_floor = lower if scale is None else undivided_floor(lower, scale)
    listed = select.gather_candidates(z, list_floor, facts.cap, scale=scale, config=cols.config,
                                      compiled=cols.compiled)
    if listed is None:
        return Handoff(after_overflow(Thresholds.TOP_K_LIST, facts.filters), lower)
    tau, _ = _list_thresholds(z, facts, cols, listed, lower, list_floor, None, exact_threshold=exact_threshold)
    return _draw_listed(listed, tau, cols.keys)


def _head_route(z: torch.Tensor, facts: RowFacts, cols: RowColumns, lower: torch.Tensor, *,
                exact_threshold: bool) -> Draw | Handoff:
    """`Thresholds.HEAD` (z / T in place): many winnable ids, but top-p may keep a few: the ids at or
    above the `top_p_head_chunks`-th largest chunk maximum are listed, and a row is done if its top-p
    crossing lies in them. The others continue on the dense route on their rows alone (a flat row
    does not send its group's other rows down the dense route)."""
    config = cols.config
    head_lower = torch.maximum(lower, select.head_floor(z, config.top_p_head_chunks))
    count, tail = row_stats.winnable_count_and_tail(z, facts.z_max, head_lower, config=config, compiled=cols.compiled)
    listed = select.gather_candidates(z, head_lower, facts.cap, count=count, config=config, compiled=cols.compiled)
    if listed is None:
        return Handoff(after_overflow(Thresholds.HEAD, facts.filters), lower)
    tau, found = _list_thresholds(z, facts, cols, listed, head_lower, head_lower, tail,
                                  exact_threshold=exact_threshold)
    if bool(found.all()):
        return _draw_listed(listed, tau, cols.keys)
    if not bool(found.any()):
        return Handoff(Thresholds.DENSE, lower)
    kept = found.nonzero().squeeze(-1)
    values, ids, _ = listed
    noisy, kept_ids = _kept_only(values[kept].masked_fill(values[kept] < tau[kept, None], NEG_INF), ids[kept])
    tokens = torch.empty_like(cols.keys)
    tokens[kept] = gumbel.gumbel_argmax_candidates(noisy, kept_ids, cols.keys[kept])
    return Handoff(Thresholds.DENSE, lower, rows=(~found).nonzero().squeeze(-1), done=Draw(tokens, tau))


def _dense(z: torch.Tensor, facts: RowFacts, cols: RowColumns, lower: torch.Tensor, *,
           exact_threshold: bool) -> Draw:
    """`Thresholds.DENSE` (z / T in place): `_dense_route` (its thresholds are exact)."""
    return Draw(*_dense_route(z, facts.z_max, lower, cols))


_ROUTES: dict[Thresholds, Callable[..., Draw | Handoff]] = {  # (z, facts, cols, lower, *, exact_threshold)
    Thresholds.LIST: _list_route,
    Thresholds.TOP_K_LIST: _top_k_list_route,
    Thresholds.HEAD: _head_route,
    Thresholds.DENSE: _dense,
}


def _list_thresholds(z: torch.Tensor, facts: RowFacts, cols: RowColumns, listed: Listed, lower: torch.Tensor,
                     list_floor: torch.Tensor, tail: torch.Tensor | None, *, exact_threshold: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tau, found) of a listed group: min-p, top-k and top-p raised into one threshold per row from
    the unsorted list (every id >= lower; exactly the ids >= list_floor in z's own units), with
    full-row passes for the rows whose threshold may lie below it. found: the top-p crossing lies in
    the list (None without top-p)."""
    values, _, count = listed
    z_max, scale = facts.z_max, facts.scale
    smallest = torch.where(values == NEG_INF, POS_INF, values).amin(dim=-1)  # listed values are finite
    need_exact = (cols.top_p < 1.0) | exact_threshold  # top-p's total mass needs the exact tau below it
    tau = torch.full_like(z_max, NEG_INF)
    below = []  # (rows whose threshold lies at or below the list's smallest value, the full-row pass)
    if cols.any_min_p:
        tau_min_p, beyond = _min_p_on_list(values, smallest, z_max, cols.min_p, need_exact)
        tau = torch.maximum(tau, tau_min_p)
        below.append((beyond, lambda rows: _min_p_full_row(z, rows, scale, z_max[rows], cols.min_p[rows],
                                                           cols.config.column_chunk)))
    if cols.any_top_k:
        tau_top_k, beyond = _top_k_on_list(values, count, cols.top_k, need_exact)
        tau = torch.maximum(tau, tau_top_k)
        below.append((beyond, lambda rows: on_rows(lambda zr, kr: select.top_k_threshold(zr, kr)[0],
                                                   z, rows, scale, cols.top_k[rows])))
    for beyond, full_row in below:
        # such a threshold is <= the smallest listed value: it matters only where no other filter's
        # exact threshold already reaches that value
        beyond = beyond & (tau < smallest)
        if bool(beyond.any()):
            rows = beyond.nonzero().squeeze(-1)
            tau = tau.index_put((rows,), torch.maximum(tau[rows], full_row(rows)))
    if not cols.any_top_p:
        return tau, None
    return list_top_p(z, z_max, values, tau, lower, list_floor, tail, cols.top_p, exact_threshold=exact_threshold,
                      scale=scale, config=cols.config, compiled=cols.compiled)


def _min_p_on_list(values: torch.Tensor, smallest: torch.Tensor, z_max: torch.Tensor, min_p: torch.Tensor,
                   need_exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tau, beyond): min-p's threshold from the list (-inf where off), and the rows `need_exact`
    where it may lie below the list (the smallest listed id passes): there tau is -inf, the caller's
    full-row pass gives it where it matters."""
    p = torch.exp(values - z_max[:, None])
    tau_list = torch.where(p >= min_p[:, None], values, POS_INF).amin(dim=-1)
    beyond = (min_p > 0) & (tau_list <= smallest) & need_exact
    return tau_list.masked_fill_((min_p <= 0) | beyond, NEG_INF), beyond


def _min_p_full_row(z: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None, z_max: torch.Tensor,
                    min_p: torch.Tensor, chunk: int) -> torch.Tensor:
    """`select.min_p_threshold` of the rows `rows` of z / scale, column chunk by column chunk: its
    three float32 temporaries hold at most `chunk` elements and an eighth of the rows each (a few
    rows, B = 1 above all, would otherwise make them a large part of a logits buffer)."""
    zr = rows_of(z, rows)
    tau = torch.full_like(z_max, POS_INF)
    for start, stop in column_chunks(zr, min(chunk, max(1024, zr.numel() // 8))):
        part = zr[:, start:stop] if scale is None else zr[:, start:stop] / scale[rows][:, None]
        tau = torch.minimum(tau, select.min_p_threshold(part, z_max, min_p))
    return tau


def _top_k_on_list(values: torch.Tensor, count: torch.Tensor, k: torch.Tensor, need_exact: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tau, beyond): top-k's threshold from the list where it holds k ids (-inf where off or
    beyond), and the rows `need_exact` whose k-th largest lies below the list (the caller's
    full-row pass gives it where it matters)."""
    inside = k <= count
    largest = torch.topk(values, int(k.clamp(max=values.shape[-1]).max()), dim=-1).values
    tau_list = largest.gather(-1, (k - 1).clamp(min=0, max=largest.shape[-1] - 1)[:, None]).squeeze(-1)
    tau_list = torch.where(inside, tau_list, NEG_INF)
    beyond = (k > 0) & ~inside & need_exact
    return tau_list.masked_fill_(k <= 0, NEG_INF), beyond


def _draw_listed(listed: Listed, tau: torch.Tensor, keys: torch.Tensor) -> Draw:
    """The Gumbel argmax over the listed ids with z / T >= tau."""
    values, ids, _ = listed
    noisy, ids = _kept_only(values.masked_fill(values < tau[:, None], NEG_INF), ids)
    return Draw(gumbel.gumbel_argmax_candidates(noisy, ids, keys), tau)


def _kept_only(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The list narrowed to its kept entries (values > -inf) when they are a small part of it: the
    noise is then computed for the kept ids only (top-k, peaked top-p)."""
    kept = int((values > NEG_INF).sum(dim=-1).max()) if values.numel() else 0
    if kept * 4 > values.shape[-1]:
        return values, ids
    top = torch.topk(values, max(kept, 1), dim=-1)
    return top.values, ids.gather(-1, top.indices)


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
