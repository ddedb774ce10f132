"""A burst of admissions: lanes that differ only in their seeds are formatted and validated once,
the parameter columns of many slots are written at once, and a run of consecutive slots is cleared
as one block; each gives exactly what lane-by-lane, slot-by-slot work gives."""

from __future__ import annotations

import math

import pytest
import torch

from tokensampler import InvalidSamplingParams, SamplingParams
from tokensampler.engine import batch_params
from tokensampler.engine.batch_params import FIELDS, BatchSamplingParams, format_requests, format_sampling_params
from tokensampler.sampler.sampler import Sampler
from tokensampler.state.row_fill import consecutive_runs

V = 64


def typed(params: SamplingParams) -> tuple:
    """Every field with its exact type (1 == 1.0 == True, and tuples compare alike)."""
    def exact(value):
        if isinstance(value, (tuple, list)):
            return type(value), tuple(exact(v) for v in value)
        if value is not None and hasattr(value, "items"):
            return "mapping", tuple(sorted((exact(k), exact(v)) for k, v in value.items()))
        return type(value), value
    return tuple(exact(getattr(params, name)) for name in FIELDS)


def alone(lane: dict) -> SamplingParams:
    """One lane formatted and validated with nothing cached."""
    batch_params._LANE_CACHE.clear()
    return format_requests(BatchSamplingParams(**{k: [v] for k, v in lane.items()}), 1, vocab_size=V)[0]


LANES = [  # each a lane's raw fields; look-alikes follow each other (the second would hit the first's key)
    dict(temperature=0.8, top_k=50, top_p=0.95, seed=1),
    dict(temperature=0.8, top_k=50, top_p=0.95, seed=2),
    dict(temperature=0.8, top_k=50, top_p=0.95, seed=-1),
    dict(temperature=0.8, top_k=50, top_p=0.95, seed=None),
    dict(temperature=1, top_k=50, top_p=1, seed=3),
    dict(temperature=1.0, top_k=50, top_p=1.0, seed=3),
    dict(temperature=0, top_k=7, top_p=0.5, min_p=0.2, seed=4),  # greedy: top_k, top_p, min_p reset
    dict(temperature=0.7, top_k=-1, seed=5),
    dict(temperature=0.7, top_k=V + 3, seed=6),  # k >= V: off
    dict(temperature=0.7, stop_token_ids=[5, 6], min_tokens=2, seed=7),
    dict(temperature=0.7, stop_token_ids=(5, 6), min_tokens=2, seed=8),
    dict(temperature=0.7, logit_bias={3: 1.0, 4: -200}, seed=9),
    dict(temperature=0.7, logit_bias={3: 1.0, 4: -200}, seed=10),
    dict(temperature=0.7, logit_bias={}, seed=11),
    dict(temperature=0.7, allowed_token_ids=[1, 2, 3], seed=12),
    dict(temperature=0.7, bad_words_token_ids=[[1, 2], [3]], seed=13),
    dict(temperature=0.7, bad_words_token_ids=[[1, 2], [3]], seed=14),
    dict(temperature=0.7, stop=("end", "stop"), seed=15),
    dict(temperature=0.7, stop=["end"], seed=16),
    dict(temperature=0.7, dry_multiplier=0.8, dry_sequence_breakers=[[1], [2, 3]], seed=17),
    dict(temperature=0.7, mirostat_tau=5.0, seed=2**64 - 1),
    dict(temperature=0.7, mirostat_tau=5.0, seed=-(2**63)),
    dict(temperature=0.7, presence_penalty=3.0, frequency_penalty=-9, seed=18),  # clamped
]


def burst(lanes: list[dict]) -> BatchSamplingParams:
    return BatchSamplingParams(**{name: [lane.get(name) for lane in lanes] for name in FIELDS})


def test_a_burst_gives_each_lane_what_it_gives_alone():
    expected = [alone(lane) for lane in LANES]
    batch_params._LANE_CACHE.clear()
    for repeat in range(2):  # the second pass: every lane's key is cached
        got = format_requests(burst(LANES), len(LANES), vocab_size=V)
        assert [typed(p) for p in got] == [typed(p) for p in expected], repeat
    assert got[2].seed is None and got[3].seed is None and got[20].seed == 2**64 - 1


@pytest.mark.parametrize("valid, invalid, field", [
    (dict(top_k=1), dict(top_k=True), "top_k"),
    (dict(temperature=1.0), dict(temperature=True), "temperature"),
    (dict(stop_token_ids=[1]), dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(allowed_token_ids=None), dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words_token_ids=[[1, 2]]), dict(bad_words_token_ids=[[1, True]]), "bad_words_token_ids"),
    (dict(logit_bias={1: 1.0}), dict(logit_bias={1: True}), "logit_bias[1]"),
    (dict(logit_bias={1: 1.0}), dict(logit_bias={1: math.nan}), "logit_bias[1]"),
    (dict(stop=["a"]), dict(stop=[""]), "stop"),
    (dict(seed=1), dict(seed=2**64), "seed"),
    (dict(seed=1), dict(seed=1.0), "seed"),
    (dict(seed=1), dict(seed=math.nan), "seed"),
])
def test_a_bad_lane_after_its_look_alike_is_still_refused(valid, invalid, field):
    lanes = [{"temperature": 0.7, **valid}, {"temperature": 0.7, **invalid}]
    batch_params._LANE_CACHE.clear()
    format_requests(burst(lanes[:1]), 1, vocab_size=V)  # the valid lane's key cached
    with pytest.raises(InvalidSamplingParams) as error:
        format_requests(burst(lanes), 2, vocab_size=V)
    assert error.value.field == field


def test_lanes_of_one_key_do_not_share_a_logit_bias_dict():
    lanes = [dict(temperature=0.7, logit_bias={3: 1.0}, seed=s) for s in range(3)]
    formatted = format_sampling_params(burst(lanes), 3, vocab_size=V)
    formatted.logit_bias[0][3] = 50.0
    assert formatted.logit_bias[1] == {3: 1.0} and formatted.logit_bias[2] == {3: 1.0}


MIXED = [  # one request of each kind of column, then plain ones
    SamplingParams(temperature=0.7, logit_bias={3: 2.0, 60: -1.0}, seed=1),
    SamplingParams(temperature=0.7, allowed_token_ids=(1, 2, 3), seed=2),
    SamplingParams(temperature=0.7, min_tokens=3, stop_token_ids=(9,), seed=3),
    SamplingParams(temperature=0.7, bad_words_token_ids=((4, 5, 6), (7,)), seed=4),
    SamplingParams(temperature=0.7, dry_multiplier=0.8, dry_penalty_last_n=16, seed=5),
    SamplingParams(temperature=0.7, mirostat_tau=4.0, mirostat_eta=0.2, seed=6),
    SamplingParams(temperature=0.0, top_k=5, seed=7),
    SamplingParams(temperature=0.9, top_k=2**70, min_tokens=2**70, max_tokens=None, top_p=0.9, seed=8),
]


def admitted(order: list[int]) -> Sampler:
    """Slot i holds MIXED[order[i]], written after every dense column was allocated (by MIXED in the
    slots after them): its rows owe nothing to an earlier request of the slot."""
    n = len(MIXED)
    sampler = Sampler(V, max_slots=2 * n, backend="torch", eos_token_ids=(0,))
    for i, request in enumerate(MIXED):
        sampler.add_request(n + i, request, [1, 2, 3])
    for slot, i in enumerate(order):
        sampler.add_request(slot, MIXED[i], [1, 2, 3])
    return sampler


def state_tensors(sampler: Sampler) -> list[torch.Tensor]:
    return [t.clone() for t in sampler.state.slot_tensors()]


def param_rows(sampler: Sampler) -> list[torch.Tensor]:
    """The rows of slots 0..7 of every slot tensor but the seeds (a slot keeps its seed when its
    parameters change)."""
    return [t[:len(MIXED)].clone() for t in sampler.state.slot_tensors() if t is not sampler.state.seed]


@pytest.mark.parametrize("shift", [1, 3])
def test_writing_many_slots_at_once_equals_admitting_them_afresh(shift):
    order = list(range(len(MIXED)))
    new_order = [(i + shift) % len(MIXED) for i in order]  # every slot takes another kind of request
    new = [MIXED[i] for i in new_order]
    slots = [5, 0, 7, 2, 1, 6, 3, 4]
    at_once, one_by_one, fresh = admitted(order), admitted(order), admitted(new_order)
    at_once.set_params(slots, [new[s] for s in slots])
    for slot in slots:
        one_by_one.set_params([slot], [new[slot]])
    for a, b, c in zip(param_rows(at_once), param_rows(one_by_one), param_rows(fresh), strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)
    assert [at_once.params_of(s) for s in order] == new


def test_setting_params_is_checked_before_any_slot_changes():
    sampler = admitted(list(range(len(MIXED))))
    before = state_tensors(sampler)
    for slots, params in (([0, 1], [MIXED[1]]), ([0, 0], [MIXED[1], MIXED[2]]),
                          ([0, 1], [MIXED[1], SamplingParams(allowed_token_ids=(V,))]),
                          ([0, 1], [MIXED[1], "top_k=3"])):
        with pytest.raises(InvalidSamplingParams):
            sampler.set_params(slots, params)
    for a, b in zip(state_tensors(sampler), before, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("runs", [[(0, 3), (5, 6), (9, 12)], [(2 * i, 2 * i + 1) for i in range(20)]])
def test_rebuilding_the_history_of_runs_of_slots_clears_exactly_their_rows(runs):
    slots = [s for start, stop in runs for s in range(start, stop)]
    assert consecutive_runs(slots) == runs
    sampler = Sampler(V, max_slots=48, backend="torch")
    for slot in range(48):
        sampler.add_request(slot, SamplingParams(seed=slot), [slot % V, (slot + 1) % V],
                            output_token_ids=[(slot + 2) % V] * 3)
    mask, counts = sampler.state.prompt_mask.clone(), sampler.state.output_counts.clone()
    prompts = torch.full((len(slots), 2), -1, dtype=torch.int64)
    prompts[:, 0] = 40
    sampler.reset_history(slots, prompts, None)
    mask[slots] = False
    mask[slots, 40] = True
    counts[slots] = 0
    assert torch.equal(sampler.state.prompt_mask, mask)
    assert torch.equal(sampler.state.output_counts, counts)


@pytest.mark.parametrize("threaded_fill_bytes, fill_threads", [(0, 2), (2**40, 1)])
def test_an_admission_runs_its_small_operations_on_one_thread_and_its_large_row_fills_on_the_callers(
        monkeypatch, threaded_fill_bytes, fill_threads):
    from tokensampler.engine.generator import SamplingGenerator
    from tokensampler.state import row_fill
    from tokensampler.state import slots as slots_module

    seen: dict[str, list[int]] = {"write_params": [], "fill": []}
    write_params, runs = slots_module.SamplerState.write_params, row_fill.consecutive_runs

    def recording_write(self, *args, **kwargs):
        seen["write_params"].append(torch.get_num_threads())
        return write_params(self, *args, **kwargs)

    def recording_runs(slot_list):
        seen["fill"].append(torch.get_num_threads())
        return runs(slot_list)

    monkeypatch.setattr(slots_module.SamplerState, "write_params", recording_write)
    monkeypatch.setattr(row_fill, "consecutive_runs", recording_runs)
    monkeypatch.setattr(row_fill, "THREADED_FILL_BYTES", threaded_fill_bytes)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = SamplingGenerator(V, max_batch_size=4, device="cpu", warmup=False, compile=False)
        seen["write_params"].clear()
        gen.apply_prefill_state(sampling_params=burst([dict(seed=i) for i in range(3)]),
                                prompt_tokens=torch.tensor([[1, 2], [3, -1], [4, 5]]), empty_slots=[0, 1, 3])
        assert torch.get_num_threads() == 2
        with pytest.raises(InvalidSamplingParams):  # restored after a refusal too
            gen.apply_prefill_state(sampling_params=burst([dict(seed=1)]), prompt_tokens=torch.tensor([[V]]),
                                    empty_slots=[2])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert seen["write_params"] == [1] and seen["fill"] and set(seen["fill"]) == {fill_threads}, seen


def test_single_threaded_restores_the_count_and_caller_threads_gives_it_back_inside():
    from tokensampler.core.threads import caller_threads, single_threaded

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with caller_threads():  # outside single_threaded: no change
            assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError):
            with single_threaded():
                assert torch.get_num_threads() == 1
                with caller_threads():
                    assert torch.get_num_threads() == 2
                assert torch.get_num_threads() == 1
                raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_a_lane_with_a_long_container_is_built_by_itself_and_not_kept():
    batch_params._LANE_CACHE.clear()
    long_allowed = list(range(batch_params._KEY_ENTRIES + 1))
    lanes = [dict(temperature=0.7, allowed_token_ids=long_allowed, seed=s) for s in range(3)]
    got = format_requests(burst(lanes), 3, vocab_size=1000)
    assert [p.allowed_token_ids for p in got] == [tuple(long_allowed)] * 3 and [p.seed for p in got] == [0, 1, 2]
    assert not batch_params._LANE_CACHE
    format_requests(burst([dict(temperature=0.7, allowed_token_ids=long_allowed[:-1], seed=1)]), 1, vocab_size=1000)
    assert len(batch_params._LANE_CACHE) == 1


def test_an_engine_that_forbids_thread_changes_keeps_its_count(monkeypatch):
    """vLLM's CPU worker replaces `torch.set_num_threads` by a no-op that warns: admissions must not call it."""
    from tokensampler.core.threads import caller_threads, single_threaded, thread_count_owned
    from tokensampler.engine.generator import SamplingGenerator

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    assert not thread_count_owned()
    threads = torch.get_num_threads()
    with single_threaded():
        assert torch.get_num_threads() == threads
        with caller_threads():
            assert torch.get_num_threads() == threads
    gen = SamplingGenerator(V, max_batch_size=2, device="cpu", warmup=False, compile=False)
    gen.apply_prefill_state(sampling_params=burst([dict(seed=1), dict(seed=2)]),
                            prompt_tokens=torch.tensor([[1, 2], [3, 4]]), empty_slots=[0, 1])
    assert calls == [] and torch.get_num_threads() == threads


def test_a_single_threaded_block_is_its_python_threads_own():
    """torch's count is per thread (OpenMP): a block open in another thread changes neither this
    thread's count nor what `caller_threads` does here."""
    import threading

    from tokensampler.core.threads import caller_threads, single_threaded

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        entered, leave = threading.Event(), threading.Event()
        seen = []

        def block():
            with single_threaded():
                seen.append(torch.get_num_threads())
                entered.set()
                leave.wait(timeout=10)
                with caller_threads():
                    seen.append(torch.get_num_threads())
            seen.append(torch.get_num_threads())

        other = threading.Thread(target=block)
        other.start()
        assert entered.wait(timeout=10)
        assert torch.get_num_threads() == 2  # this thread's own count
        torch.set_num_threads(3)
        with caller_threads():  # not inside a block of this thread: no change
            assert torch.get_num_threads() == 3
        torch.set_num_threads(2)
        leave.set()
        other.join(timeout=10)
        assert seen == [1, 2, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
