"""`Sampler`: one sampling step for a batch of slots, with the per-slot state it keeps.

Every call runs the same pipeline, whatever the backend and whether the vocabulary is split:

1. check the arguments (nothing changes on an error), agreed with the other ranks of a split
   (`parallel.Agreement`: every rank raises, or none);
2. plan the step on the host from the rows' parameters (`core.plan.plan_step`);
3. run it on the backend `backends.Backends.choose` picks for these logits (the torch step, the
   Triton kernels, or the split step), which also records each token into its slot's history
   (step 13 of docs/semantics.md).

Admission (`add_request`) and the slot-state methods the engine contract uses (`set_params`,
`set_noise`, `reset_history`, `move_slots`, `advance`) follow step 1 and then write the state, on
this rank's vocabulary layout (`state.VocabLayout`). The `SamplerState` is the one owner of every
slot's state (parameters, seed, stream, position, history); nothing outside this module and
`state/` touches it: slots are described by `seed_of`, `position_of`, `stream_of`, `params_of`,
`seed_drawn` and `positions_of`, and a step is planned from `plan_rows`. The checks that read no
slot state are `sampler.checks`; `sample(...)` (`sampler.stateless`) is the stateless one-call form.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..backends import BackendChoice, Backends
from ..backends.torch_step.config import TorchStepConfig
from ..backends.triton.config import KernelConfig
from ..core import rng
from ..core.checks import (
    as_list,
    check_device,
    check_int,
    check_logits,
    check_slots,
    int_list,
)
from ..core.errors import InvalidSamplingParams, SplitMismatch
from ..core.output import SamplerOutput, SpeculativeOutput
from ..core.params import SamplingParams, check_params_for_vocab
from ..core.plan import StepPlan, plan_step
from ..parallel.agreement import Agreement, fingerprint, params_key
from ..speculative import STREAM_LIMIT, verify_match, verify_rejection
from ..state import SamplerState, SlotRecord, VocabLayout
from .checks import (
    check_advance,
    check_bitmask,
    check_history,
    check_moves,
    check_mus,
    check_noise,
    check_record,
    check_request,
    check_sampler,
    check_speculative,
)


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
    step_config, kernel_config: tunables of the torch step and of the Triton kernels.
    backend: "auto" (CUDA logits run the Triton kernels when Triton is importable, else the torch
      step), "torch" or "triton" (forced; CPU tensors need TRITON_INTERPRET=1); None (default): the
      TOKENSAMPLER_BACKEND environment variable, "auto" when unset.
    compile: the torch step's full-row reductions through torch.compile (True) or eager (False),
      the same tokens either way; None (default): TOKENSAMPLER_COMPILE (0/false/no/off: eager; on
      when unset).
    Both are decided here, once (`backends.choice.BackendChoice`, kept as `backends.choice`): an
    explicit argument wins, the environment is only the default, and no later call reads it.
    """

    def __init__(self, vocab_size: int, *, max_slots: int, device: torch.device | str = "cpu",
                 padded_vocab_size: int | None = None, logprobs_mode: str = "raw_logprobs",
                 max_logprobs: int = 20, eos_token_ids: Sequence[int] = (), group: Any = None,
                 step_config: TorchStepConfig | None = None, kernel_config: KernelConfig | None = None,
                 backend: str | None = None, compile: bool | None = None) -> None:
        self.device = check_device("device", device)
        self.agreement = Agreement.over(group, self.device)
        world = self.agreement.world_size

        choices: list[BackendChoice] = []

        def check() -> tuple:
            checked = check_sampler(vocab_size, max_slots, padded_vocab_size, world, logprobs_mode, max_logprobs,
                                    eos_token_ids, step_config, kernel_config)
            # the environment is read here only; kept out of what the ranks compare (it changes no token)
            choices.append(BackendChoice.resolve(backend, compile, self.device))
            return checked

        # every rank builds the same sampler, or every rank raises (one all-gather, before any state)
        checked = self.agreement.check("Sampler", check)
        self.vocab_size, self.padded_vocab_size, self.max_slots, self.logprobs_mode = checked[:4]
        self.max_logprobs, self.eos_token_ids = checked[4:]
        self.layout = VocabLayout(self.vocab_size, self.padded_vocab_size, self.agreement.rank, world,
                                  sliced=self.agreement.shared)
        self.state = SamplerState(self.max_slots, self.layout, self.device)
        self.backends = Backends(self.state, self.logprobs_mode, self.agreement, step_config, kernel_config,
                                 choices[0])
        self._row_keys: dict[int, tuple[SamplingParams, int]] = {}  # id(params) -> (params, hash)
        self._default_plan: StepPlan | None = None  # the last plan of rows 0..B-1 (slots=None, unshared)

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
            return check_request(slot, params, prompt_token_ids, output_token_ids, position, stream,
                                 self._check_slot, self.vocab_size, self.max_logprobs, self.layout.split)

        (prompt, outputs, position), (drawn,) = self.agreement.check_sharing(
            "params", check, share=[rng.fresh_seed()], key=(slot, params, stream))
        seed = params.seed if params.seed is not None else drawn
        self.state.admit(slot, params, seed, position, stream, prompt, outputs, self.eos_token_ids,
                         drawn=params.seed is None)
        return seed

    def set_params(self, slots: Sequence[int], params: Sequence[SamplingParams]) -> None:
        """Replace the parameters of occupied `slots[i]` with `params[i]`, all at once (one check on
        every rank, one write per column), keeping their seeds, positions and histories; Mirostat's
        mu starts again at 2 tau. Bad words and DRY read the latest tokens the state keeps for them,
        as deep as the longest bad word (less one) and the widest DRY window admitted so far: longer
        ones read only the tokens kept (a token not kept is no match) until `reset_history` (or a
        new `add_request` with the outputs) rebuilds them."""
        def check() -> tuple[list[int], list[SamplingParams]]:
            slot_list = check_slots("slots", slots, self.max_slots)
            for slot in slot_list:
                self._check_occupied(slot)
            param_list = as_list("params", params, "one SamplingParams per slot")
            if len(param_list) != len(slot_list):
                raise InvalidSamplingParams("params", f"{len(param_list)} params", f"one per slot ({len(slot_list)})")
            checked: set[int] = set()  # ids of params objects already checked (a burst shares a few)
            for p in param_list:
                if not isinstance(p, SamplingParams):
                    raise InvalidSamplingParams("params", p, "a SamplingParams")
                if id(p) not in checked:
                    check_params_for_vocab(p, self.vocab_size, self.max_logprobs, self.layout.split)
                    checked.add(id(p))
            return slot_list, param_list

        slot_list, param_list = self.agreement.check("params", check)
        self.state.write_params(slot_list, param_list, self.eos_token_ids)

    def set_noise(self, slots: Sequence[int], seeds: Sequence[int | None], positions: Sequence[int | None],
                  streams: Sequence[int], *, drawn: Sequence[bool] | None = None) -> None:
        """Set the seed, position and stream of occupied slots (one entry per slot), all at once.

        seeds[i] None leaves the slot without a seed (a placeholder row that is sampled greedily,
        e.g. an engine's empty lane: `seed_of` is None); positions[i] None keeps the slot's
        position. drawn: per slot, whether the seed was drawn for an unseeded request
        (`seed_drawn`; default False)."""
        slots, seeds, positions, streams, drawn = self.agreement.check(
            "seeds/positions/streams",
            lambda: check_noise(slots, seeds, positions, streams, drawn, self._check_occupied))
        self.state.set_noise(slots, seeds, positions, streams, drawn)

    def advance(self, slots: Sequence[int], counts: Sequence[int]) -> None:
        """Advance the position of occupied `slots[i]` by `counts[i]` without sampling (tokens an
        engine sampled itself, on the host, with `seed_of` / `position_of` / `stream_of`): as many
        positions as `counts[i]` recorded steps. Checked first (one read of the positions)."""
        slot_list, count_list = self.agreement.check(
            "advance", lambda: check_advance(slots, counts, self._check_occupied, self.state.positions))
        self.state.advance(slot_list, count_list)

    def move_slots(self, dst_slots: Sequence[int], src_slots: Sequence[int]) -> None:
        """The state of `src_slots[i]` (parameters, seed, stream, position, history) goes to
        `dst_slots[i]`, for all i at once (a gather, then a scatter: continuous batching's remap).
        A source that is not a destination keeps its state; distinct destinations."""
        dst, src = self.agreement.check(
            "move_slots", lambda: check_moves(dst_slots, src_slots, self._check_slot))
        if dst:
            self.state.move(dst, src)

    def reset_history(self, slots: Sequence[int], prompt_token_ids: torch.Tensor | None,
                      output_token_ids: torch.Tensor | None) -> None:
        """Rebuild the penalty history of occupied slots from `[len(slots), S]` ids, -1 = padding
        (and the latest output tokens their bad words read).

        prompt_token_ids None keeps the prompt history; output_token_ids None clears the outputs
        (and the output length that min_tokens counts). Mirostat's mu starts again at 2 tau (`set_mu`).
        """
        index, prompt, output = self.agreement.check(
            "token histories", lambda: check_history(slots, prompt_token_ids, output_token_ids,
                                                         self._check_occupied, self.device, self.vocab_size))
        self.state.rebuild_history(index, prompt, output)

    def remove_request(self, slot: int) -> None:
        """Free `slot`; sampling it again needs a new `add_request`."""
        self._check_slot(slot)
        self.state.release(slot)

    def seed_of(self, slot: int) -> int | None:
        """The effective seed of the request in `slot` (the drawn one for an unseeded request;
        None after `set_noise` left it without one)."""
        self._check_occupied(slot)
        return self.state.seeds[slot]

    def seed_drawn(self, slot: int) -> bool:
        """Whether the slot's seed was drawn for an unseeded request (by `add_request`, or as
        `set_noise(drawn=...)` said)."""
        self._check_occupied(slot)
        return self.state.drawn[slot]

    def stream_of(self, slot: int) -> int:
        """The noise stream of the request in `slot`."""
        self._check_occupied(slot)
        return self.state.streams[slot]

    def position_of(self, slot: int) -> int:
        """The position of the slot's next token (reads the device: a host sync)."""
        return self.positions_of([slot])[0]

    def positions_of(self, slots: Sequence[int]) -> list[int]:
        """The positions of the next tokens of occupied `slots` (one read of the device)."""
        return self.state.positions(self._occupied_list(slots))

    def mus_of(self, slots: Sequence[int]) -> list[float | None]:
        """Mirostat's mu of occupied `slots` (docs/semantics.md 10.6; one device read), None where off."""
        slot_list = self._occupied_list(slots)
        return [None if self.state.params[s].mirostat_tau is None else mu
                for s, mu in zip(slot_list, self.state.mus(slot_list))]

    def mu_of(self, slot: int) -> float | None:
        """Mirostat's mu of the slot's request (a device read; None: Mirostat off)."""
        return self.mus_of([slot])[0]

    def set_mu(self, slots: Sequence[int], mus: Sequence[float | None]) -> None:
        """Set Mirostat's mu of occupied slots (a request resumed, tokens sampled elsewhere): a finite
        float per slot whose request has Mirostat; None keeps the slot's mu."""
        slot_list, mu_list = self.agreement.check(
            "mus", lambda: check_mus(slots, mus, self._check_occupied, self.state.params))
        self.state.set_mus(slot_list, mu_list)

    def records_of(self, slots: Sequence[int]) -> list[SlotRecord]:
        """The host record (params, seed, drawn, stream) of each occupied slot of `slots`: no device read."""
        slot_list = self._occupied_list(slots)
        return [self.state.record(slot) for slot in slot_list]

    def params_of(self, slot: int) -> SamplingParams:
        """The parameters of the request in `slot`."""
        self._check_occupied(slot)
        return self.state.params[slot]

    def plan_rows(self, batch: int) -> StepPlan:
        """The step plan of slots 0..batch-1 (`sample(logits[:batch])` with slots None plans the
        same), from their parameters: no device read."""
        check_int("batch", batch, 0, self.max_slots, allowed=f"an int in [0, {self.max_slots}]")
        return plan_step(self.state.params[:batch], self.vocab_size)

    # ---------------------------------------------------------------- the step
    @torch.no_grad()  # never needs autograd: logits that require grad give the same tokens
    def sample(self, logits: torch.Tensor, slots: Sequence[int] | torch.Tensor | None = None, *,
               record: torch.Tensor | None = None, token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """Sample one token for each row of `logits` ([B, padded_vocab_size], fp32/fp16/bf16; on a
        split, this rank's slice [B, padded_vocab_size / world]).

        Row b belongs to `slots[b]` (default 0..B-1). Each sampled token is counted into its
        slot's history and the slot's position advances by one.
        record: optional bool [B] on the sampler's device; rows where it is False are sampled but
        neither counted nor advanced (their slot's state is left as it was).
        token_bitmask: optional int32 [B, W >= ceil(vocab_size / 32)] on the logits' device, in
        xgrammar's layout (bit j of word w, least significant first, allows id 32 w + j; bit 31 is
        the sign bit): for this step only, every id whose bit is 0 is removed, like
        allowed_token_ids (step 3 of docs/semantics.md); bits of ids >= vocab_size are ignored. On a
        split every rank passes the whole mask and reads the bits of its own columns.
        The returned tensors are valid until the next call (a backend may return views of buffers
        it reuses: copy what you keep; see `backends.base`).
        `logits` holds the same values after the call, but may serve as scratch during it (on a
        CPU, penalised values and bad words are written at their ids and restored): do not read it from
        another thread while `sample` runs.
        """
        plan = self._check_step(logits, slots, record, token_bitmask)
        if plan.batch == 0:
            return SamplerOutput(torch.empty(0, dtype=torch.int64, device=self.device),
                                 torch.empty(0, dtype=torch.bool, device=self.device), None)
        return self.backends.choose(logits, plan).run(logits, plan, record, token_bitmask)

    @torch.no_grad()  # never needs autograd: logits that require grad give the same tokens
    def sample_speculative(self, target_logits: torch.Tensor, draft_token_ids: torch.Tensor, *,
                           draft_probs: torch.Tensor | None = None,
                           slots: Sequence[int] | torch.Tensor | None = None, mode: str | None = None,
                           record: torch.Tensor | None = None,
                           token_bitmask: torch.Tensor | None = None) -> SpeculativeOutput:
        """Verify K drafted tokens per row against the target's logits (docs/speculative.md).

        Parameters
        ----------
        target_logits: [B, K+1, padded_vocab_size], fp32/fp16/bf16 (on a split, this rank's slice
            [B, K+1, padded_vocab_size / world]); position j of row b holds the target's logits for
            the token at position pos_b + j (pos_b: the slot's position); index K is the bonus position.
        draft_token_ids: integer [B, K] (any device), ids in [0, vocab_size); -1 = no draft from
            there on (shorter rows pad with -1; K may be 0). Checked with one read of its min and max.
        draft_probs: optional float [B, K, padded_vocab_size] (fp16/bf16/fp32/fp64, on the sampler's
            device): the draft's distribution at each drafted position.
        slots: row b belongs to `slots[b]` (default 0..B-1).
        mode: "match" (default without draft_probs): the canonical token at each position, emitted
            while the draft equals it, exactly the tokens `sample` gives step by step; "rejection"
            (default with draft_probs): speculative sampling, accept x with probability
            min(1, p(x) / q(x)), else a token of the residual max(p - q, 0).
        record: optional bool [B] on the sampler's device; rows where it is False are verified but
            neither counted nor advanced.
        token_bitmask: optional int32 [B, K+1, W >= ceil(vocab_size / 32)] on the logits' device, one
            mask per position (the K draft positions, then the bonus position), in the layout of
            `sample`'s `token_bitmask` (bit j of word w, least significant first, allows id 32 w + j):
            position j's target distribution removes every id whose bit in `token_bitmask[:, j]` is 0,
            in both modes (match: position j's step gets that mask; rejection: p is 0 there, so such
            a draft is never accepted and the residual never draws it). A grammar engine fills row
            b's position j with the mask of the state reached after the drafts before j (the masks
            of positions after a rejection are never read). On a split every rank passes the whole mask.

        Returns
        -------
        SpeculativeOutput: token_ids int64 [B, K+1] (-1 after the last emitted token), num_emitted
        int64 [B] (>= 1), valid bool [B, K+1], logprobs per position when rows ask for them. Each
        emitted token is counted into its slot's history and the slot's position advances by
        num_emitted. Every check (shapes, dtypes, draft ids in [-1, vocab_size), the mode) is done
        before any state changes; rejection mode on a vocabulary split raises `UnsupportedOnSplit`.
        """
        mode, drafts = self.agreement.check("sample_speculative", lambda: check_speculative(
            self.layout, self.device, self.vocab_size, target_logits, draft_token_ids, draft_probs, mode,
            token_bitmask))
        plan = self._check_step(target_logits[:, 0], slots, record,
                                None if token_bitmask is None else token_bitmask[:, 0])
        positions = target_logits.shape[1]
        if plan.batch == 0:
            return SpeculativeOutput(torch.full((0, positions), -1, dtype=torch.int64, device=self.device),
                                     torch.zeros(0, dtype=torch.int64, device=self.device),
                                     torch.ones((0, positions), dtype=torch.bool, device=self.device), None)
        if mode == "match":
            return verify_match(self.backends, target_logits, drafts, plan, record, token_bitmask)
        stream = max(self.state.streams[s] for s in plan.slots)
        if stream >= STREAM_LIMIT:
            raise InvalidSamplingParams("stream", stream, "streams below 2^30 in mode='rejection' (streams "
                                        "from 2^30 up are the reserved noise streams of the verification)")
        return verify_rejection(self.backends, target_logits, drafts, draft_probs, plan, record, token_bitmask)

    @property
    def workspace_bytes(self) -> int:
        """Host bytes the CPU step keeps between calls (its block workspace; 0 if it never ran)."""
        return self.backends.torch_step.workspace_bytes

    def warmup(self) -> dict:
        """Compile (or load from inductor's on-disk cache) every graph the torch step can need, for
        every batch size and parameter mix, so that no later `sample` call compiles anything or
        stalls (`backends.torch_step.warmup`). Changes no state of this sampler. Returns {"seconds",
        "steps"}; nothing to do without torch.compile (`compile=False`) or on a split."""
        return self.backends.warmup()

    # ---------------------------------------------------------------- checks
    def _check_step(self, logits: Any, slots: Any, record: Any, token_bitmask: Any = None) -> StepPlan:
        """Local checks, then (on a split) one all-gather of (batch, width, a digest of the rows):
        every rank raises if any rank failed or the ranks disagree. Returns the step's plan."""
        layout, shared = self.layout, self.agreement.shared
        error, slot_list, batch, width, recorded, reused = None, [], -1, -1, None, None
        try:
            what = " (this rank's slice)" if layout.split else ""
            if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
                raise InvalidSamplingParams("logits", getattr(logits, "shape", logits),
                                            f"a 2-d tensor [B, {layout.columns}]{what}")
            batch, width = logits.shape
            if width == layout.columns:  # a width mismatch is raised below, on every rank
                check_logits(logits, layout.columns, self.device)
                reused = self._reusable_plan(slots, batch)
                slot_list = list(reused.slots) if reused is not None else self._check_slots(slots, batch)
                check_record(record, len(slot_list))
                check_bitmask(token_bitmask, logits, self.vocab_size)
                recorded = None if record is None or not shared else record.tolist()
        except Exception as exc:  # noqa: BLE001 - re-raised by the agreement, so no rank is left waiting
            if not shared:
                raise
            error, slot_list = exc, []
        masked = tuple(token_bitmask.shape) if isinstance(token_bitmask, torch.Tensor) else None  # checked, or
        # unchecked (a width mismatch, raised below): then it must not fail here
        digest = fingerprint([self._row_key(s) for s in slot_list], str(logits.dtype), recorded, masked) \
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
        if reused is not None:
            return reused
        plan = plan_step([self.state.params[s] for s in slot_list], self.vocab_size, slot_list)
        if slots is None and not shared:
            self._default_plan = plan
        return plan

    def _reusable_plan(self, slots: Any, batch: int) -> StepPlan | None:
        """The last plan of rows 0..B-1 (`slots` None, no group) when the slots' params equal its
        rows: those slots were checked occupied then (a released slot's params are None), and the
        plan, a function of the rows' params only, holds. Else None."""
        last = self._default_plan
        if slots is None and not self.agreement.shared and last is not None \
                and last.rows == tuple(self.state.params[:batch]):
            return last
        return None

    def _check_slots(self, slots: Any, batch: int) -> list[int]:
        slot_list = list(range(batch)) if slots is None else int_list("slots", slots)
        if len(slot_list) != batch:
            raise InvalidSamplingParams("slots", slot_list, f"{batch} slots, one per logits row")
        for slot in slot_list:
            self._check_occupied(slot)
        if len(set(slot_list)) != len(slot_list):
            raise InvalidSamplingParams("slots", slot_list, "distinct slots")
        return slot_list

    def _row_key(self, slot: int) -> int:
        """Hash of the slot's params and seed, from the host record (follows `move_slots`), memoised."""
        params = self.state.params[slot]
        cached = self._row_keys.get(id(params))
        if cached is None or cached[0] is not params:
            if len(self._row_keys) > 4 * self.max_slots:
                self._row_keys.clear()
            cached = (params, fingerprint(params_key(params)))
            self._row_keys[id(params)] = cached
        return fingerprint(slot, cached[1], self.state.seeds[slot])

    def _check_slot(self, slot: int) -> None:
        check_int("slot", slot, 0, self.max_slots - 1, allowed=f"an int in [0, {self.max_slots})")

    def _occupied_list(self, slots: Sequence[int]) -> list[int]:
        """`slots` as a list of occupied slots (checked; fast when they are)."""
        slot_list = list(slots) if isinstance(slots, range) else int_list("slots", slots)
        params, limit = self.state.params, self.max_slots
        for slot in slot_list:
            if type(slot) is not int or not 0 <= slot < limit or params[slot] is None:
                self._check_occupied(slot)
        return slot_list

    def _check_occupied(self, slot: int) -> None:
        self._check_slot(slot)
        if self.state.params[slot] is None:
            raise InvalidSamplingParams("slot", slot, "a slot holding a request (add_request first)")
