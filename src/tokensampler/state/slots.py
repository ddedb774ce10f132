"""`SamplerState`: per-slot sampler state on the device, on a vocabulary layout.

One row per slot. Parameter columns are written when a request is admitted and read by index on
every step; the penalty history is a prompt mask and output counts per slot over the ids the
layout holds, updated in O(B) per step by the sampled tokens. Optional dense columns (logit bias,
allowed ids, stop ids) are allocated on first use, and so are the bad words: a table of each slot's
bad words and the slot's latest output tokens (as many as the longest bad word admitted, less one),
kept on the device and shifted by every recorded token. DRY (docs/semantics.md 5.1) reads a slot's
latest history tokens, prompt and output together: `dry_history`, allocated when the first DRY
request is admitted, as deep as the widest DRY window admitted so far, shifted by every recorded
token. Mirostat (docs/semantics.md 10.6) keeps `mirostat`, float64 [S, 3]: each slot's mu, tau and
eta, and `mirostat_surprise`, float64 [S], the surprise of the token a step just drew (NaN: none
pending; not moved: a step sets and consumes it), both allocated at the first Mirostat admission;
mu is set to 2 tau by `write_params` and `rebuild_history`, moved with the slot, and updated by
`record_tokens` from the surprise the draw left. Every token id given here is global;
the layout translates it to this rank's columns (a vocabulary split keeps only its slice; the bad
words' and DRY's histories keep global ids on every rank).

This object is the one owner of a slot's state. Beside the device columns it keeps the slot's host
record: `params`, `seeds`, `drawn` (the seed was drawn for an unseeded request) and `streams`, so
that a step is planned and a slot is described without reading the device. Those change only
through the methods here (admission, `set_noise`, `move`, `release`), which write the host record
and the device columns together. The position has one copy, the device column: the steps advance
it there (`record_tokens`), and `positions` reads it.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..core import rng
from ..core.dry import DRY_MAX_HISTORY, dry_window
from ..core.params import SamplingParams
from .layout import VocabLayout
from .row_fill import fill_rows

_INT64_MAX = 2**63 - 1
MU, TAU, ETA = range(3)  # the columns of `SamplerState.mirostat`


class SlotRecord(NamedTuple):
    """The host record of one slot (its position is on the device: `SamplerState.positions`)."""

    params: SamplingParams | None
    seed: int | None
    drawn: bool
    stream: int


class SamplerState:
    """Device tensors indexed by slot over `layout.width` ids; `move` relocates whole slots."""

    def __init__(self, max_slots: int, layout: VocabLayout, device: torch.device) -> None:
        self.max_slots = max_slots
        self.layout = layout
        self.width = layout.width
        self.device = device

        def column(value: float | int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((max_slots,), value, dtype=dtype, device=device)

        self.temperature = column(1.0, torch.float32)
        self.top_k = column(0, torch.int64)
        self.top_p = column(1.0, torch.float64)  # compared with float64 masses
        self.min_p = column(0.0, torch.float32)
        self.presence = column(0.0, torch.float32)
        self.frequency = column(0.0, torch.float32)
        self.repetition = column(1.0, torch.float32)
        self.min_tokens = column(0, torch.int64)
        self.seed = column(0, torch.int64)
        self.position = column(0, torch.int64)
        self.stream = column(0, torch.int64)
        self.output_len = column(0, torch.int64)
        self.prompt_mask = torch.zeros((max_slots, self.width), dtype=torch.bool, device=device)
        self.output_counts = torch.zeros((max_slots, self.width), dtype=torch.int32, device=device)
        self.logit_bias: torch.Tensor | None = None
        self.allowed_mask: torch.Tensor | None = None
        self.stop_mask: torch.Tensor | None = None
        # bad words: int64 [S, words, L] global ids right-aligned (the last token in column L - 1),
        # -1 = no constraint (padding); recent_tokens: int64 [S, L - 1], the slot's latest output
        # tokens right-aligned (the newest last), -2 = none (a shorter output, or not kept)
        self.bad_words: torch.Tensor | None = None
        self.recent_tokens: torch.Tensor | None = None
        # DRY: int32 [S, depth] each slot's latest prompt + output tokens (global ids) right-aligned,
        # the newest last, -1 = none (a shorter history)
        self.dry_history: torch.Tensor | None = None
        # Mirostat: float64 [S, 3] (MU, TAU, ETA) and [S] (the drawn token's surprise, NaN: none),
        # None until a Mirostat request is admitted
        self.mirostat: torch.Tensor | None = None
        self.mirostat_surprise: torch.Tensor | None = None
        # the host record, written with the device columns (never after them): what the sampler
        # plans a step from and answers slot queries from without a device read
        self.params: list[SamplingParams | None] = [None] * max_slots
        self.seeds: list[int | None] = [None] * max_slots  # None: no seed (a placeholder row)
        self.drawn: list[bool] = [False] * max_slots      # the seed was drawn for an unseeded request
        self.streams: list[int] = [0] * max_slots
        self._kept_ones: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # `_ones`

    def slot_tensors(self) -> list[torch.Tensor]:
        tensors = [self.temperature, self.top_k, self.top_p, self.min_p, self.presence, self.frequency,
                   self.repetition, self.min_tokens, self.seed, self.position, self.stream, self.output_len,
                   self.prompt_mask, self.output_counts]
        optional = (self.logit_bias, self.allowed_mask, self.stop_mask, self.bad_words, self.recent_tokens,
                    self.dry_history, self.mirostat)
        return tensors + [t for t in optional if t is not None]

    @property
    def history_depth(self) -> int:
        """How many of each slot's latest output tokens the state keeps (for bad words; 0: none)."""
        return 0 if self.recent_tokens is None else self.recent_tokens.shape[1]

    def _reserve_bad_words(self, num_words: int, length: int) -> torch.Tensor:
        """The bad-word table, grown (right-aligned, contents kept) to hold `num_words` words of up
        to `length` tokens; the kept history grows with it (new older columns: none)."""
        table = self.bad_words
        old_words, old_length = (0, 0) if table is None else table.shape[1:]
        words, length = max(num_words, old_words, 1), max(length, old_length, 1)
        if table is None or (words, length) != (old_words, old_length):
            grown = torch.full((self.max_slots, words, length), -1, dtype=torch.int64, device=self.device)
            if table is not None:
                grown[:, :old_words, length - old_length:] = table
            self.bad_words = table = grown
        depth = length - 1
        if depth > self.history_depth:
            recent = torch.full((self.max_slots, depth), -2, dtype=torch.int64, device=self.device)
            if self.recent_tokens is not None:
                recent[:, depth - self.recent_tokens.shape[1]:] = self.recent_tokens
            self.recent_tokens = recent
        return table

    @property
    def dry_depth(self) -> int:
        """How many of each slot's latest history tokens the state keeps for DRY (0: none)."""
        return 0 if self.dry_history is None else self.dry_history.shape[1]

    def _reserve_dry_history(self, depth: int) -> None:
        """The DRY history, grown (right-aligned, contents kept; new older columns: none) to `depth`."""
        if depth > self.dry_depth:
            grown = torch.full((self.max_slots, depth), -1, dtype=torch.int32, device=self.device)
            if self.dry_history is not None:
                grown[:, depth - self.dry_depth:] = self.dry_history
            self.dry_history = grown

    def _dense(self, name: str, dtype: torch.dtype, fill: float | bool) -> torch.Tensor:
        tensor = getattr(self, name)
        if tensor is None:
            tensor = torch.full((self.max_slots, self.width), fill, dtype=dtype, device=self.device)
            setattr(self, name, tensor)
        return tensor

    def admit(self, slot: int, params: SamplingParams, seed: int, position: int, stream: int,
              prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
              eos_token_ids: Sequence[int], drawn: bool = False) -> None:
        """Write every column of `slot` (ids already checked against the vocabulary)."""
        self.write_params([slot], [params], eos_token_ids)
        self.write_request(slot, seed, position, stream, prompt_token_ids, output_token_ids, drawn)

    def write_request(self, slot: int, seed: int, position: int, stream: int, prompt_token_ids: Sequence[int],
                      output_token_ids: Sequence[int], drawn: bool = False) -> None:
        """Write the slot's noise coordinates and history (not its parameters)."""
        values = {"seed": rng.seed_to_int64(seed), "position": position, "stream": stream,
                  "output_len": len(output_token_ids)}
        for name, value in values.items():
            getattr(self, name)[slot] = value
        self.set_history(slot, prompt_token_ids, output_token_ids)
        self.seeds[slot], self.drawn[slot], self.streams[slot] = seed, drawn, stream

    def write_params(self, slots: Sequence[int], params: Sequence[SamplingParams],
                     eos_token_ids: Sequence[int]) -> None:
        """Write the parameter columns of `slots[i]` from `params[i]` (not their seeds, positions or
        histories), all at once: one indexed write per column, and the optional dense columns row by
        row only where they exist or a request uses them."""
        if not len(slots):
            return
        index = torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        columns = (  # top_k and min_tokens have no upper bound: beyond int64 they mean what 2^63 - 1 does
            (self.temperature, [p.temperature for p in params]),
            (self.top_k, [min(p.top_k, _INT64_MAX) for p in params]),
            (self.top_p, [p.top_p for p in params]), (self.min_p, [p.min_p for p in params]),
            (self.presence, [p.presence_penalty for p in params]),
            (self.frequency, [p.frequency_penalty for p in params]),
            (self.repetition, [p.repetition_penalty for p in params]),
            (self.min_tokens, [min(p.min_tokens, _INT64_MAX) for p in params]),
        )
        for column, values in columns:
            column[index] = torch.tensor(values, dtype=column.dtype, device=self.device)
        layout = self.layout
        if self.logit_bias is not None or any(p.logit_bias for p in params):
            bias = self._dense("logit_bias", torch.float32, 0.0)
            bias[index] = 0.0
            for slot, p in zip(slots, params):
                mine = {t - layout.offset: v for t, v in (p.logit_bias or {}).items() if layout.holds(t)}
                if mine:
                    bias[slot, list(mine)] = torch.tensor(list(mine.values()), dtype=torch.float32,
                                                          device=self.device)
        if self.allowed_mask is not None or any(p.allowed_token_ids is not None for p in params):
            allowed = self._dense("allowed_mask", torch.bool, True)
            allowed[index] = True
            for slot, p in zip(slots, params):
                if p.allowed_token_ids is not None:
                    allowed[slot] = False
                    allowed[slot, layout.local(p.allowed_token_ids)] = True
        eos = list(eos_token_ids)
        stops = [list(p.stop_token_ids) + eos if p.min_tokens > 0 else [] for p in params]
        if self.stop_mask is not None or any(stops):
            stop = self._dense("stop_mask", torch.bool, False)
            stop[index] = False
            for slot, ids in zip(slots, stops):
                if ids:
                    stop[slot, layout.local(ids)] = True
        if self.bad_words is not None or any(p.bad_words_token_ids for p in params):
            words_of = [p.bad_words_token_ids for p in params]
            table = self._reserve_bad_words(max(len(w) for w in words_of),
                                            max((len(word) for w in words_of for word in w), default=1))
            table[index] = -1
            length = table.shape[2]
            for slot, words in zip(slots, words_of):
                for w, word in enumerate(words):  # global ids: every rank matches the same history
                    table[slot, w, length - len(word):] = torch.tensor(word, dtype=torch.int64, device=self.device)
        windows = [dry_window(p.dry_penalty_last_n, DRY_MAX_HISTORY) for p in params if p.dry]
        if windows:
            self._reserve_dry_history(max(windows))
        if self.mirostat is not None or any(p.mirostat_tau is not None for p in params):
            if self.mirostat is None:
                self.mirostat = torch.zeros((self.max_slots, 3), dtype=torch.float64, device=self.device)
                self.mirostat_surprise = torch.full((self.max_slots,), float("nan"), dtype=torch.float64,
                                                    device=self.device)
            taus = [0.0 if p.mirostat_tau is None else p.mirostat_tau for p in params]
            self.mirostat[index] = torch.tensor([[2.0 * tau, tau, p.mirostat_eta] for tau, p in zip(taus, params)],
                                                dtype=torch.float64, device=self.device)
        for slot, p in zip(slots, params):
            self.params[slot] = p

    def set_history(self, slot: int, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """Rebuild the slot's prompt mask and output counts from global token lists."""
        prompt = self.layout.local(prompt_token_ids)
        outputs = self.layout.local(output_token_ids)
        self.prompt_mask[slot] = False
        if prompt:
            self.prompt_mask[slot, torch.as_tensor(prompt, dtype=torch.int64, device=self.device)] = True
        counts = torch.bincount(torch.as_tensor(outputs, dtype=torch.int64), minlength=self.width)
        self.output_counts[slot] = counts.to(device=self.device, dtype=torch.int32)
        depth = self.history_depth
        if depth:
            latest = list(output_token_ids)[-depth:]
            row = [-2] * (depth - len(latest)) + [int(t) for t in latest]
            self.recent_tokens[slot] = torch.tensor(row, dtype=torch.int64, device=self.device)
        depth = self.dry_depth
        if depth:
            latest = [*prompt_token_ids, *output_token_ids][-depth:]
            row = [-1] * (depth - len(latest)) + [int(t) for t in latest]
            self.dry_history[slot] = torch.tensor(row, dtype=torch.int32, device=self.device)

    def release(self, slot: int) -> None:
        self.params[slot] = None
        self.seeds[slot] = None
        self.drawn[slot] = False
        self.streams[slot] = 0

    def record(self, slot: int) -> SlotRecord:
        return SlotRecord(self.params[slot], self.seeds[slot], self.drawn[slot], self.streams[slot])

    def _host_record(self) -> tuple[list, ...]:
        return self.params, self.seeds, self.drawn, self.streams

    def move(self, dst_slots: Sequence[int], src_slots: Sequence[int]) -> None:
        """State of `src_slots[i]` goes to `dst_slots[i]` for all i at once (a gather, then a scatter),
        device columns and host record alike."""
        dst, src = [int(s) for s in dst_slots], [int(s) for s in src_slots]
        index = lambda slots: torch.tensor(slots, dtype=torch.int64, device=self.device)  # noqa: E731
        dst_index, src_index = index(dst), index(src)
        for tensor in self.slot_tensors():
            tensor[dst_index] = tensor[src_index]
        for column in self._host_record():
            values = [column[s] for s in src]
            for d, value in zip(dst, values):
                column[d] = value

    def positions(self, slots: Sequence[int]) -> list[int]:
        """The device positions of `slots` (one read: a host sync)."""
        if not len(slots):
            return []
        return self.position[torch.tensor(list(slots), dtype=torch.int64, device=self.device)].tolist()

    def advance(self, slots: Sequence[int], counts: Sequence[int]) -> None:
        """Add `counts[i]` to the position of `slots[i]` (tokens sampled elsewhere), on the device."""
        if len(slots):
            as_tensor = lambda values: torch.tensor(list(values), dtype=torch.int64, device=self.device)  # noqa: E731
            self.position.index_add_(0, as_tensor(slots), as_tensor(counts))

    def record_tokens(self, slots: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Step 13: count each sampled token (global id) into its slot's history, on the rank that
        holds it, and advance the slot's position and output length: O(B), no host sync.

        mask: optional bool [B]; rows where it is False are left untouched (their count and
        position get + 0, so the update has the same shape either way). When bad words are held,
        each recorded token also enters its slot's latest output tokens (a shift by one: O(B x
        history_depth), on the device).
        """
        ones = self._ones(slots.shape[0], torch.int64) if mask is None else mask.to(device=slots.device,
                                                                                   dtype=torch.int64)
        if self.layout.split:
            local = tokens - self.layout.offset
            mine = (local >= 0) & (local < self.layout.real_width)
            columns, counted = local.clamp(0, self.width - 1), (mine.to(torch.int64) * ones).to(torch.int32)
        else:
            columns = tokens
            counted = self._ones(slots.shape[0], torch.int32) if mask is None else ones.to(torch.int32)
        self.output_counts.index_put_((slots, columns), counted, accumulate=True)
        self.position.index_add_(0, slots, ones)
        self.output_len.index_add_(0, slots, ones)
        if self.recent_tokens is not None:  # the latest tokens shift by one: O(B * depth)
            old = self.recent_tokens[slots]
            shifted = torch.cat([old[:, 1:], tokens.to(torch.int64)[:, None]], dim=1)
            if mask is not None:
                shifted = torch.where(mask.to(device=slots.device)[:, None], shifted, old)
            self.recent_tokens[slots] = shifted
        if self.dry_history is not None:  # DRY's history shifts by one: O(B * dry_depth)
            old = self.dry_history[slots]
            shifted = torch.cat([old[:, 1:], tokens.to(torch.int32)[:, None]], dim=1)
            if mask is not None:
                shifted = torch.where(mask.to(device=slots.device)[:, None], shifted, old)
            self.dry_history[slots] = shifted
        if self.mirostat is not None:
            self._update_mu(slots, mask)

    def _ones(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """A [count] tensor of ones on the device, kept per (count, dtype): each step's history update
        adds it without a fresh allocation (only read, never written)."""
        key = (count, dtype)
        kept = self._kept_ones.get(key)
        if kept is None:
            if len(self._kept_ones) > 16:
                self._kept_ones.clear()
            kept = self._kept_ones[key] = torch.ones(count, dtype=dtype, device=self.device)
        return kept

    def _update_mu(self, slots: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Step 13 for Mirostat: mu -= eta (surprise - tau) on each recorded row whose draw left a
        surprise (10.6 ran), in float64; every row's pending surprise is cleared."""
        rows = self.mirostat[slots]
        surprise = self.mirostat_surprise[slots]
        pending = ~torch.isnan(surprise)
        if mask is not None:
            pending &= mask.to(device=slots.device)
        mu = rows[:, MU] - rows[:, ETA] * (surprise - rows[:, TAU])
        self.mirostat[slots, MU] = torch.where(pending, mu, rows[:, MU])
        self.mirostat_surprise[slots] = float("nan")

    def mus(self, slots: Sequence[int]) -> list[float]:
        """The mu of `slots` (one device read; 0 where Mirostat was never admitted)."""
        if self.mirostat is None or not len(slots):
            return [0.0] * len(slots)
        return self.mirostat[torch.tensor(list(slots), dtype=torch.int64, device=self.device), MU].tolist()

    def set_mus(self, slots: Sequence[int], mus: Sequence[float]) -> None:
        """Overwrite the mu of Mirostat slots (checked values)."""
        if len(slots):
            index = torch.tensor(list(slots), dtype=torch.int64, device=self.device)
            self.mirostat[index, MU] = torch.tensor(list(mus), dtype=torch.float64, device=self.device)

    def set_noise(self, slots: Sequence[int], seeds: Sequence[int | None], positions: Sequence[int | None],
                  streams: Sequence[int], drawn: Sequence[bool]) -> None:
        """Overwrite the noise coordinates of `slots` (checked values), host record and device columns.

        seeds[i] None: no seed (a placeholder row; the device column holds 0); positions[i] None:
        the slot keeps its position."""
        if not len(slots):
            return
        as_tensor = lambda values: torch.tensor(list(values), dtype=torch.int64, device=self.device)  # noqa: E731
        index = as_tensor(slots)
        self.seed[index] = as_tensor([0 if s is None else rng.seed_to_int64(s) for s in seeds])
        self.stream[index] = as_tensor(streams)
        given = [i for i, p in enumerate(positions) if p is not None]
        if len(given) == len(slots):
            self.position[index] = as_tensor(positions)
        elif given:
            self.position[as_tensor([slots[i] for i in given])] = as_tensor([positions[i] for i in given])
        for slot, seed, stream, was_drawn in zip(slots, seeds, streams, drawn):
            self.seeds[slot], self.streams[slot], self.drawn[slot] = seed, stream, bool(was_drawn)

    @staticmethod
    def _real_pairs(slots: torch.Tensor, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot, column) of every id >= 0 of `local` ([len(slots), S] columns, -1 = none)."""
        real = local >= 0
        return slots[:, None].expand_as(local)[real], local[real]

    def rebuild_history(self, slots: torch.Tensor, prompt_tokens: torch.Tensor | None,
                        output_tokens: torch.Tensor | None) -> None:
        """Rebuild the penalty history of `slots` from `[len(slots), S]` int64 global ids, -1 = padding.

        prompt_tokens None keeps the prompt mask; output_tokens None clears the output counts.
        The output length (for min_tokens) becomes the number of output ids (all of them, also
        those another rank holds); the kept latest output tokens (bad words) become the last
        `history_depth` of them (padding skipped wherever it is), and DRY's history the last
        `dry_depth` of prompt + outputs (prompt_tokens None: the prompt tokens it kept, which are
        fewer than the prompt when the outputs it replaces had pushed some out).
        """
        old_lengths = self.output_len[slots].tolist() if self.dry_history is not None else []
        # written in place, row by id: a [len(slots), V] temporary would be allocated (page-faulted)
        # and copied on every admission
        if prompt_tokens is not None:
            rows, ids = self._real_pairs(slots, self.layout.local_tensor(prompt_tokens))
            fill_rows(self.prompt_mask, slots, False)
            self.prompt_mask[rows, ids] = True
        fill_rows(self.output_counts, slots, 0)
        lengths = torch.zeros(slots.numel(), dtype=torch.int64, device=self.device)
        if output_tokens is not None:
            rows, ids = self._real_pairs(slots, self.layout.local_tensor(output_tokens))
            self.output_counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
            lengths = (output_tokens >= 0).sum(dim=1)
        self.output_len[slots] = lengths
        depth = self.history_depth
        if depth:
            recent = torch.full((slots.numel(), depth + 1), -2, dtype=torch.int64, device=self.device)
            if output_tokens is not None:  # the last `depth` real ids of each row, right-aligned
                real = output_tokens >= 0
                from_end = real.flip(1).cumsum(1).flip(1)  # real ids at or after each column
                kept = real & (from_end <= depth)
                column = torch.where(kept, depth - from_end, torch.full_like(from_end, depth))
                recent.scatter_(1, column, torch.where(kept, output_tokens, torch.full_like(output_tokens, -2)))
            self.recent_tokens[slots] = recent[:, :depth]
        if self.dry_history is not None:
            self._rebuild_dry_history(slots, prompt_tokens, output_tokens, old_lengths)
        if self.mirostat is not None:  # a rebuilt history starts Mirostat afresh: mu = 2 tau
            self.mirostat[slots, MU] = 2.0 * self.mirostat[slots, TAU]

    def _rebuild_dry_history(self, slots: torch.Tensor, prompt_tokens: torch.Tensor | None,
                             output_tokens: torch.Tensor | None, old_output_lengths: list[int]) -> None:
        """DRY's history of `slots` rebuilt: the prompt (given, or the kept tokens before the old
        outputs), then the outputs, the last `dry_depth` real ids right-aligned (a row at a time:
        admissions and resumptions, not steps)."""
        depth = self.dry_depth
        for i, slot in enumerate(slots.tolist()):
            if prompt_tokens is not None:
                prompt = prompt_tokens[i][prompt_tokens[i] >= 0].to(torch.int32)
            else:
                kept = self.dry_history[slot]
                kept = kept[kept >= 0]
                prompt = kept[:max(0, kept.numel() - old_output_lengths[i])]
            outputs = (output_tokens[i][output_tokens[i] >= 0].to(torch.int32) if output_tokens is not None
                       else prompt.new_empty(0))
            latest = torch.cat([prompt, outputs])[-depth:]
            self.dry_history[slot] = -1
            if latest.numel():
                self.dry_history[slot, depth - latest.numel():] = latest
