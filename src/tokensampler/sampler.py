"""`Sampler`: one sampling step for a batch of slots, with the per-slot state it keeps.

The step follows the definition (docs/semantics.md) without sorting the vocabulary
(docs/cpu-fast-path.md). The batch is cut into row blocks of about `BLOCK_ELEMENTS` logits, each
copied once into a reused float32 workspace and finished while it is in cache:

1. float32 logits, padding and NaN removed                     `masking.prepare_logits_into`
3. allowed ids; stop and EOS ids below min_tokens               `remove_disallowed`, `remove_stop_ids`
4. logit bias (rows that have one)                              `z + bias`
5. penalties (penalised rows, at the ids they have seen)        `penalties.apply_penalties_rows_`
6. greedy rows: lowest id among the maxima                      `argmax` (no copy if nothing to edit)
7.-11. temperature, min-p, top-k, top-p as one threshold per row, Gumbel argmax with exact noise
   only where a token can still win                             `fused.sample_rows`
2./12. raw or processed logprobs, rows that asked               `logprobs.gather_logprobs`
13. the token is counted into the slot's history, its position advances   `SamplerState.record_tokens`

Which steps run is planned on the host from the admitted parameters (`plan_step`); on a CPU the
step reads small per-row results back to choose routes (documented in docs/cpu-fast-path.md).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from . import kernels, rng
from .ops import fused, logprobs, masking, penalties
from .ops.argmax import first_argmax
from .output import LogprobsOutput, SamplerOutput
from .params import (INT64_MIN, UINT64_MAX, InvalidSamplingParams, SamplingParams, check_params_for_vocab,
                     check_token_ids)
from .reference import LOGPROBS_MODES
from .state import SamplerState

LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_ELEMENTS = 1 << 21  # elements per row block of the step (a few MB: measured best on 2 cores)


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _plain_greedy(p: SamplingParams) -> bool:
    return (p.greedy and not _has_penalties(p) and not p.logit_bias and p.allowed_token_ids is None
            and p.min_tokens == 0)


def _positions(rows: Sequence[SamplingParams], pred) -> list[int]:
    return [b for b, p in enumerate(rows) if pred(p)]


def _blocks(positions: list[int], size: int) -> list[list[int]]:
    """`positions` cut into consecutive blocks of at most `size`."""
    return [positions[i:i + size] for i in range(0, len(positions), size)]


@dataclass(frozen=True)
class StepPlan:
    """What a step must do, decided on the host from the rows' parameters."""

    greedy_rows: list[int]
    sampled_rows: list[int]
    penalties: bool
    logit_bias: bool
    allowed_ids: bool
    min_tokens: bool
    min_p: bool
    top_k: bool
    top_p: bool
    num_logprobs: list[int]  # -1 = row did not ask
    logprobs_width: int

    @property
    def wants_logprobs(self) -> bool:
        return any(n >= 0 for n in self.num_logprobs)


def plan_step(rows: Sequence[SamplingParams], vocab_size: int) -> StepPlan:
    """The step plan for rows with these parameters (no device access)."""
    sampled = [b for b, p in enumerate(rows) if not p.greedy]
    num_logprobs = [-1 if p.logprobs is None else (vocab_size if p.logprobs == -1 else min(p.logprobs, vocab_size))
                    for p in rows]
    return StepPlan(
        greedy_rows=[b for b, p in enumerate(rows) if p.greedy],
        sampled_rows=sampled,
        penalties=any(p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                      for p in rows),
        logit_bias=any(p.logit_bias for p in rows),
        allowed_ids=any(p.allowed_token_ids is not None for p in rows),
        min_tokens=any(p.min_tokens > 0 for p in rows),
        min_p=any(rows[b].min_p > 0.0 for b in sampled),
        top_k=any(rows[b].top_k > 0 for b in sampled),
        top_p=any(rows[b].top_p < 1.0 for b in sampled),
        num_logprobs=num_logprobs,
        logprobs_width=max(num_logprobs, default=-1),
    )


class Sampler:
    """Samples the next token of every slot in a batch, exactly as section 1 of the design defines.

    vocab_size: the real vocabulary V; ids >= V are padding and never returned.
    max_slots: number of request slots kept on the device.
    padded_vocab_size: the logits' width Vp >= V (default V).
    logprobs_mode: "raw_logprobs" | "raw_logits" | "processed_logprobs" | "processed_logits" (vLLM's).
    max_logprobs: the largest N a request may ask (-1, the whole vocabulary, is always allowed).
    eos_token_ids: removed, with each request's stop ids, while it is below its min_tokens.
    group: a torch.distributed process group (or a `distributed.Exchange`) over which the
      vocabulary is split: each rank passes its slice [B, padded_vocab_size / world] and every
      rank gets the same output (see docs/distributed.md).
    """

    def __init__(self, vocab_size: int, *, max_slots: int, device: torch.device | str = "cpu",
                 padded_vocab_size: int | None = None, logprobs_mode: str = "raw_logprobs",
                 max_logprobs: int = 20, eos_token_ids: Sequence[int] = (), group: Any = None) -> None:
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise InvalidSamplingParams("vocab_size", vocab_size, "an int >= 1")
        if not isinstance(max_slots, int) or max_slots < 1:
            raise InvalidSamplingParams("max_slots", max_slots, "an int >= 1")
        padded = vocab_size if padded_vocab_size is None else padded_vocab_size
        if not isinstance(padded, int) or padded < vocab_size:
            raise InvalidSamplingParams("padded_vocab_size", padded_vocab_size, f"None or an int >= {vocab_size}")
        if logprobs_mode not in LOGPROBS_MODES:
            raise InvalidSamplingParams("logprobs_mode", logprobs_mode, f"one of {LOGPROBS_MODES}")
        if not isinstance(max_logprobs, int) or max_logprobs < 0:
            raise InvalidSamplingParams("max_logprobs", max_logprobs, "an int >= 0")
        check_token_ids("eos_token_ids", eos_token_ids, vocab_size)
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded
        self.max_slots = max_slots
        self.device = torch.device(device)
        self.logprobs_mode = logprobs_mode
        self.max_logprobs = max_logprobs
        self.eos_token_ids = tuple(eos_token_ids)
        self._z_workspace: torch.Tensor | None = None
        self._split = None
        if group is not None:  # vocabulary split: the slice's state and step live in distributed.py
            from .distributed import VocabSplit
            self._split = VocabSplit(self, group)
        self.state = SamplerState(max_slots, vocab_size, self.device) if self._split is None else self._split.state
        self._kernel_step = None  # the Triton step (kernels/), made on first use

    # ---------------------------------------------------------------- admission
    def add_request(self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int], *,
                    output_token_ids: Sequence[int] = (), position: int | None = None,
                    stream: int = 0) -> int:
        """Admit a request into `slot` (replacing whatever it held). Returns its effective seed.

        position: of the next token to sample; default len(prompt) + len(outputs).
        stream: the noise stream (choice i of an n > 1 request uses stream i).
        Everything is checked before any state changes.
        """
        if self._split is not None:
            return self._split.add_request(slot, params, prompt_token_ids, output_token_ids=output_token_ids,
                                           position=position, stream=stream)
        self._check_slot(slot)
        if not isinstance(params, SamplingParams):
            raise InvalidSamplingParams("params", params, "a SamplingParams")
        check_params_for_vocab(params, self.vocab_size, self.max_logprobs)
        prompt = self._token_list("prompt_token_ids", prompt_token_ids)
        outputs = self._token_list("output_token_ids", output_token_ids)
        if position is None:
            position = len(prompt) + len(outputs)
        if not isinstance(position, int) or not 0 <= position < 2**32:
            raise InvalidSamplingParams("position", position, "an int in [0, 2^32)")
        if not isinstance(stream, int) or not 0 <= stream < 2**32:
            raise InvalidSamplingParams("stream", stream, "an int in [0, 2^32)")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.state.admit(slot, params, seed, position, stream, prompt, outputs, self.eos_token_ids)
        return seed

    def set_params(self, slot: int, params: SamplingParams) -> None:
        """Replace the parameters of an occupied `slot`, keeping its seed, position and history."""
        if self._split is not None:
            return self._split.set_params(slot, params)
        self._check_set_params(slot, params)
        self.state.write_params(slot, params, self.eos_token_ids)

    def set_noise(self, slots: Sequence[int], seeds: Sequence[int], positions: Sequence[int],
                  streams: Sequence[int]) -> None:
        """Set the seed, position and stream of occupied slots (one entry per slot), all at once."""
        if self._split is not None:
            return self._split.set_noise(slots, seeds, positions, streams)
        self._write_noise(*self._check_noise(slots, seeds, positions, streams))

    def reset_history(self, slots: Sequence[int], prompt_token_ids: torch.Tensor | None,
                      output_token_ids: torch.Tensor | None) -> None:
        """Rebuild the penalty history of occupied slots from `[len(slots), S]` ids, -1 = padding.

        prompt_token_ids None keeps the prompt history; output_token_ids None clears the outputs
        (and the output length that min_tokens counts).
        """
        if self._split is not None:
            return self._split.reset_history(slots, prompt_token_ids, output_token_ids)
        self.state.rebuild_history(*self._check_history(slots, prompt_token_ids, output_token_ids))

    def _check_set_params(self, slot: int, params: SamplingParams) -> None:
        self._check_occupied(slot)
        if not isinstance(params, SamplingParams):
            raise InvalidSamplingParams("params", params, "a SamplingParams")
        check_params_for_vocab(params, self.vocab_size, self.max_logprobs)

    def _check_noise(self, slots: Sequence[int], seeds: Sequence[int], positions: Sequence[int],
                     streams: Sequence[int]) -> tuple[list[int], list[int], list[int], list[int]]:
        """The checked (slots, seeds, positions, streams) of `set_noise`, as lists."""
        slots, seeds, positions, streams = (list(v) for v in (slots, seeds, positions, streams))
        for slot in slots:
            self._check_occupied(slot)
        if not len(slots) == len(seeds) == len(positions) == len(streams):
            raise InvalidSamplingParams("seeds/positions/streams", (len(seeds), len(positions), len(streams)),
                                        f"one entry per slot ({len(slots)})")
        for name, values, low, high in (("seed", seeds, INT64_MIN, UINT64_MAX), ("position", positions, 0, 2**32 - 1),
                                        ("stream", streams, 0, 2**32 - 1)):
            for value in values:
                if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                    raise InvalidSamplingParams(name, value, f"an int in [{low}, {high}]")
        return slots, seeds, positions, streams

    def _write_noise(self, slots: list[int], seeds: list[int], positions: list[int], streams: list[int]) -> None:
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=self.device)  # noqa: E731
        self.state.set_noise(as_tensor(slots), as_tensor([rng.seed_to_int64(s) for s in seeds]),
                             as_tensor(positions), as_tensor(streams))
        for slot, seed in zip(slots, seeds):
            self.state.seeds[slot] = seed

    def _check_history(self, slots: Sequence[int], prompt_token_ids: torch.Tensor | None,
                       output_token_ids: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(slot index, prompt ids, output ids) of `reset_history`: int64 on the device, global ids."""
        for slot in slots:
            self._check_occupied(slot)
        tensors = []
        for name, ids in (("prompt_token_ids", prompt_token_ids), ("output_token_ids", output_token_ids)):
            if ids is not None:
                if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != len(slots) \
                        or ids.dtype.is_floating_point or ids.dtype == torch.bool:
                    raise InvalidSamplingParams(name, getattr(ids, "shape", ids),
                                                f"an integer tensor [{len(slots)}, S] (-1 = padding)")
                ids = ids.to(device=self.device, dtype=torch.int64)
                if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= self.vocab_size):
                    raise InvalidSamplingParams(name, (int(ids.min()), int(ids.max())),
                                                f"token ids in [0, {self.vocab_size}) or -1 (padding)")
            tensors.append(ids)
        index = torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        return index, tensors[0], tensors[1]

    def remove_request(self, slot: int) -> None:
        """Free `slot`; sampling it again needs a new `add_request`."""
        self._check_slot(slot)
        (self._split or self.state).release(slot)

    def seed_of(self, slot: int) -> int:
        """The effective seed of the request in `slot` (the drawn one for an unseeded request)."""
        self._check_occupied(slot)
        return self.state.seeds[slot]

    def position_of(self, slot: int) -> int:
        """The position of the slot's next token (reads the device: a host sync)."""
        self._check_occupied(slot)
        return int(self.state.position[slot])

    def params_of(self, slot: int) -> SamplingParams:
        self._check_occupied(slot)
        return self.state.params[slot]

    # ---------------------------------------------------------------- the step
    def sample(self, logits: torch.Tensor, slots: Sequence[int] | torch.Tensor | None = None, *,
               record: torch.Tensor | None = None) -> SamplerOutput:
        """Sample one token for each row of `logits` ([B, padded_vocab_size], fp32/fp16/bf16).

        Row b belongs to `slots[b]` (default 0..B-1). Each sampled token is counted into its
        slot's history and the slot's position advances by one.
        record: optional bool [B] on the sampler's device; rows where it is False are sampled but
        neither counted nor advanced (their slot's state is left as it was).
        """
        if self._split is not None:
            return self._split.sample(logits, slots, record=record)
        slot_list = self._check_step(logits, slots)
        self._check_record(record, len(slot_list))
        rows = [self.state.params[s] for s in slot_list]
        plan = plan_step(rows, self.vocab_size)
        if kernels.use_kernels(logits, plan.logprobs_width):
            return self._kernels().run(logits, slot_list, plan, record)
        index = torch.tensor(slot_list, dtype=torch.int64, device=self.device)
        out = self._run(logits, index, plan)
        self.state.record_tokens(index, out.token_ids, record)
        return out

    def _kernels(self):
        """The fused Triton step (it owns its scratch buffers); made on first use."""
        if self._kernel_step is None:
            from .kernels.launcher import KernelStep
            self._kernel_step = KernelStep(self)
        return self._kernel_step

    def _run(self, logits: torch.Tensor, index: torch.Tensor, plan: StepPlan) -> SamplerOutput:
        """Steps 1-12, one block of consecutive rows at a time (cache-sized: every pass over a block
        runs from cache, and no buffer of the logits' size is ever allocated)."""
        batch = logits.shape[0]
        device = logits.device
        rows = [self.state.params[s] for s in index.tolist()]
        tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        valid = torch.ones(batch, dtype=torch.bool, device=device)
        result = None
        if plan.wants_logprobs:
            width = max(plan.logprobs_width, 0)
            result = LogprobsOutput(torch.zeros(batch, dtype=torch.float32, device=device),
                                    torch.zeros(batch, dtype=torch.int64, device=device),
                                    torch.full((batch, width), -1, dtype=torch.int64, device=device),
                                    torch.full((batch, width), float("-inf"), dtype=torch.float32, device=device))
        if all(_plain_greedy(p) for p in rows) and not plan.wants_logprobs:
            self._run_plain_greedy(logits, tokens, valid)
            if bool(valid.all()):
                return SamplerOutput(tokens, valid, None)
        size = self._block_rows
        for start in range(0, batch, size):
            stop = min(batch, start + size)
            self._run_block(logits, index, rows, plan, start, stop, tokens, valid, result)
        return SamplerOutput(tokens, valid, result)

    def _run_plain_greedy(self, logits: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        """Greedy rows with nothing to remove or add: the first maximum of the logits themselves, no
        copy (+inf is a maximum; a NaN found there sends the batch to the general path)."""
        real = logits[:, :self.vocab_size]
        tokens.copy_(first_argmax(real))
        best = real.gather(-1, tokens[:, None]).squeeze(-1)
        valid.copy_(best > float("-inf"))  # all -inf: argmax gives 0, the raw greedy id; NaN: False here

    @property
    def _block_rows(self) -> int:
        """Rows per block: about BLOCK_ELEMENTS logits."""
        return max(1, BLOCK_ELEMENTS // self.vocab_size)

    def _workspace(self, num_rows: int) -> torch.Tensor:
        """The block's float32 `z`, reused from step to step (no allocation on the fast path)."""
        if self._z_workspace is None or self._z_workspace.shape[0] < num_rows:
            self._z_workspace = torch.empty((num_rows, self.vocab_size), dtype=torch.float32, device=self.device)
        return self._z_workspace[:num_rows]

    def _run_block(self, logits: torch.Tensor, index: torch.Tensor, rows: list[SamplingParams],
                   plan: StepPlan, start: int, stop: int, tokens: torch.Tensor, valid: torch.Tensor,
                   result: LogprobsOutput | None) -> None:
        st = self.state
        block_params = rows[start:stop]
        slots = index[start:stop]
        z = masking.prepare_logits_into(self._workspace(stop - start), logits[start:stop])
        may_empty = plan.allowed_ids or plan.min_tokens or plan.penalties or plan.logit_bias
        raw_argmax = first_argmax(z) if may_empty else None  # NaN already -inf; +inf counts as max
        if any(p.allowed_token_ids is not None for p in block_params):
            masking.remove_disallowed(z, st.allowed_mask[slots])
        if any(p.min_tokens > 0 for p in block_params) and st.stop_mask is not None:
            masking.remove_stop_ids(z, st.stop_mask[slots], st.output_len[slots] < st.min_tokens[slots])
        biased = _positions(block_params, lambda p: bool(p.logit_bias))
        if biased:
            z[biased] += st.logit_bias[slots[biased]]
        penalised = _positions(block_params, _has_penalties)
        if penalised:
            slot_list = slots.tolist()
            penalties.apply_penalties_rows_(z, penalised, [slot_list[b] for b in penalised], st.prompt_mask,
                                            st.output_counts, st.repetition, st.frequency, st.presence)
        z_max = z.amax(dim=-1)
        if bool(torch.isposinf(z_max).any()):
            masking.saturate_posinf(z)
            z_max = z.amax(dim=-1)
        block_valid = z_max > float("-inf")
        valid_host = block_valid.tolist()
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
                z[gone] = float("-inf")  # their processed values: z / T, every one -inf
                if raw_argmax is None:
                    raw_argmax = first_argmax(masking.prepare_logits(logits[start:stop], self.vocab_size))
        if sampled:
            block_tokens[sampled] = self._sample_rows(z, z_max, slots, block_params, sampled, processed)
        if raw_argmax is not None:
            block_tokens = torch.where(block_valid, block_tokens, raw_argmax)
        tokens[start:stop] = block_tokens
        valid[start:stop] = block_valid
        if result is not None:
            self._logprobs(logits, z if processed else None, block_tokens, plan, start, stop, result)

    def _sample_rows(self, z: torch.Tensor, z_max: torch.Tensor, slots: torch.Tensor,
                     block_params: list[SamplingParams], sampled: list[int], processed: bool) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p and the Gumbel argmax for the sampled rows of a block."""
        st = self.state
        everyone = len(sampled) == z.shape[0]
        zs = z if everyone else z[sampled]
        params = [block_params[b] for b in sampled]
        s = slots if everyone else slots[sampled]
        cols = fused.RowColumns(
            temperature=st.temperature[s], min_p=st.min_p[s], top_k=st.top_k[s], top_p=st.top_p[s],
            keys=rng.row_key(st.seed[s], st.position[s], st.stream[s]),
            any_min_p=any(p.min_p > 0 for p in params), any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params))
        tokens, tau = fused.sample_rows(zs, z_max if everyone else z_max[sampled], cols, exact_threshold=processed)
        if processed:  # step 12 reads the kept set: every other id at -inf
            zs.masked_fill_(zs < tau[:, None], float("-inf"))
            if not everyone:
                z[sampled] = zs
        return tokens

    def _logprobs(self, logits: torch.Tensor, final: torch.Tensor | None, tokens: torch.Tensor,
                  plan: StepPlan, start: int, stop: int, result: LogprobsOutput) -> None:
        """Step 2/12 for the rows [start, stop) that asked: raw modes rebuild the raw scores from
        `logits`, processed modes read the block's final `z`."""
        asked = [b for b in range(stop - start) if plan.num_logprobs[start + b] >= 0]
        if not asked:
            return
        if final is None:
            rows = logits[start:stop] if len(asked) == stop - start else logits[start:stop][asked]
            scores = rows[:, :self.vocab_size]
            top = scores.amax(dim=-1)  # NaN or +inf anywhere in the rows: the float32 copy with its rules
            if scores.dtype != torch.float32 or not bool(torch.isfinite(top).all()):
                scores = masking.saturate_posinf(masking.prepare_logits(rows, self.vocab_size))
        else:
            scores = final[asked]
        values = logprobs.log_softmax_rows(scores) if self.logprobs_mode.endswith("logprobs") else scores
        num = torch.tensor([plan.num_logprobs[start + b] for b in asked], dtype=torch.int64, device=tokens.device)
        part = logprobs.gather_logprobs(scores, values, tokens[asked], num, result.top_token_ids.shape[1])
        where = [start + b for b in asked]
        result.token_logprobs[where] = part.token_logprobs
        result.token_ranks[where] = part.token_ranks
        result.top_token_ids[where] = part.top_token_ids
        result.top_logprobs[where] = part.top_logprobs

    # ---------------------------------------------------------------- checks
    def _check_record(self, record: torch.Tensor | None, batch: int) -> None:
        if record is not None and (not isinstance(record, torch.Tensor) or record.dtype != torch.bool
                                   or tuple(record.shape) != (batch,)):
            raise InvalidSamplingParams("record", getattr(record, "shape", record),
                                        f"None or a bool tensor of shape ({batch},)")

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_slots:
            raise InvalidSamplingParams("slot", slot, f"an int in [0, {self.max_slots})")

    def _check_occupied(self, slot: int) -> None:
        self._check_slot(slot)
        if self.state.params[slot] is None:
            raise InvalidSamplingParams("slot", slot, "a slot holding a request (add_request first)")

    def _token_list(self, name: str, ids: Sequence[int] | torch.Tensor) -> list[int]:
        out = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        check_token_ids(name, out, self.vocab_size)
        return out

    def _check_step(self, logits: torch.Tensor, slots) -> list[int]:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            raise InvalidSamplingParams("logits", getattr(logits, "shape", logits),
                                        f"a 2-d tensor [B, {self.padded_vocab_size}]")
        if logits.shape[1] != self.padded_vocab_size:
            raise InvalidSamplingParams("logits.shape[1]", logits.shape[1],
                                        f"the padded vocabulary size {self.padded_vocab_size}")
        if logits.dtype not in LOGITS_DTYPES:
            raise InvalidSamplingParams("logits.dtype", logits.dtype, "float32, float16 or bfloat16")
        if logits.device != self.device and not (logits.device.type == self.device.type == "cuda"):
            raise InvalidSamplingParams("logits.device", logits.device, f"the sampler's device {self.device}")
        batch = logits.shape[0]
        if slots is None:
            slot_list = list(range(batch))
        else:
            slot_list = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        if len(slot_list) != batch:
            raise InvalidSamplingParams("slots", slot_list, f"{batch} slots, one per logits row")
        if len(set(slot_list)) != len(slot_list):
            raise InvalidSamplingParams("slots", slot_list, "distinct slots")
        for slot in slot_list:
            self._check_occupied(slot)
        return slot_list
