"""`TorchStep`: steps 1-12 of the definition in torch, without sorting the vocabulary.

Float32 batches that need no edit before temperature except penalties run on the caller's logits
(the direct route: values divided where read, penalties written at the seen ids and restored).
Others, and flat rows, are cut into row blocks of about `NativeConfig.block_elements` logits, each copied once
into a reused float32 workspace and finished while it is in cache (docs/cpu-fast-path.md):

1. float32 logits, padding and NaN removed                     `masking.prepare_logits_into`
3. allowed ids, the call's token bitmask, bad words (on the slot's latest output tokens); stop and
   EOS ids below min_tokens                                     `masking`: `remove_disallowed`,
                                                                `remove_by_bitmask`, `banned_tokens`,
                                                                `remove_stop_ids`
4. logit bias (rows that have one)                              `z + bias`
5. penalties (penalised rows, at the ids they have seen)        `penalties.apply_penalties_rows_`
6. greedy rows: lowest id among the maxima                      `first_argmax` (no copy if nothing to edit)
7.-11. temperature, min-p, top-k, top-p as one threshold per row, Gumbel argmax with exact noise
   only where a token can still win                             `fused.sample_rows`
2./12. raw or processed logprobs, rows that asked               `logprobs.gather_logprobs`

13. the history update                                         `SamplerState.record_tokens`

On a CPU the step reads small per-row results back to choose routes (documented in
docs/cpu-fast-path.md). The routes and sizes are a `NativeConfig`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...core import rng
from ...core.constants import NEG_INF
from ...core.output import LogprobsOutput, SamplerOutput
from ...core.params import SamplingParams
from ...core.plan import StepPlan, has_penalties
from ...state import SamplerState
from . import fused, logprobs, masking, penalties
from .argmax import block_maxima, first_argmax
from .config import DEFAULT, NativeConfig
from .indexing import read_at, write_at


def _positions(rows: Sequence[SamplingParams], pred) -> list[int]:
    return [b for b, p in enumerate(rows) if pred(p)]


class TorchStep:
    """The torch implementation of one step for a `Sampler`'s state (it owns the block workspace)."""

    capturable = False  # reads small per-row results back to the host to choose routes

    def __init__(self, state: SamplerState, logprobs_mode: str, config: NativeConfig | None = None,
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
        result = None
        if plan.wants_logprobs:
            width = max(plan.logprobs_width, 0)
            result = LogprobsOutput(torch.zeros(batch, dtype=torch.float32, device=device),
                                    torch.zeros(batch, dtype=torch.int64, device=device),
                                    torch.full((batch, width), -1, dtype=torch.int64, device=device),
                                    torch.full((batch, width), NEG_INF, dtype=torch.float32, device=device))
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
        """The route on the caller's logits: float32 on a CPU, nothing to remove or add before
        temperature except penalties and bad words (no allowed ids, token bitmask, min_tokens,
        bias) and no processed logprobs (they read the edited z). Penalties and bad words need
        rows that do not share memory (they are written in place and restored)."""
        edits = plan.allowed_ids or plan.min_tokens or plan.logit_bias
        processed = self.logprobs_mode.startswith("processed") and plan.wants_logprobs
        if logits.dtype != torch.float32 or edits or processed or logits.device.type != "cpu":
            return False
        if plan.penalties or plan.bad_words:
            separate_rows = logits.stride(1) == 1 and (logits.shape[0] <= 1 or logits.stride(0) >= logits.shape[1])
            writable = not logits.requires_grad and (not logits.is_inference() or torch.is_inference_mode_enabled())
            return separate_rows and writable
        return True

    def _run_direct(self, logits: torch.Tensor, index: torch.Tensor, rows: list[SamplingParams], plan: StepPlan,
                    tokens: torch.Tensor, valid: torch.Tensor, result: LogprobsOutput | None) -> bool:
        """Steps 3 (bad words) and 5-12 on the caller's logits, all rows at once: no workspace
        copy, no in-place division (values are divided where they are read). Penalised rows get
        their penalised values written at the ids they have seen, rows with bad words -inf at the
        ids they ban, and the original values back before returning. Returns False, having changed
        nothing, when a row needs the block route (NaN or +inf in the logits, a row emptied, a row
        too flat for a candidate list)."""
        z = logits[:, :self.vocab_size]
        edits = self._penalty_edits(z, index, rows) if plan.penalties else None
        banned = self._banned_cells(index) if plan.bad_words else None
        if edits is None and banned is None:
            return self._sample_direct(logits, z, index, rows, plan, tokens, valid, result)
        # every original value is read before anything is written (a banned id may be penalised)
        originals = [(r, i, read_at(z, r, i)) for r, i in ([edits[:2]] if edits is not None else [])
                     + ([banned] if banned is not None else [])]
        if edits is not None:
            write_at(z, *edits)
        if banned is not None:
            write_at(z, *banned, torch.full(banned[0].shape, NEG_INF, dtype=z.dtype, device=z.device))
        try:
            done = self._sample_direct(logits, z, index, rows, plan, tokens, valid, None, edited=True)
        finally:
            for row_index, ids, original in originals:
                write_at(z, row_index, ids, original)
        if done and result is not None:  # raw scores: after the original values are back
            self._direct_logprobs(logits, tokens, plan, result)
        return done

    def _banned_cells(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(row, id) of every id the bad words of the rows' slots ban this step, or None."""
        st = self.state
        if st.bad_words is None:
            return None
        recent = None if st.recent_tokens is None else st.recent_tokens[slots]
        return masking.banned_cells(masking.banned_tokens(st.bad_words[slots], recent))

    def _penalty_edits(self, z: torch.Tensor, index: torch.Tensor, rows: list[SamplingParams]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(row_index, ids, penalised values) of the penalised rows of the batch, or None."""
        st = self.state
        penalised = _positions(rows, has_penalties)
        slot_list = index.tolist()
        return penalties.penalty_edits(z, penalised, [slot_list[b] for b in penalised], st.prompt_mask,
                                       st.output_counts, st.repetition, st.frequency, st.presence)

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
        z = masking.prepare_logits_into(self._workspace(stop - start), logits[start:stop])
        raw_stats = self._raw_logprob_stats(z, plan, start, stop) if result is not None else None
        may_empty = (plan.allowed_ids or plan.min_tokens or plan.penalties or plan.logit_bias or plan.bad_words
                     or token_bitmask is not None)
        if any(p.allowed_token_ids is not None for p in block_params):
            masking.remove_disallowed(z, st.allowed_mask[slots])
        if token_bitmask is not None:  # the block's bits, applied while its copy is in cache
            masking.remove_by_bitmask(z, token_bitmask[start:stop], buffer=self._dense_buffer)
        if any(p.bad_words_token_ids for p in block_params):
            banned = self._banned_cells(slots)
            if banned is not None:
                write_at(z, *banned, torch.full(banned[0].shape, NEG_INF, dtype=z.dtype, device=z.device))
        if any(p.min_tokens > 0 for p in block_params) and st.stop_mask is not None:
            masking.remove_stop_ids(z, st.stop_mask[slots], st.output_len[slots] < st.min_tokens[slots])
        biased = _positions(block_params, lambda p: bool(p.logit_bias))
        if biased:
            z[biased] += st.logit_bias[slots[biased]]
        penalised = _positions(block_params, has_penalties)
        if penalised:
            slot_list = slots.tolist()
            penalties.apply_penalties_rows_(z, penalised, [slot_list[b] for b in penalised], st.prompt_mask,
                                            st.output_counts, st.repetition, st.frequency, st.presence)
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
        (None: `fused.sample_rows` declined the direct form)."""
        st = self.state
        everyone = len(sampled) == z.shape[0]
        zs = z if everyone else z[sampled]
        params = [block_params[b] for b in sampled]
        s = slots if everyone else slots[sampled]
        cols = fused.RowColumns(
            temperature=st.temperature[s], min_p=st.min_p[s], top_k=st.top_k[s], top_p=st.top_p[s],
            keys=rng.row_key(st.seed[s], st.position[s], st.stream[s]),
            any_min_p=any(p.min_p > 0 for p in params), any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params), dense_buffer=self._dense_buffer, config=self.config,
            compiled=self.compiled)
        drawn = fused.sample_rows(zs, z_max if everyone else z_max[sampled], cols, exact_threshold=processed,
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
