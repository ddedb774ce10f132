"""`Sampler`: one sampling step for a batch of slots, with the per-slot state it keeps.

The step, in the order of the definition (docs/semantics.md), each a small function in `ops/`:

1. float32 logits, padding and NaN removed                     `prepare_logits`
2. raw logprobs / logits, if a row asked (raw modes)            `log_softmax_rows`
3. allowed ids; stop and EOS ids below min_tokens               `remove_disallowed`, `remove_stop_ids`
4. logit bias                                                   `z + bias`
5. repetition, frequency, presence penalties                    `apply_penalties`
6. greedy rows: lowest id among the maxima                      `argmax`
7. temperature                                                  `z / T`
8.-10. min-p, top-k, top-p                                      `apply_min_p`, `apply_top_k`, `apply_top_p`
11. Gumbel argmax with counter-based noise                      `gumbel_argmax`
12. processed logprobs / logits (processed modes)
13. the token is counted into the slot's history, its position advances   `SamplerState.record_tokens`

Which steps run is planned on the host from the admitted parameters, so a step reads nothing
back from the device except where documented (`slots` given as a device tensor).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from . import kernels, rng
from .ops import filters, gumbel, logprobs, masking, penalties
from .output import SamplerOutput
from .params import (INT64_MIN, UINT64_MAX, InvalidSamplingParams, SamplingParams, check_params_for_vocab,
                     check_token_ids)
from .reference import LOGPROBS_MODES
from .state import SamplerState

LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
        st = self.state
        z = masking.prepare_logits(logits, self.vocab_size)
        raw = masking.saturate_posinf(z.clone())
        if plan.allowed_ids:
            z = masking.remove_disallowed(z, st.allowed_mask[index])
        if plan.min_tokens:
            below = st.output_len[index] < st.min_tokens[index]
            z = masking.remove_stop_ids(z, st.stop_mask[index], below)
        if plan.logit_bias:
            z = z + st.logit_bias[index]
        if plan.penalties:
            z = penalties.apply_penalties(z, st.prompt_mask[index], st.output_counts[index],
                                          st.repetition[index], st.frequency[index], st.presence[index])
        z = masking.saturate_posinf(z)
        valid = ~torch.isneginf(z).all(dim=-1)
        tokens = z.argmax(dim=-1)  # greedy rows; sampled rows are overwritten below
        final = z
        if plan.sampled_rows:
            rows = torch.tensor(plan.sampled_rows, dtype=torch.int64, device=self.device)
            zs = self._filter(z[rows], index[rows], plan)
            slots = index[rows]
            tokens[rows] = gumbel.gumbel_argmax(zs, st.seed[slots], st.position[slots], st.stream[slots])
            valid[rows] &= ~torch.isneginf(zs).all(dim=-1)  # z / T may underflow every id to -inf
            if self.logprobs_mode.startswith("processed"):
                final = z.clone()
                final[rows] = zs
        tokens = torch.where(valid, tokens, raw.argmax(dim=-1))
        out = SamplerOutput(tokens, valid, None)
        if plan.wants_logprobs:
            scores = raw if self.logprobs_mode.startswith("raw") else final
            out.logprobs = self._logprobs(scores, tokens, plan)
        return out

    def _filter(self, z: torch.Tensor, slots: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p on the sampled rows."""
        st = self.state
        z = masking.saturate_posinf(z / st.temperature[slots][:, None])
        if plan.min_p:
            z = filters.apply_min_p(z, st.min_p[slots])
        if plan.top_k:
            z = filters.apply_top_k(z, st.top_k[slots])
        if plan.top_p:
            z = filters.apply_top_p(z, st.top_p[slots])
        return z

    def _logprobs(self, scores: torch.Tensor, tokens: torch.Tensor, plan: StepPlan):
        values = logprobs.log_softmax_rows(scores) if self.logprobs_mode.endswith("logprobs") else scores
        num = torch.tensor([max(n, 0) for n in plan.num_logprobs], dtype=torch.int64, device=self.device)
        result = logprobs.gather_logprobs(scores, values, tokens, num, max(plan.logprobs_width, 0))
        asked = torch.tensor([n >= 0 for n in plan.num_logprobs], dtype=torch.bool, device=self.device)
        result.token_logprobs = result.token_logprobs.masked_fill(~asked, 0.0)
        result.token_ranks = result.token_ranks.masked_fill(~asked, 0)
        return result

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
