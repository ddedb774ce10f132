"""`Sampler`: one sampling step for a batch of slots, with the per-slot state it keeps.

Every call runs the same pipeline, whatever the backend and whether the vocabulary is split:

1. check the arguments (nothing changes on an error), agreed with the other ranks of a split
   (`parallel.Agreement`: every rank raises, or none);
2. plan the step on the host from the rows' parameters (`core.plan.plan_step`);
3. run it on the backend `backends.Backends.choose` picks for these logits (the torch step, the
   Triton kernels, or the split step), which also records each token into its slot's history
   (step 13 of docs/semantics.md).

Admission (`add_request`) and the slot-state methods the engine contract uses (`set_params`,
`set_noise`, `reset_history`) follow steps 1 and then write the state, on this rank's vocabulary
layout (`state.VocabLayout`). `sample(...)` is the stateless one-call form.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .backends import Backends
from .backends.native.config import NativeConfig
from .backends.triton.config import KernelConfig
from .core import rng
from .core.checks import check_int, check_logits, check_token_ids, int_list, is_int
from .core.constants import INT64_MIN, LOGPROBS_MODES, POSITION_LIMIT, UINT64_MAX
from .core.errors import InvalidSamplingParams, SplitMismatch
from .core.output import SamplerOutput
from .core.params import SamplingParams, check_params_for_vocab
from .core.plan import StepPlan, plan_step
from .parallel.agreement import Agreement, fingerprint, params_key
from .state import SamplerState, VocabLayout


class Sampler:
    """Samples the next token of every slot in a batch, exactly as docs/semantics.md defines it.

    vocab_size: the real vocabulary V; ids >= V are padding and never returned.
    max_slots: number of request slots kept on the device.
    padded_vocab_size: the logits' width Vp >= V (default V).
    logprobs_mode: "raw_logprobs" | "raw_logits" | "processed_logprobs" | "processed_logits" (vLLM's).
    max_logprobs: the largest N a request may ask (-1, the whole vocabulary, is always allowed).
    eos_token_ids: removed, with each request's stop ids, while it is below its min_tokens.
    group: a torch.distributed process group (or a `parallel.Exchange`) over which the
      vocabulary is split: each rank passes its slice [B, padded_vocab_size / world] and every
      rank gets the same output (see docs/distributed.md).
    native_config, kernel_config: tunables of the torch step and of the Triton kernels.
    """

    def __init__(self, vocab_size: int, *, max_slots: int, device: torch.device | str = "cpu",
                 padded_vocab_size: int | None = None, logprobs_mode: str = "raw_logprobs",
                 max_logprobs: int = 20, eos_token_ids: Sequence[int] = (), group: Any = None,
                 native_config: NativeConfig | None = None, kernel_config: KernelConfig | None = None) -> None:
        self.device = torch.device(device)
        self.agreement = Agreement.over(group, self.device)
        world = self.agreement.world_size

        def check() -> tuple:
            check_int("vocab_size", vocab_size, 1)
            check_int("max_slots", max_slots, 1)
            padded = vocab_size if padded_vocab_size is None else padded_vocab_size
            if not is_int(padded) or padded < vocab_size:
                raise InvalidSamplingParams("padded_vocab_size", padded_vocab_size, f"None or an int >= {vocab_size}")
            if padded % world:
                raise InvalidSamplingParams("padded_vocab_size", padded, f"a multiple of the group size {world}")
            if logprobs_mode not in LOGPROBS_MODES:
                raise InvalidSamplingParams("logprobs_mode", logprobs_mode, f"one of {LOGPROBS_MODES}")
            check_int("max_logprobs", max_logprobs, 0)
            eos = int_list("eos_token_ids", eos_token_ids)
            check_token_ids("eos_token_ids", eos, vocab_size)
            return vocab_size, padded, max_slots, logprobs_mode, max_logprobs, tuple(eos)

        # every rank builds the same sampler, or every rank raises (one all-gather, before any state)
        checked = self.agreement.check("Sampler", check)
        self.vocab_size, self.padded_vocab_size, self.max_slots, self.logprobs_mode = checked[:4]
        self.max_logprobs, self.eos_token_ids = checked[4:]
        self.layout = VocabLayout(self.vocab_size, self.padded_vocab_size, self.agreement.rank, world,
                                  sliced=self.agreement.shared)
        self.state = SamplerState(self.max_slots, self.layout, self.device)
        self.backends = Backends(self.state, self.logprobs_mode, self.agreement, native_config, kernel_config)
        self._row_keys: dict[int, tuple[SamplingParams, int]] = {}  # id(params) -> (params, hash)

    # ---------------------------------------------------------------- admission
    def add_request(self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int], *,
                    output_token_ids: Sequence[int] = (), position: int | None = None,
                    stream: int = 0) -> int:
        """Admit a request into `slot` (replacing whatever it held). Returns its effective seed.

        position: of the next token to sample; default len(prompt) + len(outputs).
        stream: the noise stream (choice i of an n > 1 request uses stream i).
        Everything is checked before any state changes; an unseeded request draws a fresh seed
        (on a split, rank 0's, shared in the same all-gather as the checks).
        """
        def check() -> tuple[list[int], list[int], int]:
            return self._check_request(slot, params, prompt_token_ids, output_token_ids, position, stream)

        (prompt, outputs, position), (drawn,) = self.agreement.check_sharing(
            "params", check, share=[rng.fresh_seed()], key=(slot, params, stream))
        seed = params.seed if params.seed is not None else drawn
        self.state.admit(slot, params, seed, position, stream, prompt, outputs, self.eos_token_ids)
        return seed

    def _check_request(self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int],
                       output_token_ids: Sequence[int], position: int | None,
                       stream: int) -> tuple[list[int], list[int], int]:
        """`add_request`'s checks (no state change): returns (prompt, outputs, position)."""
        self._check_slot(slot)
        if not isinstance(params, SamplingParams):
            raise InvalidSamplingParams("params", params, "a SamplingParams")
        check_params_for_vocab(params, self.vocab_size, self.max_logprobs)
        prompt = self._token_list("prompt_token_ids", prompt_token_ids)
        outputs = self._token_list("output_token_ids", output_token_ids)
        if position is None:
            position = len(prompt) + len(outputs)
        check_int("position", position, 0, POSITION_LIMIT - 1, allowed="an int in [0, 2^32)")
        check_int("stream", stream, 0, POSITION_LIMIT - 1, allowed="an int in [0, 2^32)")
        return prompt, outputs, position

    def set_params(self, slot: int, params: SamplingParams) -> None:
        """Replace the parameters of an occupied `slot`, keeping its seed, position and history."""
        def check() -> SamplingParams:
            self._check_occupied(slot)
            if not isinstance(params, SamplingParams):
                raise InvalidSamplingParams("params", params, "a SamplingParams")
            check_params_for_vocab(params, self.vocab_size, self.max_logprobs)
            return params

        self.agreement.check("params", check, key=slot)
        self.state.write_params(slot, params, self.eos_token_ids)

    def set_noise(self, slots: Sequence[int], seeds: Sequence[int], positions: Sequence[int],
                  streams: Sequence[int]) -> None:
        """Set the seed, position and stream of occupied slots (one entry per slot), all at once."""
        slots, seeds, positions, streams = self.agreement.check(
            "seeds/positions/streams", lambda: self._check_noise(slots, seeds, positions, streams))
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=self.device)  # noqa: E731
        self.state.set_noise(as_tensor(slots), as_tensor([rng.seed_to_int64(s) for s in seeds]),
                             as_tensor(positions), as_tensor(streams))
        for slot, seed in zip(slots, seeds):
            self.state.seeds[slot] = seed

    def reset_history(self, slots: Sequence[int], prompt_token_ids: torch.Tensor | None,
                      output_token_ids: torch.Tensor | None) -> None:
        """Rebuild the penalty history of occupied slots from `[len(slots), S]` ids, -1 = padding.

        prompt_token_ids None keeps the prompt history; output_token_ids None clears the outputs
        (and the output length that min_tokens counts).
        """
        index, prompt, output = self.agreement.check(
            "token histories", lambda: self._check_history(slots, prompt_token_ids, output_token_ids))
        self.state.rebuild_history(index, prompt, output)

    def _check_noise(self, slots: Sequence[int], seeds: Sequence[int], positions: Sequence[int],
                     streams: Sequence[int]) -> tuple[list[int], list[int], list[int], list[int]]:
        """The checked (slots, seeds, positions, streams) of `set_noise`, as lists."""
        slots, seeds, positions, streams = (list(v) for v in (slots, seeds, positions, streams))
        for slot in slots:
            self._check_occupied(slot)
        if not len(slots) == len(seeds) == len(positions) == len(streams):
            raise InvalidSamplingParams("seeds/positions/streams", (len(seeds), len(positions), len(streams)),
                                        f"one entry per slot ({len(slots)})")
        for name, values, low, high in (("seed", seeds, INT64_MIN, UINT64_MAX),
                                        ("position", positions, 0, POSITION_LIMIT - 1),
                                        ("stream", streams, 0, POSITION_LIMIT - 1)):
            for value in values:
                check_int(name, value, low, high)
        return slots, seeds, positions, streams

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
    def sample(self, logits: torch.Tensor, slots: Sequence[int] | torch.Tensor | None = None, *,
               record: torch.Tensor | None = None) -> SamplerOutput:
        """Sample one token for each row of `logits` ([B, padded_vocab_size], fp32/fp16/bf16; on a
        split, this rank's slice [B, padded_vocab_size / world]).

        Row b belongs to `slots[b]` (default 0..B-1). Each sampled token is counted into its
        slot's history and the slot's position advances by one.
        record: optional bool [B] on the sampler's device; rows where it is False are sampled but
        neither counted nor advanced (their slot's state is left as it was).
        Returns fresh tensors (none aliases a buffer a later step writes).
        `logits` holds the same values after the call, but may serve as scratch during it (on a
        CPU, penalised values are written at the seen ids and restored): do not read it from
        another thread while `sample` runs.
        """
        plan = self._check_step(logits, slots, record)
        if plan.batch == 0:
            return SamplerOutput(torch.empty(0, dtype=torch.int64, device=self.device),
                                 torch.empty(0, dtype=torch.bool, device=self.device), None)
        return self.backends.choose(logits, plan).run(logits, plan, record)

    @property
    def workspace_bytes(self) -> int:
        """Host bytes the CPU step keeps between calls (its block workspace; 0 if it never ran)."""
        return self.backends.native.workspace_bytes

    # ---------------------------------------------------------------- checks
    def _check_step(self, logits: Any, slots: Any, record: Any) -> StepPlan:
        """Local checks, then (on a split) one all-gather of (batch, width, a digest of the rows):
        every rank raises if any rank failed or the ranks disagree. Returns the step's plan."""
        layout, shared = self.layout, self.agreement.shared
        error, slot_list, batch, width, recorded = None, [], -1, -1, None
        try:
            what = " (this rank's slice)" if layout.split else ""
            if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
                raise InvalidSamplingParams("logits", getattr(logits, "shape", logits),
                                            f"a 2-d tensor [B, {layout.columns}]{what}")
            batch, width = logits.shape
            if width == layout.columns:  # a width mismatch is raised below, on every rank
                check_logits(logits, layout.columns, self.device)
                slot_list = self._check_slots(slots, batch)
                self._check_record(record, len(slot_list))
                recorded = None if record is None or not shared else record.tolist()
        except Exception as exc:  # noqa: BLE001 - re-raised by the agreement, so no rank is left waiting
            if not shared:
                raise
            error, slot_list = exc, []
        digest = fingerprint([self._row_key(s) for s in slot_list], str(logits.dtype), recorded) \
            if shared and error is None else 0
        rows = self.agreement.gather(error, [batch, width, digest])
        batches, widths, digests = ([row[i] for row in rows] for i in range(3))
        if any(w != layout.columns for w in widths):
            if not shared:
                raise InvalidSamplingParams("logits.shape[1]", width, f"the padded vocabulary size {layout.columns}")
            raise SplitMismatch("logits.shape[1]", widths, f"{layout.columns} on every rank (padded_vocab_size "
                                f"{layout.padded_vocab_size} / world {layout.world})")
        if any(b != batches[0] for b in batches):
            raise SplitMismatch("batch", batches, "the same number of logits rows on every rank")
        if any(d != digests[0] for d in digests):
            raise SplitMismatch("params", "different slots or requests across ranks",
                                "the same slots, requests, record mask and logits dtype on every rank of the group")
        return plan_step([self.state.params[s] for s in slot_list], self.vocab_size, slot_list)

    def _check_slots(self, slots: Any, batch: int) -> list[int]:
        slot_list = list(range(batch)) if slots is None else int_list("slots", slots)
        if len(slot_list) != batch:
            raise InvalidSamplingParams("slots", slot_list, f"{batch} slots, one per logits row")
        if len(set(slot_list)) != len(slot_list):
            raise InvalidSamplingParams("slots", slot_list, "distinct slots")
        for slot in slot_list:
            self._check_occupied(slot)
        return slot_list

    def _row_key(self, slot: int) -> int:
        """Hash of the slot's params and seed, from the host mirror (follows `state.move`), memoised."""
        params = self.state.params[slot]
        cached = self._row_keys.get(id(params))
        if cached is None or cached[0] is not params:
            if len(self._row_keys) > 4 * self.max_slots:
                self._row_keys.clear()
            cached = (params, fingerprint(params_key(params)))
            self._row_keys[id(params)] = cached
        return fingerprint(slot, cached[1], self.state.seeds[slot])

    def _check_record(self, record: torch.Tensor | None, batch: int) -> None:
        if record is not None and (not isinstance(record, torch.Tensor) or record.dtype != torch.bool
                                   or tuple(record.shape) != (batch,)):
            raise InvalidSamplingParams("record", getattr(record, "shape", record),
                                        f"None or a bool tensor of shape ({batch},)")

    def _check_slot(self, slot: int) -> None:
        check_int("slot", slot, 0, self.max_slots - 1, allowed=f"an int in [0, {self.max_slots})")

    def _check_occupied(self, slot: int) -> None:
        self._check_slot(slot)
        if self.state.params[slot] is None:
            raise InvalidSamplingParams("slot", slot, "a slot holding a request (add_request first)")

    def _token_list(self, name: str, ids: Sequence[int] | torch.Tensor) -> list[int]:
        out = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        check_token_ids(name, out, self.vocab_size)
        return out


def _per_row(name: str, value: Any, batch: int) -> list:
    if value is None:
        return [()] * batch
    rows = list(value)
    if len(rows) != batch:
        raise InvalidSamplingParams(name, f"{len(rows)} rows", f"one entry per logits row ({batch})")
    return rows


def sample(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams], *,
           prompt_token_ids: Sequence[Sequence[int]] | None = None,
           output_token_ids: Sequence[Sequence[int]] | None = None,
           positions: Sequence[int] | None = None, vocab_size: int | None = None,
           logprobs_mode: str = "raw_logprobs", eos_token_ids: Sequence[int] = ()) -> SamplerOutput:
    """Sample one token per row of `logits` ([B, Vp]) with no state kept between calls: equal to a
    fresh `Sampler` holding the rows.

    params: one `SamplingParams` for every row, or a list with one per row.
    prompt_token_ids, output_token_ids: per-row histories (for penalties and min_tokens).
    positions: per-row position of the token sampled (default: prompt + output length).
    vocab_size: the real vocabulary (default Vp: no padding).
    Unseeded rows draw a fresh seed, as `Sampler.add_request` does.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise InvalidSamplingParams("logits", getattr(logits, "shape", logits), "a 2-d tensor [B, Vp]")
    batch, padded = logits.shape
    rows = [params] * batch if isinstance(params, SamplingParams) else _per_row("params", params, batch)
    prompts = _per_row("prompt_token_ids", prompt_token_ids, batch)
    outputs = _per_row("output_token_ids", output_token_ids, batch)
    pos = [None] * batch if positions is None else _per_row("positions", positions, batch)
    sampler = Sampler(padded if vocab_size is None else vocab_size, max_slots=max(batch, 1),
                      device=logits.device, padded_vocab_size=padded, logprobs_mode=logprobs_mode,
                      max_logprobs=max([p.logprobs or 0 for p in rows] + [20]), eos_token_ids=eos_token_ids)
    for b in range(batch):
        sampler.add_request(b, rows[b], prompts[b], output_token_ids=outputs[b], position=pos[b])
    return sampler.sample(logits)
