"""Tests of generator.py, batch_params.py and seeds.py: the decode-update contract, step by step.

The scripted schedules run through `support.engine.Engine`, which checks after every step that
each live request's token equals a fresh single-request `Sampler`'s (same seed, position, history).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.support.engine import EOS, Engine
from tests.support.slot_state import check_slot_state
from tokensampler import InvalidSamplingParams, InvalidSlotRemap, Sampler, SamplingParams, SeedManager
from tokensampler.engine.batch_params import (
    PADDING_LANE,
    BatchSamplingParams,
    broadcast_sampling_params,
    chunk_sampling_params,
    format_sampling_params,
    scatter_sampling_params_to_slots,
    slice_sampling_params,
)
from tokensampler.engine.generator import SamplingGenerator, StaleSamplingState, TraceMismatch, rank_local_slot_remap
from tokensampler.engine.seeds import check_slot_remap

V = 64
SP = SamplingParams


def mixed_params() -> list[SamplingParams]:
    """A spread of parameter kinds whose tokens depend on seed, position and history."""
    return [
        SP(temperature=0.8, seed=11, repetition_penalty=1.3),
        SP(temperature=1.2, top_k=7, frequency_penalty=0.7),
        SP(temperature=0.0, presence_penalty=1.5),
        SP(temperature=0.9, top_p=0.8, min_p=0.05, seed=2**64 - 5),
        SP(temperature=1.0, min_tokens=3, stop_token_ids=(2, 3), logit_bias={5: 2.0}),
        SP(temperature=0.7, allowed_token_ids=tuple(range(10, 30)), presence_penalty=-1.0, seed=-7),
    ]


def snapshot(gen: SamplingGenerator) -> tuple:
    """Everything a call may change, host and device."""
    st = gen.sampler.state
    sm = gen.seed_manager
    host = (list(sm.seeds), list(sm.drawn), list(sm.positions), list(sm.streams), list(gen._occupied),
            list(gen._stale), list(gen._prompt_stale), list(gen._sampled), gen._num_sampled, list(st.params),
            list(st.seeds), list(st.drawn), list(st.streams))
    return host, [t.clone() for t in st.slot_tensors()]


def assert_same_state(a: tuple, b: tuple) -> None:
    assert a[0] == b[0]
    assert len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


# ============================================================== BatchSamplingParams

def test_from_requests_to_requests_round_trip():
    requests = mixed_params()
    batch = BatchSamplingParams.from_requests(requests)
    assert batch.num_lanes() == len(requests)
    assert batch.to_requests() == requests
    assert batch.to_requests()[4].logit_bias == {5: 2.0}


def test_scalars_apply_to_every_lane_and_lists_must_agree():
    batch = BatchSamplingParams(temperature=[0.5, 0.0, 1.0], top_k=5, stop_token_ids=[7, 8])
    requests = batch.to_requests()
    assert [r.temperature for r in requests] == [0.5, 0.0, 1.0]
    assert all(r.top_k == 5 and r.stop_token_ids == (7, 8) for r in requests)
    per_lane = BatchSamplingParams(stop_token_ids=[[1], None, (2, 3)], allowed_token_ids=[None, [4], None])
    assert [r.stop_token_ids for r in per_lane.to_requests()] == [(1,), (), (2, 3)]
    assert [r.allowed_token_ids for r in per_lane.to_requests()] == [None, (4,), None]
    assert BatchSamplingParams(top_p=0.5).to_requests(3) == [SP(top_p=0.5)] * 3
    with pytest.raises(InvalidSamplingParams) as err:
        BatchSamplingParams(temperature=[1.0, 1.0], top_k=[1, 2, 3]).num_lanes()
    assert err.value.field == "top_k"
    with pytest.raises(InvalidSamplingParams):
        BatchSamplingParams(top_k=3).to_requests()  # scalars only: the lane count is needed
    with pytest.raises(InvalidSamplingParams) as err:
        BatchSamplingParams(temperature=[1.0, -1.0]).to_requests()
    assert err.value.field == "temperature"


@pytest.mark.parametrize("lanes", [4, 64, 1024])
def test_formatting_and_admitting_read_which_fields_are_per_lane_once(monkeypatch, lanes):
    """Finding the per-lane fields reads every lane, so doing it per lane made admitting k requests
    cost O(k^2) (seconds for 1,024): it is done a fixed number of times whatever the batch."""
    import tokensampler.engine.batch_params as batch_params

    calls = []
    original = batch_params.BatchSamplingParams.per_lane_fields
    monkeypatch.setattr(batch_params.BatchSamplingParams, "per_lane_fields",
                        lambda self: calls.append(1) or original(self))
    batch = BatchSamplingParams.from_requests([SamplingParams(temperature=0.8, seed=i) for i in range(lanes)])
    format_sampling_params(batch, lanes)
    batch.to_requests()
    gen = SamplingGenerator(50, max_batch_size=lanes, device="cpu", warmup=False)
    calls.clear()
    gen.apply_prefill_state(sampling_params=batch, prompt_tokens=torch.full((lanes, 2), 3),
                            empty_slots=list(range(lanes)))
    assert len(calls) <= 8


def test_format_pads_encodes_neutral_values_and_clamps():
    batch = BatchSamplingParams(temperature=[None, 0.0, 0.7, 1.0, 1.0], top_k=[-1, 5, 200, None, 3],
                                top_p=[1.5, 0.3, None, 0.9, 1.0], min_p=[None, 0.2, -0.1, 1.3, 0.1],
                                presence_penalty=[3.0, None, -5.0, 1.0, 0.0], seed=[-1, 4, None, 2**64 - 1, 0])
    out = format_sampling_params(batch, 7, vocab_size=V)
    assert out.num_lanes() == 7
    assert out.temperature == [1.0, 0.0, 0.7, 1.0, 1.0, 0.0, 0.0]
    assert out.top_k == [0, 0, 0, 0, 3, 0, 0]            # -1 and k >= V are off; greedy lane neutral
    assert out.top_p == [1.0, 1.0, 1.0, 0.9, 1.0, 1.0, 1.0]
    assert out.min_p == [0.0, 0.0, 0.0, 1.0, 0.1, 0.0, 0.0]
    assert out.presence_penalty == [2.0, 0.0, -2.0, 1.0, 0.0, 0.0, 0.0]
    assert out.seed == [None, 4, None, 2**64 - 1, 0, None, None]
    for name in out.per_lane_fields():
        assert getattr(out, name)[5:] == [PADDING_LANE[name]] * 2
    assert len(out.per_lane_fields()) == len(dataclasses.fields(SamplingParams))
    assert format_sampling_params(out, 7, vocab_size=V) == out  # idempotent
    # without a vocabulary, a large k is kept
    assert format_sampling_params(BatchSamplingParams(top_k=[200]), 1).top_k == [200]


@pytest.mark.parametrize("bad, field", [
    (BatchSamplingParams(top_p=[0.0]), "top_p"), (BatchSamplingParams(temperature=[math.nan]), "temperature"),
    (BatchSamplingParams(temperature=[-0.5]), "temperature"), (BatchSamplingParams(repetition_penalty=[0.0]),
                                                               "repetition_penalty"),
    (BatchSamplingParams(top_k=[1, 2, 3]), "params"), (BatchSamplingParams(seed=["x"]), "seed"),
])
def test_format_rejects_what_has_no_clamp(bad, field):
    with pytest.raises(InvalidSamplingParams) as err:
        format_sampling_params(bad, 2)
    assert err.value.field == field


def test_format_keeps_every_lanes_token():
    """The formatted encoding samples exactly the tokens the original parameters sample."""
    raw = BatchSamplingParams(temperature=[0.0, 0.0, 0.8, 1.1, 0.9], top_k=[3, 1, 500, -1, 4],
                              top_p=[0.2, 0.5, 1.7, 0.6, None], min_p=[0.5, None, 0.0, 0.1, -1.0],
                              seed=[1, 2, 3, 4, 5])
    clamped_originals = [SP(temperature=0.0, top_k=3, top_p=0.2, min_p=0.5, seed=1),
                         SP(temperature=0.0, top_k=1, top_p=0.5, seed=2), SP(temperature=0.8, seed=3),
                         SP(temperature=1.1, top_p=0.6, min_p=0.1, seed=4), SP(temperature=0.9, top_k=4, seed=5)]
    formatted = format_sampling_params(raw, 5, vocab_size=V).to_requests()
    assert formatted != clamped_originals  # the encodings differ ...
    torch.manual_seed(0)
    logits = torch.randn(40, V).round()  # ties on purpose
    for row in range(40):
        a = Sampler(V, max_slots=5)
        b = Sampler(V, max_slots=5)
        for slot in range(5):
            a.add_request(slot, clamped_originals[slot], [], position=row)
            b.add_request(slot, formatted[slot], [], position=row)
        rows = logits[row:row + 1].expand(5, V).contiguous()
        assert torch.equal(a.sample(rows).token_ids, b.sample(rows).token_ids)  # ... the tokens do not


def test_broadcast_chunk_slice_scatter():
    batch = BatchSamplingParams.from_requests([SP(temperature=0.1), SP(top_k=4), SP(seed=9), SP(min_p=0.5)])
    wide = broadcast_sampling_params(batch, 2, 3)
    assert wide.to_requests() == [SP(seed=9)] * 3
    with pytest.raises(InvalidSamplingParams):
        broadcast_sampling_params(batch, 4, 3)
    parts = chunk_sampling_params(BatchSamplingParams(temperature=[0.1, 0.2, 0.3, 0.4], top_k=7), 2)
    assert [p.temperature for p in parts] == [[0.1, 0.2], [0.3, 0.4]] and [p.top_k for p in parts] == [7, 7]
    with pytest.raises(InvalidSamplingParams):
        chunk_sampling_params(BatchSamplingParams(temperature=[0.1, 0.2, 0.3]), 2)
    assert slice_sampling_params(batch, 1, 3).to_requests() == [SP(top_k=4), SP(seed=9)]
    assert slice_sampling_params(BatchSamplingParams(top_k=3), 0, 1).top_k == 3
    placed = scatter_sampling_params_to_slots(slice_sampling_params(batch, 0, 2), [3, 1], 4)
    assert placed.to_requests() == [SP(temperature=0.0), SP(top_k=4), SP(temperature=0.0), SP(temperature=0.1)]
    kept = scatter_sampling_params_to_slots(slice_sampling_params(batch, 0, 1), [2], 4, base=batch)
    assert kept.to_requests() == [SP(temperature=0.1), SP(top_k=4), SP(temperature=0.1), SP(min_p=0.5)]
    with pytest.raises(InvalidSamplingParams):
        scatter_sampling_params_to_slots(batch, [0, 0, 1, 2], 4)


# ============================================================== SeedManager

def draws():
    counter = iter(range(1000, 2000))
    return lambda: next(counter)


def test_seed_manager_reset_and_advance():
    sm = SeedManager(4, seed_source=draws())
    assert sm.reset_seed([5, None, -1], [2, 0, 3], streams=[1, 0, 2]) == [5, 1000, 1001]
    assert sm.seeds == [1000, None, 5, 1001] and sm.drawn == [True, False, False, True]
    sm.align_seed_counters_to_positions([2, 0], [10, 3])
    assert sm.get_new_values([2, 3]) == ([5, 1001], [10, 0], [1, 2])
    assert sm.get_new_values([2]) == ([5], [11], [1])
    assert sm.positions == [3, 0, 12, 1]
    with pytest.raises(InvalidSamplingParams):
        sm.get_new_values([2, 2])   # once per token
    with pytest.raises(InvalidSamplingParams):
        sm.get_new_values([1])      # no seed
    assert sm.positions == [3, 0, 12, 1]


def test_reset_seed_from_slots_keeps_continuing_requests():
    sm = SeedManager(4, seed_source=draws())
    sm.reset_seed([5, None, 7], [0, 1, 2])
    sm.align_seed_counters_to_positions([0, 1, 2], [4, 6, 8])
    out = sm.reset_seed_from_slots([5, None, 8, None], [0, 1, 2, 3])
    assert out == [5, 1000, 8, 1001]
    assert sm.positions == [4, 6, 0, 0]   # same seed kept its counter; a new seed starts at 0
    assert sm.drawn == [False, True, False, True]
    # None on a slot holding an explicit seed is another (unseeded) request: a fresh draw
    assert sm.reset_seed_from_slots([None], [0]) == [1002] and sm.positions[0] == 0
    # an engine echoing the drawn seed back as an explicit one continues the request
    sm.align_seed_counters_to_positions([1], [9])
    assert sm.reset_seed_from_slots([None, 1000], [0, 1]) == [1002, 1000] and sm.positions[1] == 9


def test_seed_manager_remap_and_release():
    sm = SeedManager(3, seed_source=draws())
    sm.reset_seed([1, 2, 3], [0, 1, 2])
    sm.align_seed_counters_to_positions([0, 1, 2], [10, 20, 30])
    sm.apply_slot_remap([2, 0, 1])
    assert sm.seeds == [3, 1, 2] and sm.positions == [30, 10, 20]
    before = (list(sm.seeds), list(sm.positions))
    for bad in ([0, 1], [0, 1, 3], [0, 0, 1], [0, 1, -1], [0.0, 1, 2], [True, 0, 2]):
        with pytest.raises(InvalidSlotRemap):
            sm.apply_slot_remap(bad)
    assert (sm.seeds, sm.positions) == before
    sm.release_slot(1)
    sm.release_slot(1)
    assert sm.seeds == [3, None, 2] and sm.positions == [30, 0, 20]
    assert check_slot_remap(torch.tensor([1, 0, 2]), 3) == [1, 0, 2]


# ============================================================== rank-local remaps

def test_rank_local_slot_remap_uses_the_lane_stride():
    # two lanes of scheduler capacity 3, each replica padded to 4 local slots
    global_remap = [2, 0, 1, 4, 3, 5]
    assert rank_local_slot_remap(global_remap, 0, 3, 4) == [2, 0, 1, 3]
    assert rank_local_slot_remap(global_remap, 1, 3, 4) == [1, 0, 2, 3]
    with pytest.raises(InvalidSamplingParams):  # split by the padded width: lane 1 runs off the end
        rank_local_slot_remap(global_remap, 1, 4, 4)
    with pytest.raises(InvalidSamplingParams) as err:  # an entry from another lane
        rank_local_slot_remap([0, 3, 2, 1, 4, 5], 0, 3, 4)
    assert err.value.field == "global_remap[1]"
    with pytest.raises(InvalidSamplingParams):
        rank_local_slot_remap(global_remap, 0, 5, 4)


def test_lane_parallel_replicas_follow_a_global_remap():
    """Two replicas (lanes) of 3 scheduled slots each, padded to 4 local slots per generator."""
    stride, width = 3, 4
    engines = [Engine(max_batch_size=width, seed=lane) for lane in range(2)]
    for lane, engine in enumerate(engines):
        params = mixed_params()[3 * lane:3 * lane + 3]
        engine.admit([(s, params[s], [3 + s, 9, 12 + lane]) for s in range(stride)])
        engine.prefill_sample(list(range(stride)))
    for step in range(6):
        global_remap = [[1, 2, 0, 3, 5, 4], [0, 1, 2, 3, 4, 5]][step % 2]
        for lane, engine in enumerate(engines):
            engine.remap(rank_local_slot_remap(global_remap, lane, stride, width))
            engine.decode("device" if step < 3 else "host")
    for engine in engines:
        engine.decode("device")
        assert engine.checked_tokens == 3 * 8


# ============================================================== the generator, scripted

def test_prefill_admits_only_its_slots_and_sample_counts_only_active_ones():
    engine = Engine(max_batch_size=4)
    params = mixed_params()
    engine.admit([(0, params[0], [4, 5, 6]), (2, params[1], [7, 7])])
    engine.prefill_sample([0, 2])
    for _ in range(3):
        engine.decode()
    before = engine.gen.seed_manager.snapshot(0), engine.gen.seed_manager.snapshot(2)
    engine.admit([(1, params[3], [9, 10, 11, 12])])
    assert (engine.gen.seed_manager.snapshot(0), engine.gen.seed_manager.snapshot(2)) == before
    engine.prefill_sample([1])  # only slot 1 counts its token
    assert (engine.gen.seed_manager.snapshot(0), engine.gen.seed_manager.snapshot(2)) == before
    engine.check_host_state()
    for _ in range(3):
        engine.decode()
    # a finished request needs no release: the prefill overwrites its slot
    engine.finish(2)
    engine.admit([(2, params[4], [13])])
    engine.prefill_sample([2])
    for _ in range(4):
        engine.decode()
    assert engine.checked_tokens == 2 + 3 * 2 + 1 + 3 * 3 + 1 + 4 * 3


def test_device_remaps_move_every_request_and_are_consumed_once():
    engine = Engine(max_batch_size=5)
    params = mixed_params()
    engine.admit([(s, params[s], [s + 2] * (s + 1)) for s in range(5)])
    engine.decode()
    engine.finish(1)
    engine.condense()                     # [0, 2, 3, 4, 1]
    engine.decode()
    engine.remap([1, 2, 0, 3, 4])         # a 3-cycle: applying it twice is visibly wrong
    engine.decode()
    state = snapshot(engine.gen)
    engine.gen.apply_decode_state(engine.chunks(), reload_sampling_params=False, reset_sampling_state=False)
    assert_same_state(state, snapshot(engine.gen))   # no later call re-applies the remap
    for _ in range(3):
        engine.decode()
    assert engine.checked_tokens == 5 + 4 * 5


def test_remap_list_is_not_kept():
    engine = Engine(max_batch_size=3)
    engine.admit([(s, mixed_params()[s], [5]) for s in range(3)])
    remap = [2, 0, 1]
    engine.remap(remap)
    engine.decode()
    remap[:] = [0, 2, 1]                  # the caller reuses its buffer
    for _ in range(2):
        engine.decode()


def test_host_remap_then_device_decode_needs_the_full_rebuild():
    engine = Engine(max_batch_size=4)
    params = mixed_params()
    engine.admit([(s, params[s], [s + 1, 20]) for s in range(4)])
    engine.decode()
    engine.remap([3, 2, 0, 1])
    engine.decode("host")
    gen = engine.gen
    assert gen.stale_slots() == [0, 1, 2, 3]
    state = snapshot(gen)
    for reload, reset in ((False, False), (True, False), (False, True)):
        with pytest.raises(StaleSamplingState):
            gen.apply_decode_state(engine.chunks(), reload_sampling_params=reload, reset_sampling_state=reset,
                                   **({"output_tokens": engine.histories()[1]} if reset else {}))
        assert_same_state(state, snapshot(gen))
    with pytest.raises(StaleSamplingState):
        gen.sample(engine.logits())
    assert_same_state(state, snapshot(gen))
    # the prompts are needed too: the device prompt rows were left in the old slots
    with pytest.raises(StaleSamplingState) as err:
        engine.decode("device", send_prompts=False)
    assert err.value.field == "prompt_tokens"
    assert_same_state(state, snapshot(gen))
    engine.decode("device")
    for _ in range(2):
        engine.decode("device")
    assert engine.checked_tokens == 4 * 5


def test_partial_prefill_does_not_clear_the_stale_mark():
    engine = Engine(max_batch_size=4)
    params = mixed_params()
    engine.admit([(0, params[0], [3]), (1, params[1], [4])])
    engine.decode("host")
    engine.admit([(2, params[2], [5, 6])])
    engine.prefill_sample([2])            # the admitted row is fresh: it may be sampled on the device
    with pytest.raises(StaleSamplingState):
        engine.gen.sample(engine.logits(), active_slots=[0])
    with pytest.raises(StaleSamplingState):
        engine.gen.apply_decode_state(engine.chunks(), reload_sampling_params=True, reset_sampling_state=False)
    engine.decode("device")               # the engine commands the full rebuild
    engine.decode("device")
    assert engine.gen.stale_slots() == []


def test_host_and_device_alternate_with_remaps_in_both_modes():
    engine = Engine(max_batch_size=6, seed=3)
    params = mixed_params()
    engine.admit([(s, params[s], [s, s + 1, 40]) for s in range(4)])
    engine.prefill_sample([0, 1, 2, 3])
    schedule = ["device", "host", "host", "device", "device", "host", "device"]
    for step, mode in enumerate(schedule):
        if step == 2:
            engine.finish(0)
            engine.condense()
        if step == 4:
            engine.admit([(4, params[4], [1, 2]), (5, params[5], [9])])
            engine.prefill_sample([4, 5])
        if step == 5:
            engine.remap([5, 4, 3, 2, 1, 0])
        engine.decode(mode, send_positions=(step == 3))
    assert engine.checked_tokens == 4 + 4 + 4 + 3 + 3 + 2 + 5 + 5 + 5


def test_reset_realigns_positions_and_rebuilds_history():
    engine = Engine(max_batch_size=2)
    params = SP(temperature=0.9, frequency_penalty=1.0, repetition_penalty=1.5, seed=5)
    engine.admit([(0, params, [1, 2, 3])])
    for _ in range(3):
        engine.decode()
    gen = engine.gen
    state = snapshot(gen)
    gen.apply_decode_state(engine.chunks(), reload_sampling_params=True, reset_sampling_state=True)
    assert snapshot(gen)[0][:4] == state[0][:4]   # neither command advances a seed or a position
    # the engine rewinds the request by one token: history and position follow
    r = engine.slots[0]
    r.outputs.pop()
    engine.decode(reload=False, reset=True, send_positions=True)
    # output_tokens=None clears the outputs; the position counter is kept
    gen.apply_decode_state(engine.chunks(), reload_sampling_params=False, reset_sampling_state=True)
    logits = engine.logits()
    token = int(gen.sample(logits)[0][0])
    sampler = Sampler(V, max_slots=1, eos_token_ids=EOS)
    sampler.add_request(0, params, r.prompt, position=r.position)
    assert token == int(sampler.sample(logits[:1]).token_ids[0])
    assert gen.position_of(0) == r.position + 1


def test_empty_lanes_return_their_greedy_id_and_change_nothing():
    engine = Engine(max_batch_size=4)
    engine.admit([(1, mixed_params()[0], [2])])
    logits = engine.logits()
    logits[0] = float("nan")
    logits[2, 7] = float("inf")
    before = snapshot(engine.gen)
    tokens, _ = engine.gen.sample(logits, active_slots=[])
    assert_same_state(before, snapshot(engine.gen))
    assert int(tokens[2]) == 7 and 0 <= int(tokens[0]) < V and int(tokens[3]) == int(logits[3].argmax())
    assert bool(engine.gen.last_output.valid[1]) and not bool(engine.gen.last_output.valid[0])
    engine.decode()
    engine.finish(1, release=True)
    engine.gen.release_slots([1])      # idempotent
    engine.decode()
    assert engine.gen.occupied_slots() == []


def test_unseeded_requests_record_a_seed_that_replays():
    engine = Engine(max_batch_size=3)
    engine.admit([(0, SP(temperature=1.0), [5]), (1, SP(temperature=1.0), [5])])
    seeds = [engine.gen.seed_of(0), engine.gen.seed_of(1)]
    assert seeds[0] != seeds[1] and seeds == [engine.slots[0].seed, engine.slots[1].seed]
    for mode in ("device", "host", "device"):
        engine.remap([1, 0, 2])
        engine.decode(mode)
    assert [engine.gen.seed_of(0), engine.gen.seed_of(1)] == seeds[::-1]
    # the engine echoes the reported seeds back as explicit ones: the requests continue unchanged
    for slot in (0, 1):
        r = engine.slots[slot]
        engine.slots[slot] = dataclasses.replace(r, params=dataclasses.replace(r.params, seed=r.seed))
    engine.decode(reload=True, reset=True)
    engine.decode()
    assert engine.checked_tokens == 10


def test_streams_of_an_n_request_are_independent_choices():
    engine = Engine(max_batch_size=4)
    params = SP(temperature=1.5, seed=99)
    engine.admit([(s, params, [3, 4]) for s in range(4)], streams=[0, 1, 2, 3])
    outs = [tuple(int(t) for t in engine.decode()) for _ in range(6)]
    assert len({tuple(col) for col in zip(*outs)}) > 1   # the four choices differ
    engine.remap([3, 2, 1, 0])
    engine.decode("host")
    engine.decode("device")


def test_logprobs_follow_the_request():
    gen = SamplingGenerator(V, max_batch_size=3, device="cpu", logprobs_mode="processed_logprobs")
    params = SP(temperature=0.8, top_k=6, logprobs=3, seed=1, repetition_penalty=1.4)
    gen.apply_prefill_state(sampling_params=BatchSamplingParams.from_requests([params]),
                            prompt_tokens=[[4, 5]], empty_slots=[2])
    gen.apply_decode_state([BatchSamplingParams.from_requests([SP(temperature=0.0)] * 2 + [params])],
                           reload_sampling_params=False, reset_sampling_state=False, slot_remap=[2, 0, 1])
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    tokens, logprobs = gen.sample(logits)
    sampler = Sampler(V, max_slots=1, logprobs_mode="processed_logprobs")
    sampler.add_request(0, params, [4, 5])
    expected = sampler.sample(logits[:1])
    assert int(tokens[0]) == int(expected.token_ids[0])
    assert torch.allclose(logprobs.top_logprobs[0], expected.logprobs.top_logprobs[0])
    assert torch.equal(logprobs.top_token_ids[0], expected.logprobs.top_token_ids[0])


def test_sampling_groups_take_one_chunk_each():
    engine = Engine(max_batch_size=3, sampling_dp=2)
    params = mixed_params()
    engine.admit([(s, params[s], [s + 3]) for s in range(6)])
    engine.decode()
    engine.remap([3, 4, 5, 0, 1, 2])
    engine.decode()
    engine.slots[4] = dataclasses.replace(engine.slots[4], params=SP(temperature=0.3, top_k=2))
    engine.decode(reload=True)            # the change reaches slot 4 through group 1's chunk
    assert engine.gen.params_of(4) == SP(temperature=0.3, top_k=2)
    with pytest.raises(InvalidSamplingParams):
        engine.gen.apply_decode_state(engine.chunks()[:1], reload_sampling_params=True, reset_sampling_state=False)
    assert engine.checked_tokens == 18


def test_short_chunks_keep_the_other_lanes_and_scalars_cover_every_lane():
    engine = Engine(max_batch_size=4)
    params = mixed_params()
    engine.admit([(s, params[s], [s + 3]) for s in range(4)])
    gen = engine.gen
    gen.apply_decode_state([BatchSamplingParams.from_requests([SP(temperature=0.5, seed=11)])],
                           reload_sampling_params=True, reset_sampling_state=False)
    assert [gen.params_of(s) for s in range(4)] == [SP(temperature=0.5, seed=11)] + params[1:4]
    gen.apply_decode_state([BatchSamplingParams(temperature=0.0)], reload_sampling_params=True,
                           reset_sampling_state=False)
    assert all(gen.params_of(s).greedy for s in range(4))


def test_bad_calls_raise_before_any_change():
    engine = Engine(max_batch_size=4)
    params = mixed_params()
    engine.admit([(s, params[s], [s + 3]) for s in range(3)])
    engine.decode()
    gen = engine.gen
    state = snapshot(gen)
    chunks = engine.chunks()
    bad_calls = [
        dict(slot_remap=[0, 1, 2]), dict(slot_remap=[0, 1, 2, 4]), dict(slot_remap=[0, 1, 1, 3]),
        dict(slot_remap=[0, 1, 2, -1]),
        dict(reset_sampling_state=True, prompt_tokens=[[0, 64]] * 4),
        dict(reset_sampling_state=True, output_tokens=torch.zeros(3, 2, dtype=torch.int64)),
        dict(reset_sampling_state=True, positions=[1, 2, -3, None]),
        dict(reset_sampling_state=True, positions=[1, 2]),
        dict(output_tokens=torch.zeros(4, 2, dtype=torch.int64)),   # history without the reset command
        dict(reload_sampling_params=True, slot_remap=[3, 2, 1, 0],
             chunks=[BatchSamplingParams(temperature=[1.0, 1.0, -1.0, 1.0])]),
        dict(reload_sampling_params=True, chunks=[BatchSamplingParams(logit_bias=[{64: 1.0}, None, None, None])]),
        dict(reload_sampling_params=True, chunks=[BatchSamplingParams(logprobs=[21, None, None, None])]),
        dict(sampling_mode="tpu"), dict(reload_sampling_params=1),
    ]
    for bad in bad_calls:
        kwargs = {"reload_sampling_params": False, "reset_sampling_state": False, **bad}
        call_chunks = kwargs.pop("chunks", chunks)
        with pytest.raises(ValueError):
            gen.apply_decode_state(call_chunks, **kwargs)
        assert_same_state(state, snapshot(gen))
    with pytest.raises(TypeError):
        gen.apply_decode_state(chunks, reload_sampling_params=True)  # both commands are required
    for bad in (dict(prompt_tokens=[[1, 70]], empty_slots=[3]), dict(prompt_tokens=[[1], [2]], empty_slots=[3]),
                dict(prompt_tokens=[[1]], empty_slots=[4]), dict(prompt_tokens=[[1], [2]], empty_slots=[3, 3]),
                dict(prompt_tokens=[[1], [1, 2]], empty_slots=[3, 0]),
                dict(prompt_tokens=[[1]], empty_slots=[3], sampling_params=BatchSamplingParams(top_p=[2.0, 1.0]))):
        with pytest.raises(ValueError):
            gen.apply_prefill_state(**{"sampling_params": BatchSamplingParams(top_k=3), **bad})
        assert_same_state(state, snapshot(gen))
    for bad_sample in (dict(active_slots=[3]), dict(active_slots=[0, 0]), dict(active_slots=[7])):
        with pytest.raises(ValueError):
            gen.sample(engine.logits(), **bad_sample)
        assert_same_state(state, snapshot(gen))
    with pytest.raises(ValueError):
        gen.sample(torch.zeros(5, V))
    engine.decode()


# ============================================================== traces

def test_trace_bookkeeping_on_cpu():
    engine = Engine(max_batch_size=4)
    gen = engine.gen
    engine.admit([(0, SP(temperature=0.0), [3]), (1, SP(temperature=0.0, presence_penalty=1.0), [4])])
    buffer = engine.logits()
    for _ in range(3):
        buffer.copy_(engine.logits())
        engine.decode(enable_trace=True, logits=buffer)
    assert gen.trace_captures == 1
    with pytest.raises(TraceMismatch):
        gen.sample(engine.logits(), enable_trace=True)
    engine.decode(logits=engine.logits())         # untraced steps take any tensor
    # a sampled (not greedy) request: force-argmax changes and every captured step is dropped
    engine.admit([(2, SP(temperature=0.9, seed=4), [5])])
    engine.prefill_sample([2])
    other = engine.logits()
    engine.decode(enable_trace=True, logits=other)  # a new capture may bind another tensor
    assert gen.trace_captures == 2
    assert [key.force_argmax for key in gen.trace_keys()] == [False]  # the greedy step was dropped
    # same key, another plan (top-k appears): captured again on the same tensor
    engine.slots[2] = dataclasses.replace(engine.slots[2], params=SP(temperature=0.9, seed=4, top_k=3))
    other.copy_(engine.logits())
    engine.decode(reload=True, enable_trace=True, logits=other)
    assert gen.trace_captures == 3
    other.copy_(engine.logits())
    engine.decode(enable_trace=True, logits=other)
    assert gen.trace_captures == 3
    # a smaller batch bucket is another key
    small = engine.logits(batch=2)
    tokens, _ = gen.sample(small, active_slots=[0, 1], enable_trace=True)
    assert gen.trace_captures == 4 and tokens.shape == (2,)
    engine._check_and_record(small, tokens, [0, 1])
    engine.decode(enable_trace=True, logits=other)
    # every lane greedy again: force-argmax flips back, and the step is captured afresh on any tensor
    engine.finish(2, release=True)
    fresh = engine.logits()
    engine.decode(enable_trace=True, logits=fresh)
    assert gen.trace_captures == 5 and len(gen.trace_keys()) == 1 and gen.trace_keys()[0].force_argmax


def test_reset_without_prompts_keeps_the_prompt_history():
    gen = SamplingGenerator(V, max_batch_size=2, device="cpu")
    params = SP(temperature=0.0, repetition_penalty=100.0)
    gen.apply_prefill_state(sampling_params=BatchSamplingParams.from_requests([params, params]),
                            prompt_tokens=[[7, -1], [8, 9]], empty_slots=[0, 1])
    logits = torch.zeros(2, V)
    logits[:, 7] = 5.0
    logits[:, 8] = 4.0
    logits[:, 9] = 3.0
    gen.apply_decode_state([BatchSamplingParams.from_requests([params, params])], reload_sampling_params=True,
                           reset_sampling_state=True, output_tokens=[[5], [-1]])
    assert gen.sample(logits)[0].tolist() == [8, 7]   # the prompts still penalise 7 (slot 0), 8 and 9 (slot 1)
    gen.apply_decode_state([BatchSamplingParams.from_requests([params, params])], reload_sampling_params=False,
                           reset_sampling_state=True, prompt_tokens=[[-1], [7]], output_tokens=[[8], [-1]])
    assert gen.sample(logits)[0].tolist() == [7, 8]   # new prompts; slot 0 has output 8 penalised


def test_readme_example_runs_and_keeps_requests_in_their_slots(capsys):
    """The worked engine loop of the README runs as written."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = text.split("## Engines:", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    gen, slots = namespace["gen"], namespace["slots"]
    assert "refused:" in capsys.readouterr().out
    for slot in (0, 1):
        s = slots[slot]
        assert gen.position_of(slot) == len(s["prompt"]) + len(s["outputs"]) + 1  # the last token counted
    assert slots[1]["prompt"] == [11, 12, 13] and gen.seed_of(1) == 7


def test_a_lane_emptied_by_a_host_remap_is_greedy_while_the_rest_is_stale():
    engine = Engine(max_batch_size=4)
    hot = SP(temperature=5.0, seed=3)
    engine.admit([(0, hot, [1]), (1, hot, [2])])
    engine.decode()
    engine.remap([2, 1, 0, 3])            # the request in slot 0 moves to slot 2; slot 0 is empty now
    engine.decode("host")
    for _ in range(4):                     # prefill steps on the device while slots 1 and 2 are stale
        slot = engine.free_slots()[-1]
        engine.admit([(slot, hot, [3])])
        engine.prefill_sample([slot])      # checks that lane 0 returns its greedy id
        engine.finish(slot, release=True)
    engine.decode()


# ============================================================== the Sampler additions the generator uses

def test_sampler_record_mask_set_params_set_noise_reset_history():
    sampler = Sampler(V, max_slots=3)
    for slot in range(3):
        sampler.add_request(slot, SP(temperature=0.9, seed=slot, frequency_penalty=1.0), [slot], position=5)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    out = sampler.sample(logits, record=torch.tensor([True, False, True]))
    assert sampler.state.position.tolist() == [6, 5, 6] and sampler.state.output_len.tolist() == [1, 0, 1]
    assert sampler.state.output_counts.sum(dim=1).tolist() == [1, 0, 1]
    with pytest.raises(InvalidSamplingParams):
        sampler.sample(logits, record=torch.tensor([True, False]))
    # set_params keeps the seed, position and history; the token is a fresh sampler's with them
    new = SP(temperature=0.5, top_k=4, frequency_penalty=1.0, seed=0)
    sampler.set_params([0], [new])
    fresh = Sampler(V, max_slots=1)
    fresh.add_request(0, new, [0], output_token_ids=[int(out.token_ids[0])], position=6)
    assert int(sampler.sample(logits[:1], [0]).token_ids[0]) == int(fresh.sample(logits[:1]).token_ids[0])
    before = [t.clone() for t in sampler.state.slot_tensors()]
    for bad in (dict(positions=[-1]), dict(seeds=[2**64]), dict(streams=[2**32]), dict(seeds=[1, 2])):
        args = {"seeds": [1], "positions": [0], "streams": [0], **bad}
        with pytest.raises(InvalidSamplingParams):
            sampler.set_noise([1], **args)
    for bad in (torch.tensor([[V]]), torch.tensor([[-2]]), torch.tensor([[0.5]]), torch.tensor([1])):
        with pytest.raises(InvalidSamplingParams):
            sampler.reset_history([1], bad, None)
    assert all(torch.equal(a, b) for a, b in zip(before, sampler.state.slot_tensors()))
    sampler.set_noise([1, 2], seeds=[2**64 - 1, 7], positions=[40, 41], streams=[3, 0])
    sampler.reset_history([1, 2], torch.tensor([[4, -1, 4], [-1, -1, -1]]), torch.tensor([[9, 9, -1], [-1, 8, -1]]))
    st = sampler.state
    assert st.seed[1] == -1 and st.position[1:].tolist() == [40, 41] and st.stream[1:].tolist() == [3, 0]
    assert st.prompt_mask[1].nonzero().flatten().tolist() == [4] and not st.prompt_mask[2].any()
    assert st.output_counts[1, 9] == 2 and st.output_counts[2, 8] == 1 and st.output_len[1:].tolist() == [2, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU runs the same bookkeeping above)")
def test_cuda_traced_steps_equal_eager_steps():
    """On CUDA: traced steps (captured, or eager where capture is impossible) give the eager tokens."""
    params = BatchSamplingParams.from_requests([SP(temperature=0.8, seed=1, top_k=5), SP(temperature=0.0),
                                                SP(temperature=1.1, seed=3, presence_penalty=0.5)])
    gens = [SamplingGenerator(V, max_batch_size=4, device="cuda") for _ in range(2)]
    for gen in gens:
        gen.apply_prefill_state(sampling_params=params, prompt_tokens=[[1, 2], [3, -1], [4, 5]], empty_slots=[0, 1, 2])
    buffer = torch.empty(4, V, device="cuda")
    rng = torch.Generator().manual_seed(0)
    for _ in range(6):
        logits = torch.randn(4, V, generator=rng).cuda()
        buffer.copy_(logits)
        traced = gens[0].sample(buffer, enable_trace=True)[0].clone()
        eager = gens[1].sample(logits)[0]
        assert torch.equal(traced, eager)
    check_slot_state(gens[0].sampler)
    assert gens[0].trace_captures == 1

