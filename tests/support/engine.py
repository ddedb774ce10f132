"""A toy continuous-batching engine driving a `SamplingGenerator`, for the generator's tests.

It keeps its own record of every live request (parameters, seed, stream, prompt, outputs, next
position) and, after every step, checks the invariant: each live request's token equals the token a
fresh `Sampler` holding only that request (same seed, position, stream and history) returns for the
same logits row. Host-sampling steps draw their tokens with `reference_sample`, taking the noise
coordinates from the generator's `SeedManager` (once per token), as an engine sampling on the host would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from tests.support.slot_state import check_slot_state
from tokensampler import Sampler, SamplingParams
from tokensampler.engine.batch_params import BatchSamplingParams
from tokensampler.engine.generator import NEUTRAL_PARAMS, SamplingGenerator
from tokensampler.reference import ReferenceRequest, reference_step

EOS = (1,)


@dataclass
class Request:
    rid: int
    params: SamplingParams
    prompt: list[int]
    seed: int = -1
    stream: int = 0
    outputs: list[int] = field(default_factory=list)
    mu: float | None = None  # Mirostat's mu (None: 2 tau, the admitted value; or Mirostat off)
    retuned: bool = False  # new params not sent yet: the generator's mu restarts when they are

    @property
    def position(self) -> int:
        return len(self.prompt) + len(self.outputs)

    @property
    def want_mu(self) -> float | None:
        tau = self.params.mirostat_tau
        return None if tau is None else (2.0 * tau if self.mu is None else self.mu)


def fresh_token(request: Request, logits_row: torch.Tensor, vocab_size: int, **sampler_kw) -> tuple[int, float | None]:
    """The token a fresh Sampler holding only this request returns (at the request's Mirostat mu),
    and the mu after it."""
    sampler = Sampler(vocab_size, max_slots=1, padded_vocab_size=logits_row.shape[-1], eos_token_ids=EOS,
                      **sampler_kw)
    params = dataclasses.replace(request.params, seed=request.seed)
    sampler.add_request(0, params, request.prompt, output_token_ids=request.outputs,
                        position=request.position, stream=request.stream)
    sampler.set_mu([0], [request.mu])
    return int(sampler.sample(logits_row[None]).token_ids[0]), sampler.mu_of(0)


def fresh_tokens(requests: list[Request], logits_rows: torch.Tensor, vocab_size: int) -> list[tuple[int, float | None]]:
    """The same as `fresh_token` for each request, from one fresh Sampler holding all of them, one
    per slot (a row's token does not depend on the rest of the batch): the fast form of the check."""
    sampler = Sampler(vocab_size, max_slots=len(requests), padded_vocab_size=logits_rows.shape[-1],
                      eos_token_ids=EOS)
    for slot, request in enumerate(requests):
        sampler.add_request(slot, dataclasses.replace(request.params, seed=request.seed), request.prompt,
                            output_token_ids=request.outputs, position=request.position, stream=request.stream)
    sampler.set_mu(range(len(requests)), [r.mu for r in requests])
    tokens = sampler.sample(logits_rows).token_ids.tolist()
    return list(zip(tokens, sampler.mus_of(range(len(requests)))))


class Engine:
    """Slots of requests over a generator; every method mirrors one engine action."""

    def __init__(self, vocab_size: int = 64, max_batch_size: int = 4, sampling_dp: int = 1,
                 padded_vocab_size: int | None = None, seed: int = 0, generator: SamplingGenerator | None = None,
                 batched_check: bool = False):
        self.vocab_size = vocab_size
        self.padded = padded_vocab_size or vocab_size
        self.gen = generator or SamplingGenerator(vocab_size, max_batch_size=max_batch_size,
                                                  sampling_dp=sampling_dp, padded_vocab_size=self.padded,
                                                  device="cpu", eos_token_ids=EOS)
        self.n = self.gen.num_lanes
        self.slots: list[Request | None] = [None] * self.n
        self.rng = torch.Generator().manual_seed(seed)
        self.next_rid = 0
        self.pending_remap: list[int] | None = None
        self.stale: set[int] = set()  # what the engine knows: slots whose device rows missed host steps
        self.steps = 0
        self.checked_tokens = 0
        self.batched_check = batched_check  # one fresh Sampler for all rows instead of one per request

    @property
    def needs_rebuild(self) -> bool:
        return bool(self.stale)

    # ---------------------------------------------------------------- layout
    def free_slots(self) -> list[int]:
        return [s for s in range(self.n) if self.slots[s] is None]

    def live_slots(self) -> list[int]:
        return [s for s in range(self.n) if self.slots[s] is not None]

    def admit(self, entries: list[tuple[int, SamplingParams, list[int]]],
              streams: list[int] | None = None) -> list[int]:
        """Prefill: (slot, params, prompt) per request; returns the slots admitted."""
        slots = [slot for slot, _, _ in entries]
        width = max([len(p) for _, _, p in entries] + [1])
        prompts = torch.full((len(entries), width), -1, dtype=torch.int64)
        for i, (_, _, prompt) in enumerate(entries):
            prompts[i, :len(prompt)] = torch.tensor(prompt, dtype=torch.int64)
        batch = BatchSamplingParams.from_requests([p for _, p, _ in entries])
        seeds = self.gen.apply_prefill_state(sampling_params=batch, prompt_tokens=prompts, empty_slots=slots,
                                             streams=streams)
        self.stale -= set(slots)  # a prefill rebuilds the rows it admits (and only those)
        for i, ((slot, params, prompt), seed) in enumerate(zip(entries, seeds)):
            if params.seed is not None:
                assert seed == params.seed
            self.slots[slot] = Request(self.next_rid, params, list(prompt), seed,
                                       0 if streams is None else streams[i])
            self.next_rid += 1
        return slots

    def retune(self, slot: int, params: SamplingParams) -> None:
        """New parameters for the request in `slot`, sent with the next reload."""
        r = self.slots[slot]
        if params != r.params:
            self.slots[slot] = dataclasses.replace(r, params=params, retuned=True)

    def preempt_and_resume(self, slot: int, new_slot: int) -> None:
        """The request leaves `slot` (released) and is admitted again into the free `new_slot` with
        its outputs, seed, stream and Mirostat mu (`mu_of` before it left): it continues there."""
        assert self.pending_remap is None and (new_slot == slot or self.slots[new_slot] is None)
        r = self.slots[slot]
        mu = self.gen.mu_of(slot)
        self.gen.release_slots([slot])
        self.slots[slot] = None
        r.params = dataclasses.replace(r.params, seed=r.seed)  # the engine echoes the reported seed
        width = max(len(r.prompt), len(r.outputs), 1)
        rows = torch.full((2, width), -1, dtype=torch.int64)
        rows[0, :len(r.prompt)] = torch.tensor(r.prompt, dtype=torch.int64)
        rows[1, :len(r.outputs)] = torch.tensor(r.outputs, dtype=torch.int64)
        seeds = self.gen.apply_prefill_state(sampling_params=BatchSamplingParams.from_requests([r.params]),
                                             prompt_tokens=rows[:1], empty_slots=[new_slot], streams=[r.stream],
                                             output_tokens=rows[1:], mirostat_mu=[mu])
        assert seeds == [r.seed]
        self.stale -= {new_slot}
        self.slots[new_slot] = r

    def finish(self, slot: int, release: bool = False) -> None:
        self.slots[slot] = None
        if release:  # the generator sees the layout of the last decode: address the slot there
            self.gen.release_slots([slot if self.pending_remap is None else self.pending_remap[slot]])

    def remap(self, remap: list[int]) -> None:
        """The scheduler's layout change: new slot i takes old slot remap[i]; sent with the next decode."""
        assert self.pending_remap is None
        self.slots = [self.slots[j] for j in remap]
        self.pending_remap = list(remap)

    def condense(self) -> list[int]:
        """Live requests to the front, in order; the rest after them."""
        live = self.live_slots()
        remap = live + [s for s in range(self.n) if s not in live]
        self.remap(remap)
        return remap

    # ---------------------------------------------------------------- steps
    def chunks(self) -> list[BatchSamplingParams]:
        mbs = self.gen.max_batch_size
        return [BatchSamplingParams.from_requests(
            [(self.slots[s].params if self.slots[s] is not None else NEUTRAL_PARAMS)
             for s in range(g * mbs, (g + 1) * mbs)]) for g in range(self.gen.sampling_dp)]

    def histories(self) -> tuple[torch.Tensor, torch.Tensor, list[int | None]]:
        width = max([1] + [max(len(r.prompt), len(r.outputs)) for r in self.slots if r is not None])
        prompts = torch.full((self.n, width), -1, dtype=torch.int64)
        outputs = torch.full((self.n, width), -1, dtype=torch.int64)
        positions: list[int | None] = [None] * self.n
        for s, r in enumerate(self.slots):
            if r is not None:
                prompts[s, :len(r.prompt)] = torch.tensor(r.prompt, dtype=torch.int64)
                outputs[s, :len(r.outputs)] = torch.tensor(r.outputs, dtype=torch.int64)
                positions[s] = r.position
        return prompts, outputs, positions

    def logits(self, batch: int | None = None) -> torch.Tensor:
        rows = self.n if batch is None else batch
        scale = float(torch.rand((), generator=self.rng)) * 4 + 0.5
        return torch.randn((rows, self.padded), generator=self.rng) * scale

    def decode(self, mode: str = "device", *, reload: bool = False, reset: bool = False,
               send_prompts: bool = True, send_positions: bool = False, enable_trace: bool = False,
               logits: torch.Tensor | None = None) -> torch.Tensor:
        """One decode: the update (carrying any pending remap), then the tokens, checked."""
        if mode == "device" and self.needs_rebuild:
            reload = reset = True
        kwargs = {}
        if reset:
            prompts, outputs, positions = self.histories()
            kwargs = {"prompt_tokens": prompts if send_prompts else None, "output_tokens": outputs,
                      "positions": positions if send_positions else None}
        self.gen.apply_decode_state(self.chunks(), reload_sampling_params=reload, reset_sampling_state=reset,
                                    slot_remap=self.pending_remap, sampling_mode=mode, **kwargs)
        if reload:  # new params restart Mirostat's mu (set_params) where they changed
            for r in self.slots:
                if r is not None and r.retuned:
                    r.mu, r.retuned = None, False
        self.pending_remap = None  # consumed by the call that carried it
        logits = self.logits() if logits is None else logits
        if mode == "host":
            self.stale = set(range(self.n))
            tokens = self._host_tokens(logits)
            self._check_and_record(logits, tokens, self.live_slots(), device=False)
        else:
            self.stale = set()
            tokens, _ = self.gen.sample(logits, enable_trace=enable_trace)
            self._check_and_record(logits, tokens, self.live_slots())
        self.steps += 1
        return tokens

    def prefill_sample(self, slots: list[int]) -> torch.Tensor:
        """The first token of freshly admitted slots, sampled on the device; other lanes untouched."""
        logits = self.logits()
        tokens, _ = self.gen.sample(logits, active_slots=slots)
        self._check_and_record(logits, tokens, slots)
        self.steps += 1
        return tokens

    def _host_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        tokens = torch.zeros(logits.shape[0], dtype=torch.int64)
        for slot in self.live_slots():
            r = self.slots[slot]
            (seed,), (position,), (stream,) = self.gen.seed_manager.get_new_values([slot])
            assert (seed, position, stream) == (r.seed, r.position, r.stream), (slot, r)
            mu = self.gen.mu_of(slot)  # Mirostat's mu, read and written back like the position
            assert mu == r.want_mu, (slot, r, mu)
            request = ReferenceRequest(dataclasses.replace(r.params, seed=seed), seed, position, r.prompt,
                                       r.outputs, stream, EOS, mirostat_mu=mu)
            out, (mu,) = reference_step(logits[slot:slot + 1], [request], vocab_size=self.vocab_size)
            tokens[slot] = out.token_ids[0]
            self.gen.set_mu([slot], [mu])
        return tokens

    def _check_and_record(self, logits: torch.Tensor, tokens: torch.Tensor, active: list[int],
                          device: bool = True) -> None:
        """Every active slot's token is the fresh sampler's; on the device, every lane's id is valid
        and an empty lane's is its greedy id."""
        assert tokens.shape == (logits.shape[0],)
        if device:
            assert bool(((tokens >= 0) & (tokens < self.vocab_size)).all()), tokens
            occupied = set(self.gen.occupied_slots())
            for slot in range(logits.shape[0]):
                if slot not in occupied:
                    z = logits[slot, :self.vocab_size].float()
                    assert int(tokens[slot]) == int(torch.argmax(z)), slot
        if self.batched_check and active:
            expected = fresh_tokens([self.slots[s] for s in active], logits[active], self.vocab_size)
        else:
            expected = [fresh_token(self.slots[s], logits[s], self.vocab_size) for s in active]
        for slot, (want, mu) in zip(active, expected):
            r = self.slots[slot]
            assert int(tokens[slot]) == want, (self.steps, slot, r, int(tokens[slot]), want)
            r.outputs.append(int(tokens[slot]))
            r.mu = mu
            self.checked_tokens += 1
        self.check_host_state()

    def check_host_state(self) -> None:
        """The generator's seeds and positions follow every live request (through a pending remap,
        which the generator has not seen yet)."""
        for slot in self.live_slots():
            r = self.slots[slot]
            held = slot if self.pending_remap is None else self.pending_remap[slot]
            assert self.gen.seed_manager.snapshot(held) == (r.seed, r.position, r.stream), (slot, r)
            if not r.retuned:  # Mirostat's mu follows the request too
                assert self.gen.sampler.mu_of(held) == r.want_mu, (slot, r, self.gen.sampler.mu_of(held))
        check_slot_state(self.gen.sampler)
        # the generator's count of rows that are not greedy (a step forces argmax at 0) follows the rows
        sampled = [not r.params.greedy for r in self.gen.sampler.records_of(range(self.gen.num_lanes))]
        assert (self.gen._sampled, self.gen._num_sampled) == (sampled, sum(sampled))
