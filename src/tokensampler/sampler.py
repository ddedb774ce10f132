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
from typing import Sequence

import torch

from . import rng
from .ops import fused, logprobs, masking, penalties
from .output import LogprobsOutput, SamplerOutput
from .params import InvalidSamplingParams, SamplingParams, check_params_for_vocab, check_token_ids
from .reference import LOGPROBS_MODES
from .state import SamplerState

LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_ELEMENTS = 1 << 19  # elements per row block of the step's row-wise passes


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


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
    num_logprobs = [-1 if p.logprobs is None else (vocab_size if p.logprobs == -1 else p.logprobs) for p in rows]
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
    """

    def __init__(self, vocab_size: int, *, max_slots: int, device: torch.device | str = "cpu",
                 padded_vocab_size: int | None = None, logprobs_mode: str = "raw_logprobs",
                 max_logprobs: int = 20, eos_token_ids: Sequence[int] = ()) -> None:
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
        self.state = SamplerState(max_slots, vocab_size, self.device)

    # ---------------------------------------------------------------- admission
    def add_request(self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int], *,
                    output_token_ids: Sequence[int] = (), position: int | None = None,
                    stream: int = 0) -> int:
        """Admit a request into `slot` (replacing whatever it held). Returns its effective seed.

        position: of the next token to sample; default len(prompt) + len(outputs).
        stream: the noise stream (choice i of an n > 1 request uses stream i).
        Everything is checked before any state changes.
        """
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

    def remove_request(self, slot: int) -> None:
        """Free `slot`; sampling it again needs a new `add_request`."""
        self._check_slot(slot)
        self.state.release(slot)

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
    def sample(self, logits: torch.Tensor, slots: Sequence[int] | torch.Tensor | None = None) -> SamplerOutput:
        """Sample one token for each row of `logits` ([B, padded_vocab_size], fp32/fp16/bf16).

        Row b belongs to `slots[b]` (default 0..B-1). Each sampled token is counted into its
        slot's history and the slot's position advances by one.
        """
        slot_list = self._check_step(logits, slots)
        rows = [self.state.params[s] for s in slot_list]
        plan = plan_step(rows, self.vocab_size)
        index = torch.tensor(slot_list, dtype=torch.int64, device=self.device)
        out = self._run(logits, index, plan)
        self.state.record_tokens(index, out.token_ids)
        return out

    def _run(self, logits: torch.Tensor, index: torch.Tensor, plan: StepPlan) -> SamplerOutput:
        """Steps 1-12 for every row; the sampled rows go through `ops.fused` in row blocks."""
        st = self.state
        rows = [st.params[s] for s in index.tolist()]
        z = masking.prepare_logits(logits, self.vocab_size)  # the one logits-sized float32 buffer
        may_empty = plan.allowed_ids or plan.min_tokens or plan.penalties or plan.logit_bias
        raw_argmax = z.argmax(dim=-1) if may_empty else None  # NaN already -inf; +inf counts as max
        if plan.allowed_ids:
            masking.remove_disallowed(z, st.allowed_mask[index])
        if plan.min_tokens:
            below = st.output_len[index] < st.min_tokens[index]
            masking.remove_stop_ids(z, st.stop_mask[index], below)
        if plan.logit_bias:
            biased = _positions(rows, lambda p: bool(p.logit_bias))
            z[biased] += st.logit_bias[index[biased]]
        if plan.penalties:
            penalised = _positions(rows, _has_penalties)
            for block in _blocks(penalised, self._block_rows):
                slots = index[block]
                z[block] = penalties.apply_penalties_(z[block], st.prompt_mask[slots], st.output_counts[slots],
                                                      st.repetition[slots], st.frequency[slots], st.presence[slots])
        z_max = z.amax(dim=-1)
        if bool(torch.isposinf(z_max).any()):
            z = masking.saturate_posinf(z)
            z_max = z.amax(dim=-1)
        valid = z_max > float("-inf")
        valid_host = valid.tolist()
        tokens = torch.zeros(z.shape[0], dtype=torch.int64, device=z.device)
        greedy = [b for b in plan.greedy_rows if valid_host[b]]
        if greedy:
            g = torch.tensor(greedy, dtype=torch.int64, device=z.device)
            tokens[g] = z[g].argmax(dim=-1)
        sampled = [b for b in plan.sampled_rows if valid_host[b]]
        processed = self.logprobs_mode.startswith("processed") and plan.wants_logprobs
        for block in _blocks(sampled, self._block_rows):
            tokens[block] = self._sample_block(z, z_max, index, rows, block, processed)
        if raw_argmax is not None:
            tokens = torch.where(valid, tokens, raw_argmax)
        out = SamplerOutput(tokens, valid, None)
        if plan.wants_logprobs:
            out.logprobs = self._logprobs(logits, z if processed else None, tokens, plan)
        return out

    @property
    def _block_rows(self) -> int:
        """Rows per block of the row-wise passes: bounds their temporaries to ~BLOCK_ELEMENTS."""
        return max(1, BLOCK_ELEMENTS // self.vocab_size)

    def _sample_block(self, z: torch.Tensor, z_max: torch.Tensor, index: torch.Tensor,
                      rows: list[SamplingParams], block: list[int], processed: bool) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p and the Gumbel argmax for the sampled rows `block`."""
        st = self.state
        contiguous = block == list(range(block[0], block[0] + len(block)))
        zb = z[block[0]:block[-1] + 1] if contiguous else z[block]
        params = [rows[b] for b in block]
        slots = index[block]
        cols = fused.RowColumns(
            temperature=st.temperature[slots], min_p=st.min_p[slots], top_k=st.top_k[slots],
            top_p=st.top_p[slots], keys=rng.row_key(st.seed[slots], st.position[slots], st.stream[slots]),
            any_min_p=any(p.min_p > 0 for p in params), any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params))
        tokens, tau = fused.sample_rows(zb, z_max[block], cols, exact_threshold=processed)
        if processed:  # step 12 reads the kept set: every other id at -inf
            zb.masked_fill_(zb < tau[:, None], float("-inf"))
            if not contiguous:
                z[block] = zb
        return tokens

    def _logprobs(self, logits: torch.Tensor, final: torch.Tensor | None, tokens: torch.Tensor,
                  plan: StepPlan) -> LogprobsOutput:
        """Raw modes rebuild the raw scores from `logits` block by block; processed modes read `final`."""
        batch = tokens.shape[0]
        width = max(plan.logprobs_width, 0)
        device = tokens.device
        result = LogprobsOutput(torch.zeros(batch, dtype=torch.float32, device=device),
                                torch.zeros(batch, dtype=torch.int64, device=device),
                                torch.full((batch, width), -1, dtype=torch.int64, device=device),
                                torch.full((batch, width), float("-inf"), dtype=torch.float32, device=device))
        asked = [b for b, n in enumerate(plan.num_logprobs) if n >= 0]
        for block in _blocks(asked, self._block_rows):
            if final is None:
                scores = masking.saturate_posinf(masking.prepare_logits(logits[block], self.vocab_size))
            else:
                scores = final[block]
            values = logprobs.log_softmax_rows(scores) if self.logprobs_mode.endswith("logprobs") else scores
            num = torch.tensor([plan.num_logprobs[b] for b in block], dtype=torch.int64, device=device)
            part = logprobs.gather_logprobs(scores, values, tokens[block], num, width)
            result.token_logprobs[block] = part.token_logprobs
            result.token_ranks[block] = part.token_ranks
            result.top_token_ids[block] = part.top_token_ids
            result.top_logprobs[block] = part.top_logprobs
        return result

    # ---------------------------------------------------------------- checks
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
