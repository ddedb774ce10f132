"""`TorchStep`: steps 1-12 of the definition in torch, without sorting the vocabulary.

The step is a dispatcher (`TorchStep._sample`): a probe (`_probe`) measures what the choice needs,
`routes.choose_route` picks one `routes.Route` for the call from the plan, those facts and the
config, and the route's function runs it to the end:

- `Route.PLAIN_GREEDY` (`_plain_greedy`): every row greedy with nothing to remove or add: the first
  maximum of the caller's logits, found by the probe's own read (`first_argmax`), no copy;
- `Route.DIRECT` (`_direct`): float32 batches whose edits all have a cell form (bad words,
  penalties), read on the caller's logits: the cells written by the probe (`stages.edit_cells`)
  and restored before the step returns, each group of sampled rows read divided where read;
- `Route.BLOCK` (`_block_route`): everything else, and calls the probe's facts rule out of the
  direct route (NaN or +inf, a row emptied, z / T underflowing a row, a group too flat for a
  candidate list, z / T overflowing): row blocks of about `TorchStepConfig.block_elements` logits,
  each copied once into a reused float32 workspace and finished while it is in cache.

The one decision known only after the direct route's work, a candidate list longer than its cap
(the probe's flatness estimate is strided), is the direct route's `routes.Continue`: the call
continues on the block route, the logits as they were. Each group of sampled rows gets its
thresholds by the routes of `candidates` (`routes.Thresholds`). The step counts every route it
runs in `routes_taken` (warm-up reads it). The pipeline (docs/cpu-fast-path.md):

1. float32 logits, padding and NaN removed                     `stages.clean_logits` (block route)
3.-5. the plan's edits (allowed ids, the call's token bitmask, bad words, stop ids below
   min_tokens, logit bias, penalties), each one function of   `stages.apply_edits` (block route),
   `stages`, in the definition's order                        `stages.edit_cells` (direct route)
6. greedy rows: lowest id among the maxima                      `first_argmax`
7.-11. temperature, min-p, top-k, top-p as one threshold per row, Gumbel argmax with exact noise
   only where a token can still win                             `stages.filter_and_draw`
2./12. raw or processed logprobs, rows that asked               `logprobs.gather_logprobs`

13. the history update                                         `SamplerState.record_tokens`

On a CPU the step reads small per-row results back to choose routes. The sizes are a `TorchStepConfig`.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from ...core.constants import NEG_INF
from ...core.output import LogprobsOutput, SamplerOutput
from ...core.params import SamplingParams
from ...core.plan import StepPlan, plan_step
from ...core.threads import single_threaded, thread_count_owned
from ...state import SamplerState
from . import candidates, extra_filters, fused, logprobs, masking, routes, stages
from .argmax import block_maxima, first_argmax
from .config import DEFAULT, TorchStepConfig
from .routes import Handoff, Route, RowFacts, Thresholds, Values


@dataclass
class Group:
    """A group of sampled rows of the direct route: the rows, their columns, their facts."""

    rows: list[int]
    cols: candidates.RowColumns
    facts: RowFacts


@dataclass
class Probe:
    """What `TorchStep._probe` measured on the caller's logits, for the choice and the routes.

    z: the logits' [B, V] view (None: nothing was read). undo: the cells written (`restore`
    puts them back). z_max: float32 [B] row maxima after the cell edits; block_max / argmax: the
    greedy read (`argmax.block_maxima`, or the first argmax where there is no block view)."""

    facts: routes.StepFacts
    z: torch.Tensor | None = None
    undo: list[stages.Cells] = field(default_factory=list)
    z_max: torch.Tensor | None = None
    block_max: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    groups: list[Group] = field(default_factory=list)

    def greedy_tokens(self) -> torch.Tensor:
        """int64 [B]: each row's first maximum (every row greedy), from the probe's read."""
        return self.argmax if self.argmax is not None else first_argmax(self.z, block_max=self.block_max)

    def restore(self) -> None:
        """Put the caller's values back where the probe wrote cells."""
        if self.undo:
            stages.restore_cells(self.z, self.undo)
            self.undo = []


class TorchStep:
    """The torch implementation of one step for a `Sampler`'s state (it owns the block workspace)."""

    capturable = False  # reads small per-row results back to the host to choose routes

    def __init__(self, state: SamplerState, logprobs_mode: str, config: TorchStepConfig | None = None,
                 compiled: bool = False) -> None:
        self.state = state
        self.compiled = compiled  # the full-row passes through the compile cache (the sampler's choice)
        self.vocab_size = state.width
        self.logprobs_mode = logprobs_mode
        self.device = state.device
        self.config = DEFAULT if config is None else config
        # the fused route's C++ passes share rows with helper threads never waited for (`native_rows.h`)
        # where the process owns torch's thread count; else with torch's threads
        self.wait_free = self.config.wait_free_rows and thread_count_owned()
        self._z_workspace: torch.Tensor | None = None
        self._p_workspace: torch.Tensor | None = None
        self._fused_loaded: bool | None = None  # the fused route available (`_fused_ready`)
        self._kept_index: tuple[tuple[int, ...], torch.Tensor] | None = None  # `_slot_index`
        self.routes_taken: Counter = Counter()  # each Route, and each (Thresholds, Values), run

    def run(self, logits: torch.Tensor, plan: StepPlan, record: torch.Tensor | None = None,
            token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """Steps 1-13 for the rows of `logits` ([B, Vp]) and the slots of `plan`; rows where the
        bool [B] `record` is False are sampled but their slot's history is left as it was.
        token_bitmask: int32 [B, W >= ceil(V / 32)] (xgrammar's layout, checked by the Sampler):
        this step removes every id whose bit is 0. The fused route reads the bits where it reads a
        value; masked batches it does not take go to the block route, which unpacks each block's
        bits right after its float32 copy (docs/cpu-fast-path.md)."""
        elements = logits.shape[0] * logits.shape[1]
        small = elements <= self.config.single_thread_elements or (
            not plan.sampled_rows and elements <= self.config.greedy_single_thread_elements)
        helpers = -1 if not self.wait_free else 0 if small else torch.get_num_threads() - 1
        with single_threaded() if small else contextlib.nullcontext():  # a row: no second thread to wait for
            index = self._slot_index(plan)
            out = self._sample(logits, index, plan, token_bitmask, helpers=helpers)
            self.state.record_tokens(index, out.token_ids, record)
        self._p_workspace = None  # the dense route's p buffer lives for one call (measured: no slower)
        return out

    def _slot_index(self, plan: StepPlan) -> torch.Tensor:
        """int64 [B]: the plan's slots as a tensor, kept for the next call with the same plan (the
        sampler reuses its plan while the rows' params hold; the steps only read it)."""
        kept = self._kept_index
        if kept is not None and kept[0] is plan.slots:
            return kept[1]
        index = torch.tensor(plan.slots, dtype=torch.int64, device=self.device)
        self._kept_index = (plan.slots, index)
        return index

    def _sample(self, logits: torch.Tensor, index: torch.Tensor, plan: StepPlan,
                token_bitmask: torch.Tensor | None = None, fused_first: bool = True, helpers: int = -1
                ) -> SamplerOutput:
        """Steps 1-12: the fused route where the plan and layout allow it and it finishes some row
        (the others then take the general routes alone); else the probe, the one choice of the route,
        the route. No buffer of the logits' size is allocated on any route."""
        layout = routes.Layout.of(logits, masked=token_bitmask is not None)
        if fused_first and Route.FUSED in routes.readable_routes(plan, layout, self.config, self.logprobs_mode,
                                                                 stages.CELL_EDITS, fused=self._fused_ready()):
            fused_outcome = self._fused_route(logits, index, plan, token_bitmask, helpers)
            if isinstance(fused_outcome, SamplerOutput):
                return fused_outcome
        probe = self._probe(logits, index, plan, masked=token_bitmask is not None)
        outcome: SamplerOutput | routes.Continue | None = None
        try:
            route = routes.choose_route(plan, probe.facts, self.config, self.logprobs_mode, stages.CELL_EDITS)
            if route is Route.DIRECT:
                outcome = self._direct(index, plan, probe)
        finally:
            probe.restore()
        if isinstance(outcome, routes.Continue):  # the second decision: known after the direct route's work
            route = outcome.route
        self.routes_taken[route] += 1
        if isinstance(outcome, SamplerOutput):
            if plan.wants_logprobs:  # raw scores: after the original values are back
                outcome.logprobs = LogprobsOutput.empty((logits.shape[0],), plan.logprobs_width, logits.device)
                self._direct_logprobs(logits, outcome.token_ids, plan, outcome.logprobs)
            return outcome
        if route is Route.PLAIN_GREEDY:
            return SamplerOutput(probe.greedy_tokens(), probe.valid, None)
        # too flat for a candidate list: the probe's estimate says so, or the direct route found it
        # (a list over its cap, or a group handed to the dense route: `routes.Continue`)
        flat = isinstance(outcome, routes.Continue) or (
            probe.facts.groups is not None
            and any(routes.choose_thresholds(group) is Thresholds.DENSE for group in probe.facts.groups))
        return self._block_route(logits, index, plan, token_bitmask, flat)

    def _fused_ready(self) -> bool:
        """Whether this step may take the fused route (`fused.available`, asked once)."""
        if self._fused_loaded is None:
            self._fused_loaded = fused.available(self.compiled, self.config)
        return self._fused_loaded

    def _fused_route(self, logits: torch.Tensor, index: torch.Tensor, plan: StepPlan,
                     token_bitmask: torch.Tensor | None = None, helpers: int = -1
                     ) -> SamplerOutput | routes.Continue:
        """`Route.FUSED`: the plan's cell edits written into the caller's logits, steps 6-11 of every
        row in one C++ pass (`fused.edited_pass`, reading the token bitmask where it reads a value),
        the cells restored; raw logprobs from the pass's statistics, else as on the direct route.
        `helpers` >= 0: the C++ passes share their rows with that many helper threads never waited
        for, torch on the calling thread alone meanwhile (no torch thread spinning beside them); -1:
        on torch's threads (`TorchStep.wait_free`). Rows the pass marks general take the general
        routes alone (`_sample` on a copy of their rows, with a plan of them) where they are at most a
        quarter of the call (the copy stays under a quarter of a logits buffer); else the call
        continues there whole (`routes.Continue`), the fused pass's tokens dropped."""
        z = logits if logits.shape[1] == self.vocab_size else logits[:, :self.vocab_size]
        with single_threaded() if helpers > 0 else contextlib.nullcontext():
            tokens, general, count, raw_stats = fused.edited_pass(
                z, index, self.state, plan, token_bitmask, compiled=self.compiled,
                logprobs_mode=self.logprobs_mode, helpers=helpers)
            from_stats = (self._stats_logprobs(logits, tokens, plan, raw_stats)
                          if raw_stats is not None and count == 0 else None)
        valid = torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        rows = general.nonzero().squeeze(-1).tolist() if count else []
        if 4 * len(rows) > tokens.shape[0]:  # their copy would pass a quarter of a logits buffer
            return routes.Continue(Route.DIRECT, "more than a quarter of the rows need the general routes")
        if rows:  # those rows alone, on the general routes (their own plan; a copy of their logits)
            part = plan_step([plan.rows[b] for b in rows], self.vocab_size, [plan.slots[b] for b in rows])
            mask = None if token_bitmask is None else token_bitmask[rows]
            drawn = self._sample(logits[rows], index[rows], part, mask, fused_first=False)
            tokens[rows], valid[rows] = drawn.token_ids, drawn.valid
        self.routes_taken[Route.FUSED] += 1
        out = SamplerOutput(tokens, valid, from_stats)
        if plan.wants_logprobs and from_stats is None:  # raw scores (processed modes never take this route)
            out.logprobs = LogprobsOutput.empty((logits.shape[0],), plan.logprobs_width, logits.device)
            self._direct_logprobs(logits, tokens, plan, out.logprobs)
        return out

    def _stats_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, plan: StepPlan,
                        raw_stats: tuple[torch.Tensor, torch.Tensor | None, int]) -> LogprobsOutput:
        """Raw logprobs from the fused pass's statistics of every row (`fused.raw_stats_buffers`):
        gathers only."""
        out = LogprobsOutput.empty((logits.shape[0],), plan.logprobs_width, logits.device)
        asked = [b for b, n in enumerate(plan.num_logprobs) if n >= 0]
        maxima, log_sum, _ = raw_stats
        if len(asked) < len(plan.num_logprobs):
            maxima, log_sum = maxima[asked], None if log_sum is None else log_sum[asked]
        stats = logprobs.RowStats(maxima, maxima.amax(dim=-1), log_sum)
        self._logprobs(logits, None, tokens, plan, 0, logits.shape[0], out, stats)
        return out

    def _probe(self, logits: torch.Tensor, index: torch.Tensor, plan: StepPlan, *, masked: bool) -> Probe:
        """The facts `routes.choose_route` needs, measured once on the caller's logits where a route
        reading them is allowed (`routes.readable_routes`): the plan's cell edits written (direct
        route), the row maxima (and the greedy read: block maxima or the argmax), NaN or +inf,
        rows emptied, z / T underflowing a sampled row, and, where those leave the direct route
        open, each sampled group's facts read divided where read (`candidates.measure_rows`)."""
        layout = routes.Layout.of(logits, masked=masked)
        allowed = routes.readable_routes(plan, layout, self.config, self.logprobs_mode, stages.CELL_EDITS)
        if not allowed:
            return Probe(routes.StepFacts(layout))
        z = logits[:, :self.vocab_size]
        rows = list(plan.rows)
        names = plan.edits() if Route.DIRECT in allowed else ()
        probe = Probe(routes.StepFacts(layout), z)
        probe.undo = (stages.edit_cells(z, stages.StageRows(self.state, index, rows, compiled=self.compiled), names)
                      if names else [])
        z_max, probe.block_max, probe.argmax = _maxima(z, all_greedy=not plan.sampled_rows)
        probe.z_max, probe.valid = z_max, z_max > NEG_INF  # NaN: not valid
        if Route.PLAIN_GREEDY in allowed and bool(probe.valid.all()):  # all plain greedy needs: one read back
            probe.facts = routes.StepFacts(layout, all_valid=True)
            return probe
        valid_host = probe.valid.tolist()
        sampled = [b for b, p in enumerate(rows) if not p.greedy and valid_host[b]]
        temperature = self.state.temperature[index[sampled]]
        facts = routes.StepFacts(layout, all_valid=all(valid_host),
                                 finite=bool((torch.isfinite(z_max) | torch.isneginf(z_max)).all()),
                                 emptied=bool(probe.undo) and not all(valid_host),
                                 underflow=bool(sampled) and bool(torch.isneginf(z_max[sampled] / temperature).any()))
        if Route.DIRECT in allowed and not routes.rows_rule_out_direct(facts):
            probe.groups = self._direct_groups(z, z_max, index, rows, sampled)
            facts = replace(facts, groups=tuple(g.facts for g in probe.groups))
        probe.facts = facts
        return probe

    def _direct_groups(self, z: torch.Tensor, z_max: torch.Tensor, index: torch.Tensor,
                       rows: list[SamplingParams], sampled: list[int]) -> list[Group]:
        """The direct route's groups of sampled rows (all at once when every row is sampled: no copy;
        else a block of rows at a time, each copied out) with their facts read divided where read."""
        everyone = len(sampled) == len(rows)
        step = len(sampled) if everyone else self._block_rows
        groups = []
        for start in range(0, len(sampled), max(step, 1)):
            group = sampled[start:start + step]
            cols = self._columns(index if everyone else index[group], [rows[b] for b in group])
            facts = candidates.measure_rows(z, z_max if everyone else z_max[group], cols, Values.DIVIDED_WHERE_READ,
                                            rows=None if everyone else group)
            groups.append(Group(group, cols, facts))
        return groups

    def _direct(self, index: torch.Tensor, plan: StepPlan, probe: Probe) -> SamplerOutput | routes.Continue:
        """`Route.DIRECT`: steps 3-11 on the caller's logits, all rows at once, with the cells the
        probe wrote: no workspace copy, no in-place division (values are divided where they are
        read), each group drawn from its probed facts. Logprobs are the dispatcher's (after the
        cells are restored). A group whose candidate list overflows its cap continues the call
        on the block route (`routes.Continue`)."""
        z, rows = probe.z, list(plan.rows)
        tokens = torch.zeros(z.shape[0], dtype=torch.int64, device=z.device)
        for group in probe.groups:
            everyone = len(group.rows) == z.shape[0]
            drawn = stages.filter_and_draw(z if everyone else z[group.rows], probe.z_max[group.rows], group.cols,
                                           exact_threshold=False, values=Values.DIVIDED_WHERE_READ,
                                           facts=group.facts)
            if isinstance(drawn, Handoff):
                return routes.Continue(Route.BLOCK, "a candidate list is longer than its cap")
            tokens[group.rows] = drawn.tokens
        valid_host = probe.valid.tolist()
        greedy = [b for b, p in enumerate(rows) if p.greedy and valid_host[b]]
        if greedy and len(greedy) == len(rows):  # every row: no copy of the rows
            tokens.copy_(probe.greedy_tokens())
        elif greedy:
            tokens[greedy] = first_argmax(z[greedy])
        return SamplerOutput(tokens, probe.valid, None)

    def _direct_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, plan: StepPlan,
                         result: LogprobsOutput) -> None:
        """Raw logprobs of the direct route: all rows at once when compiled (the statistics are
        reductions: small temporaries), else a block of rows at a time (eager log_softmax writes a
        block-sized tensor)."""
        rows_per_call = logits.shape[0] if self.compiled else self._block_rows
        for start in range(0, logits.shape[0], rows_per_call):
            stop = min(logits.shape[0], start + rows_per_call)
            self._logprobs(logits, None, tokens[start:stop], plan, start, stop, result)

    @property
    def workspace_bytes(self) -> int:
        """Bytes this step holds from call to call: the block workspace (0 until the block route runs;
        the dense route's p buffer is released at the end of each call), and where the fused route
        has run, the lists its last call's threads held (`fused.scratch_bytes`, counted whether or not
        they were kept)."""
        held = sum(t.numel() * t.element_size() for t in (self._z_workspace, self._p_workspace) if t is not None)
        return held + (fused.scratch_bytes() if self.routes_taken[Route.FUSED] else 0)

    @property
    def _block_rows(self) -> int:
        """Rows per block: about `config.block_elements` logits."""
        return max(1, self.config.block_elements // self.vocab_size)

    def _dense_buffer(self, numel: int) -> torch.Tensor:
        """The dense route's float32 p buffer, shared by the blocks of one call (grown when needed,
        released when the call ends: a flat call at B = 32 ran as fast as with a held one, and a later
        call of another route does not hold it)."""
        if self._p_workspace is None or self._p_workspace.numel() < numel:
            self._p_workspace = None
            self._p_workspace = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self._p_workspace

    def _workspace(self, num_rows: int) -> torch.Tensor:
        """The block's float32 `z`, reused from step to step (no allocation on the fast path)."""
        if self._z_workspace is None or self._z_workspace.shape[0] < num_rows:
            self._z_workspace = torch.empty((num_rows, self.vocab_size), dtype=torch.float32, device=self.device)
        return self._z_workspace[:num_rows]

    def _block_route(self, logits: torch.Tensor, index: torch.Tensor, plan: StepPlan,
                     token_bitmask: torch.Tensor | None, flat: bool = False) -> SamplerOutput:
        """`Route.BLOCK`: one block of consecutive rows at a time through the workspace (blocks of
        `masked_block_elements` logits in a masked call, `flat_block_elements` in a call the probe
        found too flat for a candidate list, else `block_elements`)."""
        batch, device = logits.shape[0], logits.device
        result = LogprobsOutput.empty((batch,), plan.logprobs_width, device) if plan.wants_logprobs else None
        out = SamplerOutput(torch.zeros(batch, dtype=torch.int64, device=device),
                            torch.ones(batch, dtype=torch.bool, device=device), result)
        elements = (self.config.masked_block_elements if token_bitmask is not None
                    else self.config.flat_block_elements if flat else self.config.block_elements)
        size = max(1, elements // self.vocab_size)
        rows = list(plan.rows)
        for start in range(0, batch, size):
            self._run_block(logits, index, rows, plan, start, min(batch, start + size), out, token_bitmask)
        return out

    def _run_block(self, logits: torch.Tensor, index: torch.Tensor, rows: list[SamplingParams], plan: StepPlan,
                   start: int, stop: int, out: SamplerOutput, token_bitmask: torch.Tensor | None) -> None:
        """Steps 1-12 for the rows [start, stop) in the workspace: the float32 copy (and the raw
        logprob statistics while it is in cache), the edits, the +inf rule, greedy and sampled rows,
        the raw greedy id of rows left without an id, logprobs."""
        block_params, slots = rows[start:stop], index[start:stop]
        z = stages.clean_logits(self._workspace(stop - start), logits[start:stop])
        raw_stats = self._raw_logprob_stats(z, plan, start, stop) if out.logprobs is not None else None
        edits = plan.edits(token_bitmask is not None)
        if edits:  # the block's bits are applied while its copy is in cache
            mask = None if token_bitmask is None else token_bitmask[start:stop]
            stages.apply_edits(z, stages.StageRows(self.state, slots, block_params, mask, self._dense_buffer,
                                                   self.compiled), edits)
        z_max = z.amax(dim=-1)
        if bool(torch.isposinf(z_max).any()):
            masking.saturate_posinf(z)
            z_max = z.amax(dim=-1)
        block_valid = z_max > NEG_INF
        valid_host = block_valid.tolist()
        block_tokens = torch.zeros(stop - start, dtype=torch.int64, device=z.device)
        greedy = [b for b, p in enumerate(block_params) if p.greedy and valid_host[b]]
        if greedy:
            block_tokens[greedy] = first_argmax(z[greedy])
        sampled, gone = self._live_sampled(z, z_max, slots, block_params, valid_host, block_valid)
        processed = self.logprobs_mode.startswith("processed") and out.logprobs is not None
        if sampled:
            block_tokens[sampled] = self._draw_block(z, z_max, slots, block_params, sampled,
                                                     masked=token_bitmask is not None, processed=processed)
        if gone or (edits and not all(valid_host)):  # the raw greedy id of rows with no id left (a fresh copy)
            raw_argmax = first_argmax(masking.prepare_logits(logits[start:stop], self.vocab_size))
            block_tokens = torch.where(block_valid, block_tokens, raw_argmax)
        out.token_ids[start:stop] = block_tokens
        out.valid[start:stop] = block_valid
        if out.logprobs is not None:
            self._logprobs(logits, z if processed else None, block_tokens, plan, start, stop, out.logprobs, raw_stats)

    def _live_sampled(self, z: torch.Tensor, z_max: torch.Tensor, slots: torch.Tensor,
                      block_params: list[SamplingParams], valid_host: list[bool], block_valid: torch.Tensor
                      ) -> tuple[list[int], list[int]]:
        """(sampled, gone): the block's sampled rows with an id left, and those z / T empties (step 7
        may overflow every id of a row to -inf, tiny T): marked invalid, their processed values all -inf."""
        sampled = [b for b, p in enumerate(block_params) if not p.greedy and valid_host[b]]
        if not sampled:
            return [], []
        dead = torch.isneginf(z_max[sampled] / self.state.temperature[slots[sampled]]).tolist()
        gone = [b for b, d in zip(sampled, dead) if d]
        if gone:
            block_valid[gone] = False
            z[gone] = NEG_INF  # their processed values: z / T, every one -inf
        return [b for b, d in zip(sampled, dead) if not d], gone

    def _draw_block(self, z: torch.Tensor, z_max: torch.Tensor, slots: torch.Tensor,
                    block_params: list[SamplingParams], sampled: list[int], *, masked: bool, processed: bool
                    ) -> torch.Tensor:
        """Steps 7-11 for the sampled rows of a block, as one group: in place, or in a masked block
        divided where read (no division pass) where `routes.choose_values` allows it from the group's
        facts in that form. A group read where divided whose candidate list overflows its cap (known
        after the work) is drawn again in place: nothing was written. Processed logprobs read the
        kept set: every other id of the block's z at -inf."""
        everyone = len(sampled) == z.shape[0]
        cols = self._columns(slots if everyone else slots[sampled], [block_params[b] for b in sampled])
        if routes.plan_route(cols.filters()) is Thresholds.FULL_ROW:  # steps 7, 10.1-10.5 (z written)
            self.routes_taken[Thresholds.FULL_ROW, Values.IN_PLACE] += 1
            return extra_filters.draw_rows(z, z_max, slots, block_params, sampled, self.state, self.config,
                                           self.compiled, final=processed)[0]
        zs, zs_max = (z, z_max) if everyone else (z[sampled], z_max[sampled])
        divided = None
        if routes.reads_divided(masked, processed):
            divided = candidates.measure_rows(z, zs_max, cols, Values.DIVIDED_WHERE_READ,
                                              rows=None if everyone else sampled)
        values = routes.choose_values(masked, processed, divided)
        drawn = stages.filter_and_draw(zs, zs_max, cols, exact_threshold=processed, values=values,
                                       facts=divided if values is Values.DIVIDED_WHERE_READ else None)
        if isinstance(drawn, Handoff):
            drawn = stages.filter_and_draw(zs, zs_max, cols, exact_threshold=processed, values=Values.IN_PLACE)
        if processed:  # step 12 reads the kept set: every other id at -inf
            zs.masked_fill_(zs < drawn.tau[:, None], NEG_INF)
            if not everyone:
                z[sampled] = zs
        return drawn.tokens

    def _columns(self, slots: torch.Tensor, params: list[SamplingParams]) -> candidates.RowColumns:
        """The parameter columns of a group of sampled rows (`stages.filter_columns`), counting its routes."""
        return stages.filter_columns(self.state, slots, params, self.config, self._dense_buffer,
                                     compiled=self.compiled, taken=self.routes_taken,
                                     full_row=extra_filters.needed(params))

    def _raw_logprob_stats(self, z: torch.Tensor, plan: StepPlan, start: int, stop: int) -> logprobs.RowStats | None:
        """Raw modes, compiled: the chunk maxima and the normaliser of the raw scores of the rows that
        asked, from the block's fresh float32 copy while it is in cache (None for a block holding
        +inf, whose raw scores follow the +inf rule, and where nothing is asked)."""
        if not self.logprobs_mode.startswith("raw") or not self.compiled:
            return None
        asked = [b for b in range(stop - start) if plan.num_logprobs[start + b] >= 0]
        if not asked:
            return None
        stats = logprobs.row_stats(z if len(asked) == stop - start else z[asked],
                                   normalise=self.logprobs_mode == "raw_logprobs", compiled=self.compiled)
        return None if bool(torch.isposinf(stats.row_max).any()) else stats

    def _logprobs(self, logits: torch.Tensor, final: torch.Tensor | None, tokens: torch.Tensor,
                  plan: StepPlan, start: int, stop: int, result: LogprobsOutput,
                  raw_stats: logprobs.RowStats | None = None) -> None:
        """Step 2/12 for the rows [start, stop) that asked: raw modes read the raw logits (gathers
        only, with `raw_stats` from the block's start; else a float32 copy where they hold NaN, +inf
        or another dtype), processed modes read the block's final `z`."""
        asked = [b for b in range(stop - start) if plan.num_logprobs[start + b] >= 0]
        if not asked:
            return
        width = result.top_token_ids.shape[1]
        normalise = self.logprobs_mode.endswith("logprobs")
        if final is None:
            rows = logits[start:stop] if len(asked) == stop - start else logits[start:stop][asked]
            scores = rows[:, :self.vocab_size]
            if raw_stats is not None:  # NaN cleaned in what is gathered
                scores = logprobs.ScoreRows(scores, clean=False)
            elif scores.dtype != torch.float32 or not bool(torch.isfinite(scores.amax(dim=-1)).all()):
                scores = masking.saturate_posinf(masking.prepare_logits(rows, self.vocab_size))
        else:
            scores = final if len(asked) == stop - start else final[asked]
        num = torch.tensor([plan.num_logprobs[start + b] for b in asked], dtype=torch.int64, device=tokens.device)
        part = logprobs.gather_logprobs(scores, tokens[asked], num, width, normalise, raw_stats, self.compiled)
        where = slice(start, stop) if len(asked) == stop - start else [start + b for b in asked]
        result.token_logprobs[where] = part.token_logprobs
        result.token_ranks[where] = part.token_ranks
        result.top_token_ids[where] = part.top_token_ids
        result.top_logprobs[where] = part.top_logprobs


def _maxima(z: torch.Tensor, *, all_greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(z_max, block_max, argmax): the row maxima (NaN propagates), read once; for a greedy batch
    the same read gives the first maxima too (the block maxima, or the argmax and its value where
    `block_maxima` has no block view)."""
    if not all_greedy:
        return z.amax(dim=-1), None, None
    block_max = block_maxima(z)
    if block_max is not None:
        return block_max.amax(dim=-1), block_max, None
    argmax = z.argmax(dim=-1)
    return z.gather(-1, argmax[:, None]).squeeze(-1), None, argmax
