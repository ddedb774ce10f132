"""`Sampler`: one sampling step for a batch of slots, with the per-slot state it keeps.

`sample` checks the call, plans the step on the host (`plan_step`), runs it on one backend and then
counts each token into its slot's history (step 13 of docs/semantics.md):

- CUDA logits with Triton available: the fused kernels (`kernels.launcher.KernelStep`);
- a vocabulary split over a process group: `distributed.VocabSplit`;
- otherwise the torch step (`torch_step.TorchStep`, sort-free, docs/cpu-fast-path.md).

Admission (`add_request`) and the slot-state methods the engine contract uses (`set_params`,
`set_noise`, `reset_history`) check everything before any state changes.
"""

from __future__ import annotations

import secrets
from typing import Any, Sequence

import torch

from . import kernels, rng
from .output import SamplerOutput
from .params import (INT64_MIN, UINT64_MAX, InvalidSamplingParams, SamplingParams, check_params_for_vocab,
                     check_token_ids)
from .plan import StepPlan, plan_step  # noqa: F401  (re-exported: the plan is part of the sampler's API)
from .reference import LOGPROBS_MODES
from .state import SamplerState
from .torch_step import TorchStep

LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
        self._torch_step = TorchStep(self.state, vocab_size, logprobs_mode, self.device)
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
        prompt, outputs, position = self._check_request(slot, params, prompt_token_ids, output_token_ids,
                                                        position, stream)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
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
        if not isinstance(position, int) or not 0 <= position < 2**32:
            raise InvalidSamplingParams("position", position, "an int in [0, 2^32)")
        if not isinstance(stream, int) or not 0 <= stream < 2**32:
            raise InvalidSamplingParams("stream", stream, "an int in [0, 2^32)")
        return prompt, outputs, position

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
        `logits` holds the same values after the call, but may serve as scratch during it (on a
        CPU, penalised values are written at the seen ids and restored): do not read it from
        another thread while `sample` runs.
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
        out = self._torch_step.run(logits, index, plan)
        self.state.record_tokens(index, out.token_ids, record)
        return out

    @property
    def workspace_bytes(self) -> int:
        """Host bytes the CPU step keeps between calls (its block workspace; 0 if it never ran)."""
        return self._torch_step.workspace_bytes

    def _kernels(self):
        """The fused Triton step (it owns its scratch buffers); made on first use."""
        if self._kernel_step is None:
            from .kernels.launcher import KernelStep
            self._kernel_step = KernelStep(self)
        return self._kernel_step

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
