"""`TorchStep`: steps 1-12 of the definition in torch, without sorting the vocabulary.

Float32 batches that need no edit before temperature except penalties run on the caller's logits
(the direct route: values divided where read, penalties written at the seen ids and restored).
Others, and flat rows, are cut into row blocks of about `TorchStepConfig.block_elements` logits, each copied once
into a reused float32 workspace and finished while it is in cache (docs/cpu-fast-path.md):

1. float32 logits, padding and NaN removed                     `stages.clean_logits`
3.-5. the plan's edits (allowed ids, the call's token bitmask, bad words, stop ids below
   min_tokens, logit bias, penalties), each one function of   `stages.apply_edits` (block route),
   `stages`, in the definition's order                        `stages.edit_cells` (direct route)
6. greedy rows: lowest id among the maxima                      `first_argmax` (no copy if nothing to edit)
7.-11. temperature, min-p, top-k, top-p as one threshold per row, Gumbel argmax with exact noise
   only where a token can still win                             `stages.filter_and_draw`
2./12. raw or processed logprobs, rows that asked               `logprobs.gather_logprobs`

13. the history update                                         `SamplerState.record_tokens`

On a CPU the step reads small per-row results back to choose routes (documented in
docs/cpu-fast-path.md). The routes and sizes are a `TorchStepConfig`.
"""

from __future__ import annotations

import torch

from ...core.constants import NEG_INF
from ...core.output import LogprobsOutput, SamplerOutput
from ...core.params import SamplingParams
from ...core.plan import StepPlan
from ...state import SamplerState
from . import extra_filters, logprobs, masking, stages
from .argmax import block_maxima, first_argmax
from .config import DEFAULT, TorchStepConfig


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
        self._z_workspace: torch.Tensor | None = None
        self._p_workspace: torch.Tensor | None = None

    def run(self, logits: torch.Tensor, plan: StepPlan, record: torch.Tensor | None = None,
            token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """Steps 1-13 for the rows of `logits` ([B, Vp]) and the slots of `plan`; rows where the
        bool [B] `record` is False are sampled but their slot's history is left as it was.
        token_bitmask: int32 [B, W >= ceil(V / 32)] (xgrammar's layout, checked by the Sampler):
        this step removes every id whose bit is 0. Masked batches take the block route, which
        unpacks each block's bits right after its float32 copy (docs/cpu-fast-path.md)."""
        index = torch.tensor(plan.slots, dtype=torch.int64, device=self.device)
        out = self._sample(logits, index, plan, token_bitmask)
        self.state.record_tokens(index, out.token_ids, record)
        return out

    def _sample(self, logits: torch.Tensor, index: torch.Tensor, plan: StepPlan,
                token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """Steps 1-12: plain greedy batches on the logits themselves; else the direct route
        (`_run_direct`) where it applies; else (or when it hands the call back) one block of
        consecutive rows at a time through the workspace. No buffer of the logits' size is
        allocated on any route."""
        if token_bitmask is None and plan.plain_greedy and not plan.wants_logprobs:
            plain = self._run_plain_greedy(logits)
            if plain is not None:
                return plain
        batch = logits.shape[0]
        device = logits.device
        rows = list(plan.rows)
        tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        valid = torch.ones(batch, dtype=torch.bool, device=device)
        result = LogprobsOutput.empty((batch,), plan.logprobs_width, device) if plan.wants_logprobs else None
        if self.config.direct_route and token_bitmask is None and self._direct_applies(logits, plan, rows):
            if self._run_direct(logits, index, rows, plan, tokens, valid, result):
                return SamplerOutput(tokens, valid, result)
        elements = self.config.block_elements if token_bitmask is None else self.config.masked_block_elements
        size = max(1, elements // self.vocab_size)
        for start in range(0, batch, size):
            stop = min(batch, start + size)
            self._run_block(logits, index, rows, plan, start, stop, tokens, valid, result, token_bitmask)
        return SamplerOutput(tokens, valid, result)

    def _direct_applies(self, logits: torch.Tensor, plan: StepPlan, rows: list[SamplingParams]) -> bool:
        """The route on the caller's logits: float32 on a CPU, every edit of the plan one with a
        cell form (`stages.CELL_EDITS`: bad words, penalties; not allowed ids, a token bitmask,
        min_tokens or bias) and no processed logprobs (they read the edited z). Cell edits need
        rows that do not share memory (they are written in place and restored)."""
        edits = plan.edits()
        cells_only = all(name in stages.CELL_EDITS for name in edits)
        processed = self.logprobs_mode.startswith("processed") and plan.wants_logprobs
        if logits.dtype != torch.float32 or not cells_only or processed or logits.device.type != "cpu":
            return False
        if edits:
            separate_rows = logits.stride(1) == 1 and (logits.shape[0] <= 1 or logits.stride(0) >= logits.shape[1])
            writable = not logits.requires_grad and (not logits.is_inference() or torch.is_inference_mode_enabled())
            return separate_rows and writable
        return True

    def _run_direct(self, logits: torch.Tensor, index: torch.Tensor, rows: list[SamplingParams], plan: StepPlan,
                    tokens: torch.Tensor, valid: torch.Tensor, result: LogprobsOutput | None) -> bool:
        """Steps 3-12 on the caller's logits, all rows at once: no workspace copy, no in-place
        division (values are divided where they are read). The plan's cell edits (bad words: -inf
        at the ids they ban; penalties: the penalised values at the ids a row has seen) are written
        by `stages.edit_cells` and the original values put back before returning. Returns False,
        having changed nothing, when a row needs the block route (NaN or +inf in the logits, a row
        emptied, a row too flat for a candidate list)."""
        z = logits[:, :self.vocab_size]
        names = plan.edits()
        undo = stages.edit_cells(z, stages.StageRows(self.state, index, rows), names) if names else []
        if not undo:
            return self._sample_direct(logits, z, index, rows, plan, tokens, valid, result)
        try:
            done = self._sample_direct(logits, z, index, rows, plan, tokens, valid, None, edited=True)
        finally:
            stages.restore_cells(z, undo)
        if done and result is not None:  # raw scores: after the original values are back
            self._direct_logprobs(logits, tokens, plan, result)
        return done

    def _sample_direct(self, logits: torch.Tensor, z: torch.Tensor, index: torch.Tensor, rows: list[SamplingParams],
                       plan: StepPlan, tokens: torch.Tensor, valid: torch.Tensor, result: LogprobsOutput | None,
                       edited: bool = False) -> bool:
        all_greedy = all(p.greedy for p in rows)
        block_max = block_maxima(z) if all_greedy else None  # one read gives the max and the argmax
        z_max = z.amax(dim=-1) if block_max is None else block_max.amax(dim=-1)
        if not bool((torch.isfinite(z_max) | torch.isneginf(z_max)).all()):  # NaN or +inf somewhere
            return False
        row_valid = z_max > NEG_INF
        valid_host = row_valid.tolist()
        if edited and not all(valid_host):
            return False  # a penalty overflowed a row to -inf: its raw greedy id needs the block route
        st = self.state
        sampled = [b for b, p in enumerate(rows) if not p.greedy and valid_host[b]]
        if sampled and bool(torch.isneginf(z_max[sampled] / st.temperature[index[sampled]]).any()):
            return False  # z / T underflows a whole row: the block route handles the emptied row
        row_tokens = torch.zeros_like(tokens)
        # all rows at once without a copy; a subset of rows is copied out, a block at a time
        groups = [sampled] if len(sampled) == len(rows) else [
            sampled[i:i + self._block_rows] for i in range(0, len(sampled), self._block_rows)]
        for group in groups if sampled else []:
            drawn = self._sample_rows(z, z_max, index, rows, group, False, in_place=False)
            if drawn is None:
                return False
            row_tokens[group] = drawn
        greedy = [b for b, p in enumerate(rows) if p.greedy and valid_host[b]]
        if greedy and len(greedy) == len(rows):  # every row: no copy of the rows
            row_tokens.copy_(first_argmax(z, block_max=block_max))
        elif greedy:
            row_tokens[greedy] = first_argmax(z[greedy])
        tokens.copy_(row_tokens)
        valid.copy_(row_valid)
        if result is not None:
            self._direct_logprobs(logits, tokens, plan, result)
        return True

    def _direct_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, plan: StepPlan,
                         result: LogprobsOutput) -> None:
        """Raw logprobs of the direct route: all rows at once when compiled (the statistics are
        reductions: small temporaries), else a block of rows at a time (eager log_softmax writes a
        block-sized tensor)."""
        rows_per_call = logits.shape[0] if self.compiled else self._block_rows
        for start in range(0, logits.shape[0], rows_per_call):
            stop = min(logits.shape[0], start + rows_per_call)
            self._logprobs(logits, None, tokens[start:stop], plan, start, stop, result)

    def _run_plain_greedy(self, logits: torch.Tensor) -> SamplerOutput | None:
        """Greedy rows with nothing to remove or add: the first maximum of the logits themselves, no
        copy (+inf is a maximum). None when a row's maximum is NaN or every id is -inf: the general
        path decides those rows."""
        real = logits[:, :self.vocab_size]
        block_max = block_maxima(real)
        tokens = first_argmax(real, block_max=block_max)
        best = real.gather(-1, tokens[:, None]).squeeze(-1) if block_max is None else block_max.amax(dim=-1)
        valid = best > NEG_INF  # NaN: False
        return SamplerOutput(tokens, valid, None) if bool(valid.all()) else None

    @property
    def workspace_bytes(self) -> int:
        """Bytes this step holds from call to call: the block workspace (0 until the block route runs)
        and the dense route's p buffer (0 until a flat row needed it)."""
        return sum(t.numel() * t.element_size() for t in (self._z_workspace, self._p_workspace) if t is not None)

    @property
    def _block_rows(self) -> int:
        """Rows per block: about `config.block_elements` logits."""
        return max(1, self.config.block_elements // self.vocab_size)

    def _dense_buffer(self, numel: int) -> torch.Tensor:
        """The dense route's float32 p buffer, reused from step to step (grown when needed)."""
        if self._p_workspace is None or self._p_workspace.numel() < numel:
            self._p_workspace = None
            self._p_workspace = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self._p_workspace

    def _workspace(self, num_rows: int) -> torch.Tensor:
        """The block's float32 `z`, reused from step to step (no allocation on the fast path)."""
        if self._z_workspace is None or self._z_workspace.shape[0] < num_rows:
            self._z_workspace = torch.empty((num_rows, self.vocab_size), dtype=torch.float32, device=self.device)
        return self._z_workspace[:num_rows]

    def _run_block(self, logits: torch.Tensor, index: torch.Tensor, rows: list[SamplingParams],
                   plan: StepPlan, start: int, stop: int, tokens: torch.Tensor, valid: torch.Tensor,
                   result: LogprobsOutput | None, token_bitmask: torch.Tensor | None = None) -> None:
        st = self.state
        block_params = rows[start:stop]
        slots = index[start:stop]
        z = stages.clean_logits(self._workspace(stop - start), logits[start:stop])
        raw_stats = self._raw_logprob_stats(z, plan, start, stop) if result is not None else None
        edits = plan.edits(token_bitmask is not None)
        may_empty = bool(edits)
        if edits:  # the block's bits are applied while its copy is in cache
            mask = None if token_bitmask is None else token_bitmask[start:stop]
            stages.apply_edits(z, stages.StageRows(st, slots, block_params, mask, self._dense_buffer), edits)
        z_max = z.amax(dim=-1)
        if bool(torch.isposinf(z_max).any()):
            masking.saturate_posinf(z)
            z_max = z.amax(dim=-1)
        block_valid = z_max > NEG_INF
        valid_host = block_valid.tolist()
        raw_argmax = None  # the raw greedy id of rows the edits emptied (rare: a fresh copy of them)
        if may_empty and not all(valid_host):
            raw_argmax = first_argmax(masking.prepare_logits(logits[start:stop], self.vocab_size))
        block_tokens = torch.zeros(stop - start, dtype=torch.int64, device=z.device)
        greedy = [b for b, p in enumerate(block_params) if p.greedy and valid_host[b]]
        if greedy:
            block_tokens[greedy] = first_argmax(z[greedy])
        sampled = [b for b, p in enumerate(block_params) if not p.greedy and valid_host[b]]
        processed = self.logprobs_mode.startswith("processed") and result is not None
        if sampled:
            # step 7 may overflow every id of a row to -inf (tiny T): such a row has no id left
            dead = torch.isneginf(z_max[sampled] / st.temperature[slots[sampled]]).tolist()
            if any(dead):
                gone = [b for b, d in zip(sampled, dead) if d]
                sampled = [b for b, d in zip(sampled, dead) if not d]
                block_valid[gone] = False
                z[gone] = NEG_INF  # their processed values: z / T, every one -inf
                if raw_argmax is None:
                    raw_argmax = first_argmax(masking.prepare_logits(logits[start:stop], self.vocab_size))
        if sampled:
            drawn = None
            if token_bitmask is not None and not processed and bool(torch.isfinite(z_max[sampled]).all()):
                # a masked block: divided where read, as the direct route (no division pass over it)
                drawn = self._sample_rows(z, z_max, slots, block_params, sampled, False, in_place=False)
            if drawn is None:
                drawn = self._sample_rows(z, z_max, slots, block_params, sampled, processed)
            block_tokens[sampled] = drawn
        if raw_argmax is not None:
            block_tokens = torch.where(block_valid, block_tokens, raw_argmax)
        tokens[start:stop] = block_tokens
        valid[start:stop] = block_valid
        if result is not None:
            self._logprobs(logits, z if processed else None, block_tokens, plan, start, stop, result, raw_stats)

    def _sample_rows(self, z: torch.Tensor, z_max: torch.Tensor, slots: torch.Tensor,
                     block_params: list[SamplingParams], sampled: list[int], processed: bool,
                     in_place: bool = True) -> torch.Tensor | None:
        """Temperature, min-p, top-k, top-p and the Gumbel argmax for the sampled rows of a block
        (None: `stages.filter_and_draw` declined the direct form)."""
        if extra_filters.needed([block_params[b] for b in sampled]):  # steps 7, 10.1-10.5: the full-row route
            return extra_filters.draw_rows(z, z_max, slots, block_params, sampled, self.state, self.config,
                                           self.compiled)[0] if in_place else None
        everyone = len(sampled) == z.shape[0]
        zs = z if everyone else z[sampled]
        cols = stages.filter_columns(self.state, slots if everyone else slots[sampled],
                                     [block_params[b] for b in sampled], self.config, self._dense_buffer,
                                     compiled=self.compiled)
        drawn = stages.filter_and_draw(zs, z_max if everyone else z_max[sampled], cols, exact_threshold=processed,
                                       in_place=in_place)
        if drawn is None:
            return None
        tokens, tau = drawn
        if processed:  # step 12 reads the kept set: every other id at -inf
            zs.masked_fill_(zs < tau[:, None], NEG_INF)
            if not everyone:
                z[sampled] = zs
        return tokens

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
