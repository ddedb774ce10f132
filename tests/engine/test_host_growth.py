"""Host work of the generator's slot operations grows with what they touch, never with its square.

Admitting k requests, a remap that moves m slots and a step (or a plan) of B rows are measured by
the number of Python function calls `cProfile` counts (every Python call, every builtin call and
every resumption of a generator): deterministic, unlike a timing on a shared machine. Growing what
is touched 4x must grow the count less than 6x (a scan of every lane per touched lane grows it about
16x); touching the same few slots of 4x as many lanes must grow it less than 1.2x (nothing reads
every lane for them).
"""

from __future__ import annotations

import cProfile
import pstats
from typing import Callable

import pytest
import torch

from tokensampler import InvalidSamplingParams, InvalidSlotRemap, SamplingParams
from tokensampler.engine.batch_params import BatchSamplingParams, format_requests, format_sampling_params
from tokensampler.engine.generator import SamplingGenerator
from tokensampler.engine.seeds import check_slot_remap

V = 64
K = 256  # the smaller size: 4K lanes are admitted at once in the larger one
FEW = 4


def host_calls(fn: Callable[[], object]) -> int:
    """The number of function calls `cProfile` counts while `fn()` runs."""
    profile = cProfile.Profile()
    profile.enable()
    try:
        fn()
    finally:
        profile.disable()
    return pstats.Stats(profile).total_calls


def requests(k: int, offset: int = 0) -> BatchSamplingParams:
    """k lanes, every field a list, with per-lane sequences and mappings (seeded: no draw)."""
    return BatchSamplingParams.from_requests([
        SamplingParams(temperature=0.0 if i % 5 == 0 else 0.8, top_p=0.9, seed=offset + i, stop_token_ids=(5,),
                       min_tokens=i % 3, logit_bias={3: 1.0} if i % 2 else None,
                       allowed_token_ids=tuple(range(40)) if i % 7 == 0 else None)
        for i in range(k)])


def generator(lanes: int) -> SamplingGenerator:
    return SamplingGenerator(V, max_batch_size=lanes, device="cpu", warmup=False, compile=False)


def admit(gen: SamplingGenerator, slots: list[int], offset: int = 0) -> Callable[[], object]:
    k = len(slots)
    batch = requests(k, offset)
    prompts = torch.arange(4 * k).remainder(V).reshape(k, 4)
    return lambda: gen.apply_prefill_state(sampling_params=batch, prompt_tokens=prompts, empty_slots=slots)


def full(lanes: int) -> SamplingGenerator:
    """A generator whose every lane holds a request (its first admission: lazy set-up done)."""
    gen = generator(lanes)
    admit(gen, list(range(lanes)))()
    return gen


def admission_calls(k: int, lanes: int) -> int:
    """Admitting k requests (replacing what the last k slots held) into `lanes` full lanes."""
    gen = full(lanes)
    return host_calls(admit(gen, list(range(lanes - k, lanes)), offset=10_000))


def remap_calls(moved: int, lanes: int) -> int:
    """A device-mode remap of `lanes` slots that moves `moved` of them (pairs swapped)."""
    gen = full(lanes)
    remap = list(range(lanes))
    for i in range(0, moved, 2):
        remap[i], remap[i + 1] = remap[i + 1], remap[i]
    return host_calls(lambda: gen.apply_decode_state(BatchSamplingParams(), reload_sampling_params=False,
                                                     reset_sampling_state=False, slot_remap=remap))


def step_calls(rows: int, lanes: int) -> int:
    """`sample` of the first `rows` slots of `lanes` full lanes (after one untimed step)."""
    gen = full(lanes)
    logits = torch.randn(rows, V)
    gen.sample(logits)
    return host_calls(lambda: gen.sample(logits))


def test_admitting_4x_the_requests_into_4x_the_lanes_costs_less_than_6x():
    small, large = admission_calls(K, K), admission_calls(4 * K, 4 * K)
    assert large < 6 * small, (small, large)


def test_formatting_4x_the_lanes_costs_less_than_6x():
    small, large = requests(K), requests(4 * K)
    counts = [host_calls(lambda b=b, n=n: format_sampling_params(b, n, vocab_size=V))
              for b, n in ((small, K), (large, 4 * K))]
    assert counts[1] < 6 * counts[0], counts


def test_admitting_a_few_requests_costs_the_same_in_4x_the_lanes():
    small, large = admission_calls(FEW, K), admission_calls(FEW, 4 * K)
    assert large < 1.2 * small, (small, large)


@pytest.mark.parametrize("lanes", [K, 4 * K])
def test_a_remap_of_4x_the_slots_costs_less_than_6x(lanes):
    small, large = remap_calls(FEW, lanes), remap_calls(4 * FEW, lanes)
    assert large < 6 * small, (small, large)


def test_a_remap_of_a_few_slots_costs_the_same_in_4x_the_lanes():
    small, large = remap_calls(FEW, K), remap_calls(FEW, 4 * K)
    assert large < 1.2 * small, (small, large)


def test_a_step_and_a_plan_of_4x_the_rows_cost_less_than_6x():
    small, large = step_calls(K, K), step_calls(4 * K, 4 * K)
    assert large < 6 * small, (small, large)
    gen = full(4 * K)
    plans = [host_calls(lambda b=b: gen.sampler.plan_rows(b)) for b in (K, 4 * K)]
    assert plans[1] < 6 * plans[0], plans


def test_a_step_of_a_few_rows_costs_the_same_in_4x_the_lanes():
    small, large = step_calls(FEW, K), step_calls(FEW, 4 * K)
    assert large < 1.2 * small, (small, large)


def test_format_requests_is_format_then_to_requests_with_the_same_errors():
    batch = BatchSamplingParams(temperature=[0.0, 0.7, None], top_k=[-1, 5, 200], top_p=[1.5, 0.3, None],
                                stop=[["a"], None, ("b", "c")], stop_token_ids=[[1], None, (2, 3)],
                                bad_words_token_ids=[[[4, 5]], None, []], logit_bias=[{1: 0.5}, None, {}])
    for lanes in (3, 5):
        want = format_sampling_params(batch, lanes, vocab_size=V).to_requests()
        assert format_requests(batch, lanes, vocab_size=V) == want
    bad_batches = [(dict(top_p=[0.5, 0.0]), 2), (dict(temperature=[1.0] * 3), 2), (dict(temperature=[1.0, "hot"]), 2),
                   (dict(top_k=[1, 2]), 0), (dict(stop_token_ids={1, 2}), 2), (dict(allowed_token_ids=range(3)), 2),
                   (dict(stop_token_ids=[{1}, {2}]), 2), (dict(stop_token_ids=lambda: (t for t in [1])), 2),
                   (dict(bad_words_token_ids=[range(2), None]), 2)]
    for fields, lanes in bad_batches:
        errors = []
        for fn in (lambda b: format_sampling_params(b, lanes).to_requests(), lambda b: format_requests(b, lanes)):
            bad = BatchSamplingParams(**{k: v() if callable(v) else v for k, v in fields.items()})
            with pytest.raises(InvalidSamplingParams) as err:
                fn(bad)
            errors.append((type(err.value), str(err.value).split(" at 0x")[0]))
        assert errors[0] == errors[1], fields


@pytest.mark.parametrize("remap, message", [
    ([0, 0, 1], "slot_remap=[0, 0, 1] is invalid: allowed distinct old slots (taken twice: [0])"),
    ([2, 2, 0, 0, 4], "slot_remap=[2, 2, 0, 0, 4] is invalid: allowed distinct old slots (taken twice: [0, 2])"),
    ([0, 1, 5, 3, 4], "slot_remap[2]=5 is invalid: allowed an old slot in [0, 5)"),
    ([True, 0, 2, 3, 4], "slot_remap[0]=True is invalid: allowed an old slot in [0, 5)"),
])
def test_a_bad_remap_is_named_as_before(remap, message):
    with pytest.raises(InvalidSlotRemap) as err:
        check_slot_remap(remap, len(remap))
    assert str(err.value) == message
