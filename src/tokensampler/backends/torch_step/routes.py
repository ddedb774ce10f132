"""The torch step's routes, named, and the one place each is chosen.

A step runs on one `Route` (the whole call), and each group of its sampled rows gets its
thresholds by one `Thresholds` route, reading its values in one of the two forms of `Values`:

- `Route.PLAIN_GREEDY`: the first maximum of the caller's logits, nothing copied;
- `Route.DIRECT`: every row on the caller's logits (cell edits written and restored), the sampled
  rows read in `Values.DIVIDED_WHERE_READ` form;
- `Route.FUSED`: every row on the caller's logits (cell edits written and restored), steps 6-11 of
  each row in one C++ pass (`fused.sample_rows`); rows it cannot finish exactly (NaN or +inf, no id
  left, a row too flat for its list, a top-p crossing its tail bound leaves undecided) send the call
  on to the other routes (`Continue`), the logits as they were;
- `Route.BLOCK`: row blocks copied into the workspace and edited there, the sampled rows divided
  `Values.IN_PLACE` (or, in a block with a token bitmask, divided where read);
- `Thresholds.LIST`: a candidate list of the ids above the winnable floor holds the thresholds;
- `Thresholds.HEAD`: top-p rows with many winnable ids list the head of the row only;
- `Thresholds.TOP_K_LIST`: the list is bounded by the exact k-th value;
- `Thresholds.DENSE`: full-row passes (flat rows; needs `Values.IN_PLACE`);
- `Thresholds.FULL_ROW`: rows with a full-row stage (`core.plan.FULL_ROW_STAGES`: dynamic
  temperature, top-n-sigma, typical-p, epsilon, eta, XTC), `extra_filters.draw_rows` run by the
  step on the rows in place; chosen from the parameters alone (`plan_route`).

What a choice needs from the data is measured once by a probe: `StepFacts` for the call
(`TorchStep._probe`: the row maxima after the cell edits, NaN or +inf present, a row emptied,
z / T underflowing a row, and each sampled group's `RowFacts`), `RowFacts` for a group of sampled
rows (`candidates.measure_rows`: z / T's maxima and their overflow, the winnable floor, the
strided flatness estimate against the candidate cap). The functions below choose from those
facts alone (pure: plan, facts, config in, a route out); the routes then run to the end, reusing
what the probe measured. Two facts are known only after a route's work: a candidate list over its
cap (`after_overflow` names where its rows continue) and the head route's top-p crossing not found
in the head (those rows continue on `Thresholds.DENSE`); a route returns them as a `Handoff`.

To add a route: a member here, the fact that selects it in the facts, the test that selects it in
the choosing function, its function in the module that runs the routes of its level (`step.py`,
`candidates.py`), and a case that provably takes it in `warmup.CASES`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Collection, NamedTuple

import torch

from ...core.plan import StepPlan
from .config import TorchStepConfig


class Route(enum.Enum):
    """The route of a whole step."""

    PLAIN_GREEDY = "plain_greedy"  # every row greedy, nothing edited: argmax of the caller's logits
    FUSED = "fused"  # every row on the caller's logits, steps 6-11 in one C++ pass per row
    DIRECT = "direct"  # every row on the caller's logits, values divided where read
    BLOCK = "block"  # row blocks through the float32 workspace


class Thresholds(enum.Enum):
    """How a group of sampled rows gets its thresholds (and its draw)."""

    LIST = "list"  # the candidate list above the winnable floor
    HEAD = "head"  # the list of the row's head (top-p rows with many winnable ids)
    TOP_K_LIST = "top_k_list"  # the list above the exact k-th value
    DENSE = "dense"  # full-row passes (flat rows)
    FULL_ROW = "full_row"  # a full-row stage (dynamic temperature, steps 10.1-10.5): `extra_filters.draw_rows`


class Values(enum.Enum):
    """How a group's values z / T are read."""

    IN_PLACE = "in_place"  # z is divided by T in place first (a copy the step owns)
    DIVIDED_WHERE_READ = "divided_where_read"  # z is left as it is and divided where read


class Draw(NamedTuple):
    """A group's result: tokens int64 [R]; tau float32 [R], the kept set of row r being
    {i : z_i / T >= tau_r} (exactly the definition's threshold where it was asked for)."""

    tokens: torch.Tensor
    tau: torch.Tensor


@dataclass(frozen=True)
class Handoff:
    """Rows of a group that continue on another thresholds route: `route`, from the floor `lower`
    (float32 [R], units of z / T). `rows`: int64 indices of those rows (None: every row), `done`:
    the draw of the group with the other rows' entries final (None when no row is done)."""

    route: Thresholds
    lower: torch.Tensor | None
    rows: torch.Tensor | None = None
    done: Draw | None = None


@dataclass(frozen=True)
class Continue:
    """A step route's work ended early: the call continues on `route` (`why` says which fact, known
    only after the work, decided it), the caller's logits as they were."""

    route: Route
    why: str


@dataclass(frozen=True)
class Filters:
    """Which filters some row of a group needs (host flags); `every_top_p`: every row has top_p < 1;
    `full_row`: some row has a full-row stage."""

    min_p: bool
    top_k: bool
    top_p: bool
    every_top_p: bool
    full_row: bool = False


@dataclass(frozen=True)
class RowFacts:
    """What a group of sampled rows' thresholds route is chosen from, and what the route reuses.

    values: how the group's values are read. z_max: float32 [R], the rows' max of z / T (the +inf
    rule applied in place). scale: T where values are divided where read (else None).
    overflow: some row's max z / T is +inf (divided where read only; the floors are then unset).
    lower: the winnable floor (raised to min-p's), units of z / T; list_floor: the same in z's own
    units. flat: the strided estimate of the ids above list_floor exceeds `cap` on some row."""

    values: Values
    filters: Filters
    z_max: torch.Tensor
    scale: torch.Tensor | None
    cap: int
    overflow: bool = False
    lower: torch.Tensor | None = None
    list_floor: torch.Tensor | None = None
    flat: bool = False


@dataclass(frozen=True)
class Layout:
    """What the caller's logits allow, known without reading a value."""

    masked: bool  # the call passes a token bitmask
    float32_cpu: bool
    separate_rows: bool  # rows do not share memory (cell edits can be written and restored)
    writable: bool  # no autograd, not an inference tensor outside inference mode

    @staticmethod
    def of(logits: torch.Tensor, *, masked: bool) -> Layout:
        """The layout of `logits` ([B, Vp])."""
        rows, width = logits.shape
        return Layout(masked=masked, float32_cpu=logits.dtype == torch.float32 and logits.device.type == "cpu",
                      separate_rows=logits.stride(1) == 1 and (rows <= 1 or logits.stride(0) >= width),
                      writable=not logits.requires_grad and (not logits.is_inference()
                                                             or torch.is_inference_mode_enabled()))


@dataclass(frozen=True)
class StepFacts:
    """What the step's route is chosen from (`TorchStep._probe`). Data facts are measured only for
    the routes the layout allows (`readable_routes`); None: not measured.

    all_valid: every row's max > -inf (NaN: not valid). finite: no NaN and no +inf in the rows.
    emptied: a cell edit left a row without an id. underflow: z / T is -inf for every id of a
    sampled row. groups: the `RowFacts` (divided where read) of each group of sampled rows."""

    layout: Layout
    all_valid: bool | None = None
    finite: bool | None = None
    emptied: bool | None = None
    underflow: bool | None = None
    groups: tuple[RowFacts, ...] | None = None


def readable_routes(plan: StepPlan, layout: Layout, config: TorchStepConfig, logprobs_mode: str,
                    cell_edits: Collection[str], fused: bool = False) -> frozenset[Route]:
    """The routes on the caller's logits the plan and layout allow (before any value is read):
    plain greedy for greedy plans with nothing to edit and no logprobs; the direct route for float32
    CPU logits whose plan's edits all have a cell form (`stages.CELL_EDITS`: not allowed ids, a
    token bitmask, min_tokens or bias), without processed logprobs (they read the edited z), and
    with separate, writable rows where there are edits (they are written in place and restored);
    the fused route where the direct route would be allowed, no row has a full-row stage, the rows
    are contiguous and `fused` (the step's C++ pass is loaded and
    `TorchStepConfig.fused_route` on). A call with a token bitmask reads the caller's logits on the
    fused route only. cell_edits: the edits with a cell form (`stages.CELL_EDITS`)."""
    allowed = {Route.PLAIN_GREEDY} if plan.plain_greedy and not plan.wants_logprobs else set()
    edits = plan.edits()
    processed = logprobs_mode.startswith("processed") and plan.wants_logprobs
    if (config.direct_route and layout.float32_cpu and all(name in cell_edits for name in edits)
            and not processed and (not edits or (layout.separate_rows and layout.writable))):
        allowed.add(Route.DIRECT)
        if fused and not plan.full_row and layout.separate_rows:
            allowed.add(Route.FUSED)  # a token bitmask is read where each value is read
    return frozenset(allowed & {Route.FUSED}) if layout.masked else frozenset(allowed)


def choose_route(plan: StepPlan, facts: StepFacts, config: TorchStepConfig, logprobs_mode: str,
                 cell_edits: Collection[str]) -> Route:
    """The step's route: plain greedy where every row is valid; else the direct route unless a fact
    rules it out (`direct_ruled_out`); else the block route."""
    allowed = readable_routes(plan, facts.layout, config, logprobs_mode, cell_edits)
    if Route.PLAIN_GREEDY in allowed and facts.all_valid:
        return Route.PLAIN_GREEDY
    if Route.DIRECT in allowed and not direct_ruled_out(facts):
        return Route.DIRECT
    return Route.BLOCK


def direct_ruled_out(facts: StepFacts) -> bool:
    """The facts that send a call the direct route allows to the block route: those of its rows
    (`rows_rule_out_direct`), or a group whose values must be written out (z / T overflowing to
    +inf, or a group too flat for a candidate list: `Thresholds.DENSE`). The probe measures the
    groups only where the rows' facts leave the direct route open."""
    if rows_rule_out_direct(facts):
        return True
    return facts.groups is None or any(group_needs_in_place(g) for g in facts.groups)


def rows_rule_out_direct(facts: StepFacts) -> bool:
    """NaN or +inf in the rows, a row emptied by a cell edit (its raw greedy id needs a clean copy),
    or a sampled row emptied by z / T."""
    return not facts.finite or bool(facts.emptied) or bool(facts.underflow)


IN_PLACE_ONLY = frozenset({Thresholds.DENSE, Thresholds.FULL_ROW})  # routes that read z / T written out


def group_needs_in_place(facts: RowFacts) -> bool:
    """A group read where divided (`facts` in that form) whose route needs z / T written out."""
    return facts.overflow or choose_thresholds(facts) in IN_PLACE_ONLY


def plan_route(filters: Filters) -> Thresholds | None:
    """The group's route where its parameters alone decide it, before any value is read: a group
    with a full-row stage takes `Thresholds.FULL_ROW`; else None (its facts decide)."""
    return Thresholds.FULL_ROW if filters.full_row else None


def choose_thresholds(facts: RowFacts) -> Thresholds:
    """A group's first thresholds route: `plan_route` where the parameters decide; else a candidate
    list where no row looks flat; flat groups with top-k the list bounded by the k-th value; flat
    groups of top-p rows (no top-k) read in place the head of the row; other flat groups the dense
    route."""
    planned = plan_route(facts.filters)
    if planned is not None:
        return planned
    if not facts.flat:
        return Thresholds.LIST
    if facts.filters.top_k:
        return Thresholds.TOP_K_LIST
    if facts.filters.every_top_p and facts.values is Values.IN_PLACE:
        return Thresholds.HEAD
    return Thresholds.DENSE


def after_overflow(route: Thresholds, filters: Filters) -> Thresholds:
    """Where a group continues when the list of `route` is longer than the cap: a group with top-k
    on the list bounded by the k-th value, every other on the dense route."""
    if route is Thresholds.LIST and filters.top_k:
        return Thresholds.TOP_K_LIST
    return Thresholds.DENSE


def reads_divided(masked: bool, processed: bool) -> bool:
    """Whether a block's sampled group may be read divided where read: in a masked block (no
    division pass) whose processed logprobs do not read z / T written out."""
    return masked and not processed


def choose_values(masked: bool, processed: bool, divided: RowFacts | None) -> Values:
    """How a block's sampled group reads its values: divided where read where `reads_divided`
    allows it and the group's facts in that form (`divided`, measured only there) do not need
    z / T written out; else in place."""
    if reads_divided(masked, processed) and divided is not None and not group_needs_in_place(divided):
        return Values.DIVIDED_WHERE_READ
    return Values.IN_PLACE
