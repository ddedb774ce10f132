"""`SamplingGenerator`: an engine's sampler slots, kept right through the decode-update contract.

1. `apply_prefill_state` admits requests into the listed slots only; every other slot keeps its state.
2. `apply_decode_state` consumes `slot_remap` first, exactly once (new slot i <- old slot remap[i]);
   then `reload_sampling_params` uploads parameters and `reset_sampling_state` rebuilds the penalty
   history (and positions, when given). Neither advances a seed or a position.
3. Host sampling: the slots' state follows a remap at once, and the device parameter and penalty
   buffers are marked stale; the next device decode must carry both flags or `StaleSamplingState`.
4. `sample` samples every lane; only the active slots count their token and advance, once each.
   `sample_speculative` verifies drafts on every lane; only the active slots count their emitted
   tokens and advance, once per emitted token.
5. Bad input raises a `ValueError` (`InvalidSamplingParams`) before any state changes.

Every slot's parameters, seed, stream, position and history live in the `Sampler`'s slot state
(their one owner); the generator reads and writes them through the `Sampler`'s methods, and its
`seed_manager` (the seeding policy: drawn seeds, continuing requests) is a view of those slots. The
generator itself keeps only the contract's own flags: which slots are occupied, and which device
rows are stale (after host sampling or a host-mode remap).
"""

from __future__ import annotations

import functools
import random
from typing import Any, Sequence

import torch

from ..core.checks import as_list, check_bool, check_int, check_slots, int_list
from ..core.constants import POSITION_LIMIT
from ..core.errors import InvalidSamplingParams, StaleSamplingState, TraceMismatch
from ..core.output import LogprobsOutput, SamplerOutput, SpeculativeOutput
from ..core.params import SamplingParams, check_params_for_vocab
from ..core.threads import single_threaded
from ..sampler import Sampler
from ..sampler.checks import check_mus
from .batch_params import BatchSamplingParams, as_batch_params, format_requests, lanes_by_slot
from .inputs import logits_batch, positions_by_slot, remapped_prompt_stale, token_rows
from .seeds import SeedManager, check_slot_remap, check_streams, rank_local_slot_remap
from .tracing import StepTracer, TraceKey

__all__ = ["BatchSamplingParams", "NEUTRAL_PARAMS", "SamplingGenerator", "SeedManager", "StaleSamplingState",
           "TraceKey", "TraceMismatch", "rank_local_slot_remap"]

SAMPLING_MODES = ("device", "host")
# What an empty slot holds: the greedy row, no history, never counted.
NEUTRAL_PARAMS = SamplingParams(temperature=0.0)


class SamplingGenerator:
    """A `Sampler` over `max_batch_size * sampling_dp` lanes, which owns their state, and the
    contract's flags (occupied, stale); see the module docstring for the contract.

    logprobs_mode, max_logprobs, eos_token_ids: passed to the `Sampler`.
    group: a torch.distributed group (or `parallel.Exchange`) splitting the vocabulary: every
      rank makes the same calls, passing its logits slice `[B, Vp / world]` to `sample`, and gets
      the same tokens; a call whose checks fail on any rank raises on every rank before any state
      changes (docs/distributed.md).
    seed_source: draws seeds for unseeded requests (default: `secrets`; with a group, a stream
      seeded by rank 0, the same on every rank; a custom source must give every rank the same seeds).
    warmup: run `Sampler.warmup` at construction (default), so that no step compiles anything;
      the report is kept in `warmup_report`.
    backend, compile: the `Sampler`'s backend and torch.compile choice (None: the environment's
      defaults, read once, here).
    """

    def __init__(self, vocab_size: int, *, max_batch_size: int, sampling_dp: int = 1,
                 padded_vocab_size: int | None = None, device: torch.device | str, group: Any = None,
                 logprobs_mode: str = "raw_logprobs", max_logprobs: int = 20, eos_token_ids: Sequence[int] = (),
                 seed_source: Any = None, warmup: bool = True, backend: str | None = None,
                 compile: bool | None = None) -> None:
        check_int("max_batch_size", max_batch_size, 1)
        check_int("sampling_dp", sampling_dp, 1)
        check_bool("warmup", warmup)
        if seed_source is not None and not callable(seed_source):
            raise InvalidSamplingParams("seed_source", seed_source, "None or a callable returning a seed (an int)")
        self.max_batch_size = max_batch_size
        self.sampling_dp = sampling_dp
        self.num_lanes = max_batch_size * sampling_dp
        self.sampler = Sampler(vocab_size, max_slots=self.num_lanes, device=device,
                               padded_vocab_size=padded_vocab_size, logprobs_mode=logprobs_mode,
                               max_logprobs=max_logprobs, eos_token_ids=eos_token_ids, group=group,
                               backend=backend, compile=compile)
        self.vocab_size = vocab_size
        self.device = self.sampler.device
        self.agreement = self.sampler.agreement  # local, or the ranks of a vocabulary split
        # the ranks agree on the layout before any lane is admitted
        self.agreement.agree(None, "SamplingGenerator", lambda: (
            vocab_size, max_batch_size, sampling_dp, self.sampler.padded_vocab_size, logprobs_mode, max_logprobs,
            list(eos_token_ids), seed_source is None))
        if self.agreement.shared and seed_source is None:  # every rank draws the same seeds
            seed_source = functools.partial(random.Random(self.agreement.shared_random_bits()).getrandbits, 63)
        n = self.num_lanes
        for slot in range(n):  # every lane always holds a row: empty ones the neutral greedy row, no seed
            self.sampler.add_request(slot, NEUTRAL_PARAMS, ())
        self.sampler.set_noise(range(n), [None] * n, [0] * n, [0] * n)
        # the seeding policy, over the sampler's slots (a view: it keeps nothing itself)
        self.seed_manager = SeedManager(n, seed_source=seed_source, sampler=self.sampler)
        self._occupied = [False] * n
        self._stale = [False] * n          # device params / counts of the slot out of date (host sampling)
        self._prompt_stale = [False] * n   # device prompt row belongs to another request (host remap)
        self._sampled = [False] * n        # the slot's row is not greedy (an empty slot's never is)
        self._num_sampled = 0              # how many are: a step forces argmax when none is, read in O(1)
        self.tracer = StepTracer(self.sampler)
        self._force_argmax: bool | None = None
        self.last_output: SamplerOutput | None = None
        self.last_speculative: SpeculativeOutput | None = None
        # no decode step compiles anything: `Sampler.warmup` prepares every compiled function now
        self.warmup_report = self.sampler.warmup() if warmup else None

    # ------------------------------------------------------------ queries
    def occupied_slots(self) -> list[int]:
        return [s for s in range(self.num_lanes) if self._occupied[s]]

    def stale_slots(self) -> list[int]:
        """Slots whose device state must be rebuilt (reload + reset) before device sampling."""
        return [s for s in range(self.num_lanes) if self._stale[s]]

    def seed_of(self, slot: int) -> int:
        self._check_occupied("slot", [slot])
        return self.sampler.seed_of(slot)

    def position_of(self, slot: int) -> int:
        """The position of the slot's next token (the sampler's: a device read)."""
        self._check_occupied("slot", [slot])
        return self.sampler.position_of(slot)

    def stream_of(self, slot: int) -> int:
        self._check_occupied("slot", [slot])
        return self.sampler.stream_of(slot)

    def params_of(self, slot: int) -> SamplingParams:
        self._check_occupied("slot", [slot])
        return self.sampler.params_of(slot)

    def mu_of(self, slot: int) -> float | None:
        """Mirostat's mu of the slot's request (the sampler's: a device read; None: Mirostat off)."""
        self._check_occupied("slot", [slot])
        return self.sampler.mu_of(slot)

    def set_mu(self, slots: Sequence[int], mus: Sequence[float | None]) -> None:
        """Set Mirostat's mu of occupied slots (an engine that sampled their tokens on the host; None
        keeps a slot's mu), as `seed_manager.get_new_values` advances their positions."""
        self.agreement.check("set_mu", lambda: self._check_occupied("slots", slots))
        self.sampler.set_mu(slots, mus)

    # ------------------------------------------------------------ prefill
    def apply_prefill_state(self, *, sampling_params: Any, prompt_tokens: Any, empty_slots: Sequence[int],
                            streams: Sequence[int] | None = None, output_tokens: Any = None,
                            mirostat_mu: Sequence[float | None] | None = None) -> list[int]:
        """Admit one request per entry of `empty_slots` (request order), replacing what they held.

        sampling_params: one lane per slot (or scalars); prompt_tokens: `[len(empty_slots), S]`,
        -1 = padding. Each slot's position becomes its prompt length; streams (default 0) are the
        noise streams (choice i of an n > 1 request). output_tokens: `[len(empty_slots), S]` ids a
        request already generated (a preempted request resumed by the engine): they join its
        penalty history and its position becomes prompt length + their number. mirostat_mu: per
        slot, the Mirostat mu a resumed request continues with (`mu_of` before it left; None, or no
        list: 2 tau). Returns the effective seeds (drawn for the unseeded). Every other slot keeps
        its parameters, history and seed.
        """
        def check() -> tuple:
            slots = self._check_slots("empty_slots", empty_slots)
            if not slots:
                return slots, [], None, None, [], streams
            batch = as_batch_params(sampling_params)
            if batch.num_lanes() not in (None, len(slots)):
                raise InvalidSamplingParams("sampling_params", f"{batch.num_lanes()} lanes",
                                            f"one lane per empty slot ({len(slots)})")
            requests = self._requests(batch, len(slots))
            prompts = token_rows("prompt_tokens", prompt_tokens, len(slots), self.vocab_size)
            outputs = None if output_tokens is None else token_rows("output_tokens", output_tokens, len(slots),
                                                                    self.vocab_size)
            lengths = (prompts >= 0).sum(dim=1)
            if outputs is not None:
                lengths = lengths + (outputs >= 0).sum(dim=1)
            lengths = lengths.tolist()
            if max(lengths) >= POSITION_LIMIT:
                raise InvalidSamplingParams("prompt_tokens", max(lengths), f"prompts shorter than {POSITION_LIMIT}")
            mus = [None] * len(slots) if mirostat_mu is None else as_list("mirostat_mu", mirostat_mu,
                                                                          "None or one mu (or None) per slot")
            check_mus(slots, mus, lambda slot: None, dict(zip(slots, requests)))
            return (slots, requests, prompts, outputs, lengths,
                    None if streams is None else check_streams(int_list("streams", streams), len(slots)), mus)

        with single_threaded():  # many small operations: robust when another process wants a core
            slots, requests, prompts, outputs, lengths, streams, mus = self.agreement.check(
                "apply_prefill_state", check)
            if not slots:
                return []
            # every check is done (on every rank): change state
            seeds = self.seed_manager.reset_seed([r.seed for r in requests], slots, streams=streams,
                                                 positions=lengths)
            for slot in slots:
                self._occupied[slot] = True
                self._stale[slot] = self._prompt_stale[slot] = False
            self._write_device_params(slots, requests, changed_only=False)
            self.sampler.reset_history(slots, prompts.to(self.device),
                                       None if outputs is None else outputs.to(self.device))
            self.sampler.set_mu(slots, mus)
        return seeds

    def release_slots(self, slots: Sequence[int]) -> None:
        """Empty `slots` (idempotent): they are sampled greedily and never counted until re-admitted."""
        slot_list = self.agreement.check("release_slots", lambda: self._check_slots("slots", slots))
        self.seed_manager.release_slots(slot_list)
        for slot in slot_list:
            self._occupied[slot] = False
        self._write_device_params(slot_list, [NEUTRAL_PARAMS] * len(slot_list))

    # ------------------------------------------------------------ decode
    def apply_decode_state(self, chunks: Sequence[Any] | BatchSamplingParams, *, reload_sampling_params: bool,
                           reset_sampling_state: bool, prompt_tokens: Any = None, output_tokens: Any = None,
                           positions: Sequence[int | None] | torch.Tensor | None = None,
                           slot_remap: Sequence[int] | torch.Tensor | None = None,
                           sampling_mode: str = "device") -> None:
        """The sampling half of one decode step's update; see the module docstring.

        chunks: one `BatchSamplingParams` per sampling group, in slot order; a group's lane b is slot
        g * max_batch_size + b. Lanes past a short list keep their parameters; a scalar applies to
        every occupied lane. Values on empty slots are ignored (empty slots are admitted by prefill).
        prompt_tokens, output_tokens: `[max_batch_size * sampling_dp, S]`, -1 = padding, by slot.
        positions: the next token's position of each slot (None: keep the slot's counter).
        """
        n = self.num_lanes

        def check() -> tuple:
            for name, flag in (("reload_sampling_params", reload_sampling_params),
                               ("reset_sampling_state", reset_sampling_state)):
                if not isinstance(flag, bool):
                    raise InvalidSamplingParams(name, flag, "True or False (a required command)")
            if sampling_mode not in SAMPLING_MODES:
                raise InvalidSamplingParams("sampling_mode", sampling_mode, f"one of {SAMPLING_MODES}")
            remap = None if slot_remap is None else check_slot_remap(slot_remap, n)
            if remap == list(range(n)):
                remap = None
            if not reset_sampling_state:
                for name, value in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens),
                                    ("positions", positions)):
                    if value is not None:
                        raise InvalidSamplingParams(name, "given", "None unless reset_sampling_state=True")
            full_rebuild = reload_sampling_params and reset_sampling_state
            if sampling_mode == "device" and any(self._stale) and not full_rebuild:
                raise StaleSamplingState(
                    "reload_sampling_params/reset_sampling_state", (reload_sampling_params, reset_sampling_state),
                    f"both True: slots {self.stale_slots()[:8]}... are stale after host sampling or a host-mode remap")
            occupied = [self._occupied[j] for j in remap] if remap is not None else list(self._occupied)
            given: dict[int, SamplingParams] = {}
            if reload_sampling_params or reset_sampling_state:
                given = self._chunk_lanes(chunks, occupied)
            live = [s for s in range(n) if occupied[s]]
            prompts = outputs = None
            new_positions: dict[int, int] = {}
            if reset_sampling_state:
                if prompt_tokens is not None:
                    prompts = token_rows("prompt_tokens", prompt_tokens, n, self.vocab_size)
                if output_tokens is not None:
                    outputs = token_rows("output_tokens", output_tokens, n, self.vocab_size)
                if positions is not None:
                    new_positions = positions_by_slot(positions, live, n)
                if sampling_mode == "device" and prompts is None and live:
                    prompt_stale = remapped_prompt_stale(self._prompt_stale, remap, sampling_mode)
                    if any(prompt_stale[s] for s in live):
                        raise StaleSamplingState("prompt_tokens", None,
                                                 "the prompts of every slot: a host-mode remap left the device "
                                                 "prompt history in the old slots")
            return remap, full_rebuild, given, live, prompts, outputs, new_positions

        remap, full_rebuild, given, live, prompts, outputs, new_positions = self.agreement.check(
            "apply_decode_state", check, (reload_sampling_params, reset_sampling_state, sampling_mode))
        # every check is done (on every rank): change state
        if remap is not None:
            self._apply_remap(remap, sampling_mode)
        if reload_sampling_params:
            self._write_device_params(range(n), [given.get(slot) for slot in range(n)])
        if reset_sampling_state:
            by_slot: list[int | None] = [None] * n
            for slot, request in given.items():
                by_slot[slot] = request.seed
            self.seed_manager.reset_seed_from_slots(by_slot, list(given))
            self.seed_manager.align_seed_counters_to_positions(list(new_positions), list(new_positions.values()))
            if live:
                index = torch.tensor(live, dtype=torch.int64)
                mirostat = [s for s in live if self.sampler.params_of(s).mirostat_tau is not None]
                mus = self.sampler.mus_of(mirostat)  # mu follows the request: the rebuild keeps it
                self.sampler.reset_history(live, None if prompts is None else prompts[index].to(self.device),
                                           None if outputs is None else outputs[index].to(self.device))
                self.sampler.set_mu(mirostat, mus)
            if prompts is not None:
                for slot in live:
                    self._prompt_stale[slot] = False
        if sampling_mode == "host":
            self._stale = [True] * n
        elif full_rebuild:
            self._stale = [False] * n

    def _apply_remap(self, remap: list[int], sampling_mode: str) -> None:
        """The slots' whole state moves with their requests (`Sampler.move_slots`: only the slots that
        change hands), in both modes; a host-mode remap also marks every slot stale."""
        moved = [i for i, j in enumerate(remap) if i != j]
        self.sampler.move_slots(moved, [remap[i] for i in moved])
        self._occupied = [self._occupied[j] for j in remap]
        self._prompt_stale = remapped_prompt_stale(self._prompt_stale, remap, sampling_mode)
        self._stale = [self._stale[j] for j in remap] if sampling_mode == "device" else [True] * self.num_lanes
        self._sampled = [self._sampled[j] for j in remap]

    # ------------------------------------------------------------ sampling
    def _active_lanes(self, active_slots: Sequence[int] | None, batch: int, what: str) -> list[int]:
        """The slots a step counts: `active_slots` (checked: occupied, below the batch of `what`) or
        every occupied slot below it; raises `StaleSamplingState` for a slot awaiting its rebuild."""
        if active_slots is None:
            active = [s for s in range(batch) if self._occupied[s]]
        else:
            active = self._check_occupied("active_slots", active_slots)
            for slot in active:
                if slot >= batch:
                    raise InvalidSamplingParams("active_slots", slot, f"slots below the batch of {what} ({batch})")
        stale = [s for s in active if self._stale[s]]
        if stale:
            raise StaleSamplingState("active_slots", stale, "slots rebuilt by apply_decode_state(reload_sampling_"
                                     "params=True, reset_sampling_state=True) after host sampling")
        return active

    def sample(self, logits: torch.Tensor, *, active_slots: Sequence[int] | None = None,
               enable_trace: bool = False) -> tuple[torch.Tensor, LogprobsOutput | None]:
        """Sample every lane of `logits` (`[B, Vp]`, B <= max_batch_size * sampling_dp; row b is
        slot b). Only `active_slots` (default: every occupied slot < B) count their token and
        advance their position; the other rows return a valid id and change nothing.

        enable_trace: capture the step once per `TraceKey` as a CUDA graph and replay it (on the
        CPU the bookkeeping runs and the step is eager). A traced step must always get the same
        logits tensor (write the new logits into it); its outputs are overwritten by the next replay.
        Returns (token ids int64 [B], logprobs or None); `last_output.valid` flags rows with no id left.
        """
        def check() -> tuple[int, list[int], bool]:
            check_bool("enable_trace", enable_trace)
            batch = logits_batch(logits, self.sampler.layout.columns, self.num_lanes, self.device)
            active = self._active_lanes(active_slots, batch, "logits")
            force_argmax = self._num_sampled == 0  # every occupied row greedy (empty rows are)
            if enable_trace and self.agreement.shared and force_argmax == self._force_argmax:  # a flip drops all
                self.tracer.check(logits, force_argmax)
            return batch, active, force_argmax

        batch, active, force_argmax = self.agreement.check("sample", check, enable_trace)
        if force_argmax != self._force_argmax:
            self.clear_traces()
            self._force_argmax = force_argmax
        if not enable_trace and len(set(active)) == batch:  # every row counts (active: slots below batch)
            out = self.sampler.sample(logits)
        else:
            record = torch.zeros(batch, dtype=torch.bool)
            record[active] = True
            out = (self.tracer.step(logits, record, force_argmax) if enable_trace
                   else self.sampler.sample(logits, record=record.to(self.device)))
        self.last_output = out
        return out.token_ids, out.logprobs

    def sample_speculative(self, target_logits: torch.Tensor, draft_token_ids: torch.Tensor, *,
                           draft_probs: torch.Tensor | None = None, mode: str | None = None,
                           active_slots: Sequence[int] | None = None) -> SpeculativeOutput:
        """Verify K drafted tokens per lane (`Sampler.sample_speculative`, docs/speculative.md).

        Parameters
        ----------
        target_logits: [B, K+1, Vp] (a split: this rank's slice), B <= max_batch_size * sampling_dp;
            row b is slot b, position j the target's logits for the slot's position + j.
        draft_token_ids: integer [B, K], ids in [0, V) or -1 (no draft from there on).
        draft_probs: optional float [B, K, Vp], the draft's distribution (rejection mode).
        mode: "match" or "rejection" (default: "rejection" with draft_probs, else "match").
        active_slots: the slots whose emitted tokens are counted (default: every occupied slot < B);
            the other rows are verified and change nothing.

        Returns
        -------
        SpeculativeOutput (token_ids int64 [B, K+1], num_emitted int64 [B], valid, logprobs). Each
        active slot's position advances by its num_emitted (in the sampler's slot state): the same
        as `sample` once per emitted token. The position limit is checked first (one read of the
        active slots' positions).
        """
        def check() -> tuple[int, list[int]]:
            shape = getattr(target_logits, "shape", None)
            if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 3 \
                    or not 1 <= target_logits.shape[0] <= self.num_lanes:
                width = self.sampler.layout.columns
                raise InvalidSamplingParams("target_logits", shape if shape is not None else target_logits,
                                            f"a tensor [B, K+1, {width}] with 1 <= B <= {self.num_lanes}")
            batch, positions = target_logits.shape[:2]
            active = self._active_lanes(active_slots, batch, "target_logits")
            for position in self.sampler.positions_of(active):
                if position + positions >= POSITION_LIMIT:
                    raise InvalidSamplingParams("position", position + positions,
                                                f"below {POSITION_LIMIT} after the K+1 positions")
            return batch, active

        batch, active = self.agreement.check("sample_speculative", check)
        record = torch.zeros(batch, dtype=torch.bool)
        record[active] = True
        out = self.sampler.sample_speculative(target_logits, draft_token_ids, draft_probs=draft_probs, mode=mode,
                                              record=record.to(self.device))
        self.last_speculative = out
        return out

    def trace_keys(self) -> list[TraceKey]:
        """The keys of the steps captured now."""
        return self.tracer.keys()

    def clear_traces(self) -> None:
        """Drop every captured step (the next traced call captures again)."""
        self.tracer.clear()

    @property
    def trace_captures(self) -> int:
        """How many steps were captured (or, off CUDA, recorded for eager replay) so far."""
        return self.tracer.captures

    # ------------------------------------------------------------ helpers
    def _write_device_params(self, slots: Sequence[int], params: Sequence[SamplingParams | None], *,
                             changed_only: bool = True) -> None:
        """Make the sampler's row of `slots[i]` hold `params[i]` (None: keep the occupied slot's; an
        empty slot always holds the neutral row), all at once; `changed_only`: only the rows whose
        parameters change are rewritten (an admission rewrites every row: new requests)."""
        changed, targets = [], []
        for slot, given in zip(slots, params):
            current = self.sampler.params_of(slot)
            target = NEUTRAL_PARAMS if not self._occupied[slot] else given or current
            if not changed_only or (current is not target and current != target):
                changed.append(slot)
                targets.append(target)
                sampled = not target.greedy
                self._num_sampled += sampled - self._sampled[slot]
                self._sampled[slot] = sampled
        self.sampler.set_params(changed, targets)

    def _requests(self, batch: BatchSamplingParams, lanes: int) -> list[SamplingParams]:
        """`lanes` validated requests (`format_requests`: each lane built once), checked for the vocabulary."""
        requests = format_requests(batch, lanes, vocab_size=self.vocab_size)
        for request in requests:
            check_params_for_vocab(request, self.vocab_size, self.sampler.max_logprobs, self.sampler.layout.split)
        return requests

    def _chunk_lanes(self, chunks: Any, occupied: list[bool]) -> dict[int, SamplingParams]:
        """slot -> parameters for every occupied slot a chunk lane covers (validated)."""
        return lanes_by_slot(chunks, occupied, self.sampling_dp, self.max_batch_size, self._requests)

    def _check_slots(self, name: str, slots: Sequence[int]) -> list[int]:
        return check_slots(name, slots, self.num_lanes)

    def _check_occupied(self, name: str, slots: Sequence[int]) -> list[int]:
        slot_list = self._check_slots(name, slots)
        for slot in slot_list:
            if not self._occupied[slot]:
                raise InvalidSamplingParams(name, slot, "occupied slots (admitted by apply_prefill_state)")
        return slot_list
