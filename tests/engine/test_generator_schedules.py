"""Hypothesis-driven engine schedules over a `SamplingGenerator` (thousands of steps in all).

Random admissions, finishes (released or not), condensing and arbitrary remaps, host and device
decodes with random reload/reset commands, prefill steps that sample only the admitted slots,
parameter changes, preemptions resumed with the request's outputs, seed and Mirostat mu, and traced
steps. After every step each live request's token must equal a fresh single-request `Sampler`'s
(checked inside `support.engine.Engine`), and the generator's seeds, positions and Mirostat mu must
follow every request. Small vocabulary and batches so the suite stays fast.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.support.engine import Engine
from tokensampler import Sampler, SamplingParams, StaleSamplingState
from tokensampler.engine.batch_params import BatchSamplingParams, format_sampling_params

V = 64
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + ([] if os.environ.get("TS_NO_SHRINK") else [Phase.shrink])
STEPS = {"count": 0, "rules": 0, "checked_tokens": 0}


@st.composite
def sampling_params(draw) -> SamplingParams:
    temperature = draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.7]))
    kwargs = dict(
        temperature=temperature,
        top_k=draw(st.sampled_from([0, 0, 1, 3, 10])),
        top_p=draw(st.sampled_from([1.0, 1.0, 0.5, 0.9])),
        min_p=draw(st.sampled_from([0.0, 0.0, 0.1])),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, 1.5, -0.5])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, 0.8])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.4, 0.7])),
        seed=draw(st.one_of(st.none(), st.integers(-2**63, 2**64 - 1))),
        logprobs=draw(st.sampled_from([None, None, 0, 2])),
    )
    if draw(st.booleans()):
        kwargs.update(min_tokens=draw(st.integers(1, 3)), stop_token_ids=(2, 3))
    if draw(st.integers(0, 4)) == 0:
        kwargs["allowed_token_ids"] = tuple(range(draw(st.integers(0, 40)), 50))
    if draw(st.integers(0, 4)) == 0:
        kwargs["logit_bias"] = {draw(st.integers(0, V - 1)): draw(st.sampled_from([-100.0, 3.0]))}
    if draw(st.integers(0, 3)) == 0:  # Mirostat: mu must follow the request like its position
        kwargs.update(mirostat_tau=draw(st.sampled_from([0.5, 2.0, 4.0])),
                      mirostat_eta=draw(st.sampled_from([0.1, 1.0])))
    return SamplingParams(**kwargs)


class EngineSchedule(RuleBasedStateMachine):
    """One engine, a random schedule of engine actions."""

    @initialize(shape=st.sampled_from([(4, 1, V), (3, 2, V), (5, 1, 70)]), seed=st.integers(0, 2**16))
    def setup(self, shape, seed):
        mbs, dp, padded = shape
        self.engine = Engine(V, max_batch_size=mbs, sampling_dp=dp, padded_vocab_size=padded, seed=seed,
                             batched_check=True)
        self.buffer = self.engine.logits()  # the one logits tensor traced steps read
        self.params_dirty = False
        self.host_remap_since_rebuild = False

    # ------------------------------------------------------------ layout
    @precondition(lambda self: self.engine.free_slots() and self.engine.pending_remap is None)
    @rule(data=st.data())
    def admit(self, data):
        free = self.engine.free_slots()
        slots = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=len(free), unique=True))
        entries = [(slot, data.draw(sampling_params()),
                    data.draw(st.lists(st.integers(0, V - 1), min_size=0, max_size=6))) for slot in slots]
        streams = data.draw(st.none() | st.lists(st.integers(0, 3), min_size=len(slots), max_size=len(slots)))
        self.engine.admit(entries, streams=streams)
        if data.draw(st.booleans()):
            self.engine.prefill_sample(slots)  # the admitted rows are fresh even when others are stale
            STEPS["count"] += 1

    @precondition(lambda self: self.engine.live_slots())
    @rule(data=st.data())
    def finish(self, data):
        slot = data.draw(st.sampled_from(self.engine.live_slots()))
        self.engine.finish(slot, release=data.draw(st.booleans()))

    @precondition(lambda self: self.engine.pending_remap is None)
    @rule(data=st.data())
    def remap(self, data):
        n = self.engine.n
        if data.draw(st.booleans()):
            self.engine.condense()
        else:
            self.engine.remap(data.draw(st.permutations(list(range(n)))))

    @precondition(lambda self: self.engine.live_slots())
    @rule(data=st.data())
    def retune(self, data):
        slot = data.draw(st.sampled_from(self.engine.live_slots()))
        request = self.engine.slots[slot]
        new = dataclasses.replace(data.draw(sampling_params()), seed=request.params.seed)
        self.engine.retune(slot, new)
        self.params_dirty = True

    @precondition(lambda self: self.engine.pending_remap is None and not self.engine.needs_rebuild
                  and any(not self.engine.slots[s].retuned for s in self.engine.live_slots()))
    @rule(data=st.data())
    def preempt_and_resume(self, data):
        """A request preempted and resumed (into its slot or a free one) with its outputs, seed and mu."""
        engine = self.engine
        slot = data.draw(st.sampled_from([s for s in engine.live_slots() if not engine.slots[s].retuned]))
        engine.preempt_and_resume(slot, data.draw(st.sampled_from([slot] + engine.free_slots())))

    # ------------------------------------------------------------ steps
    @rule(mode=st.sampled_from(["device", "device", "host"]), reload=st.booleans(), reset=st.booleans(),
          send_prompts=st.booleans(), send_positions=st.booleans(), trace=st.booleans())
    def decode(self, mode, reload, reset, send_prompts, send_positions, trace):
        engine = self.engine
        if mode == "host" and engine.pending_remap is not None:
            self.host_remap_since_rebuild = True
        reload = reload or self.params_dirty
        if mode == "device" and engine.needs_rebuild:
            send_prompts = send_prompts or self.host_remap_since_rebuild
        logits = None
        if trace and mode == "device":
            self.buffer.copy_(engine.logits())
            logits = self.buffer
        engine.decode(mode, reload=reload, reset=reset, send_prompts=send_prompts, send_positions=send_positions,
                      enable_trace=trace, logits=logits)
        STEPS["count"] += 1
        self.params_dirty = False
        if mode == "device":
            self.host_remap_since_rebuild = False

    @rule(trace=st.booleans())
    def steady_decode(self, trace):
        """The common case, drawn as often as all the other actions: a device decode, no commands
        (the full rebuild when the engine knows the device state is stale)."""
        self.decode("device", False, False, True, False, trace)

    @rule(trace=st.booleans())
    def steady_decode_again(self, trace):
        self.decode("device", False, False, True, False, trace)

    @precondition(lambda self: self.engine.needs_rebuild)
    @rule()
    def device_decode_without_rebuild_is_refused(self):
        engine = self.engine
        try:
            engine.gen.apply_decode_state(engine.chunks(), reload_sampling_params=True, reset_sampling_state=False,
                                          slot_remap=engine.pending_remap)
        except StaleSamplingState:
            return
        raise AssertionError("a stale device state was accepted without the full rebuild")

    @invariant()
    def host_state_follows_requests(self):
        self.engine.check_host_state()
        STEPS["rules"] += 1

    def teardown(self):
        STEPS["checked_tokens"] += self.engine.checked_tokens


EngineSchedule.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                                            derandomize=True, suppress_health_check=list(HealthCheck),
                                            phases=PHASES)
TestEngineSchedule = EngineSchedule.TestCase


def test_schedules_ran_thousands_of_steps():
    """Runs after the schedules (file order): the sampled steps really add up to thousands."""
    assert STEPS["count"] >= 1000 and STEPS["checked_tokens"] >= 1500, STEPS
    print(f"schedules: {STEPS}")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(lanes=st.lists(sampling_params(), min_size=1, max_size=4), width=st.integers(4, 6),
       raw=st.lists(st.tuples(st.sampled_from([-1, 0, 200, None]), st.sampled_from([1.0, 1.5, None]),
                              st.sampled_from([-0.2, 1.4, None])), min_size=4, max_size=4))
def test_format_is_idempotent_and_keeps_tokens(lanes, width, raw):
    """Out-of-range encodings clamp to values that sample the same tokens, and formatting twice is once."""
    batch = BatchSamplingParams.from_requests(lanes)
    batch.top_k = [k if r[0] is None else r[0] for k, r in zip(batch.top_k, raw)]
    batch.top_p = [p if r[1] is None else r[1] for p, r in zip(batch.top_p, raw)]
    batch.min_p = [m if r[2] is None else r[2] for m, r in zip(batch.min_p, raw)]
    once = format_sampling_params(batch, width, vocab_size=V)
    assert format_sampling_params(once, width, vocab_size=V) == once
    formatted = once.to_requests()[:len(lanes)]
    # the meaning of each clamped raw value, written as valid params
    meant = [dataclasses.replace(p, top_k=0 if (r[0] is not None and r[0] in (-1, 200)) else
                                 (p.top_k if r[0] is None else r[0]),
                                 top_p=min(p.top_p if r[1] is None else r[1], 1.0),
                                 min_p=min(max(p.min_p if r[2] is None else r[2], 0.0), 1.0))
             for p, r in zip(lanes, raw)]
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(len(lanes) * width)).round()
    for row in range(3):
        a, b = Sampler(V, max_slots=len(lanes)), Sampler(V, max_slots=len(lanes))
        for slot in range(len(lanes)):
            a.add_request(slot, dataclasses.replace(meant[slot], seed=slot), [5, 6], position=row)
            b.add_request(slot, dataclasses.replace(formatted[slot], seed=slot), [5, 6], position=row)
        rows = logits[row:row + 1].expand(len(lanes), V).contiguous()
        assert torch.equal(a.sample(rows).token_ids, b.sample(rows).token_ids)
