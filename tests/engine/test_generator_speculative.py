"""`SamplingGenerator.sample_speculative`: the decode contract of `sample`, one position per emitted
token (active slots only), equal to `sample` stepped one position at a time; `SeedManager.advance`."""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.slot_state import check_slot_state
from tokensampler import InvalidSamplingParams, SamplingParams, SeedManager, StaleSamplingState
from tokensampler.engine.batch_params import BatchSamplingParams
from tokensampler.engine.generator import SamplingGenerator

V = 48
SP = SamplingParams
PARAMS = [
    SP(temperature=0.8, seed=11, repetition_penalty=1.3),
    SP(temperature=1.2, top_k=7, frequency_penalty=0.7, seed=3),
    SP(temperature=0.0, presence_penalty=1.5, seed=5),
    SP(temperature=0.9, top_p=0.8, min_p=0.05, seed=2**64 - 5, logprobs=2),
]


def admitted(max_batch_size: int = 5) -> SamplingGenerator:
    gen = SamplingGenerator(V, max_batch_size=max_batch_size, device="cpu")
    gen.apply_prefill_state(sampling_params=BatchSamplingParams.from_requests(PARAMS),
                            prompt_tokens=[[1, 2, -1, -1], [3, 3, 4, -1], [5, -1, -1, -1], [6, 7, 8, 9]],
                            empty_slots=[0, 1, 2, 3])
    return gen


def snapshot(gen: SamplingGenerator) -> tuple:
    """The host noise coordinates and every device column of the admitted slots 0-3 (the empty
    lane 4 holds the neutral row, with a seed drawn at construction)."""
    st = gen.sampler.state
    sm = gen.seed_manager
    return (list(sm.seeds), list(sm.positions), list(sm.streams)), [t[:4].clone() for t in st.slot_tensors()]


def same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def logits_for(batch: int, positions: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, positions, V, generator=torch.Generator().manual_seed(seed)) * 2


def stepped_drafts(gen: SamplingGenerator, logits: torch.Tensor, active: list[int], cuts: dict[int, int],
                   rnd: random.Random) -> tuple[torch.Tensor, dict[int, list[int]]]:
    """`gen.sample` one position at a time (the expected output): drafts right up to each cut."""
    batch, positions = logits.shape[:2]
    drafts = torch.full((batch, positions - 1), -1, dtype=torch.int64)
    emitted: dict[int, list[int]] = {s: [] for s in active}
    alive = list(active)
    for j in range(positions):
        if not alive:
            break
        tokens, _ = gen.sample(logits[:, j].contiguous(), active_slots=alive)
        survivors = []
        for s in alive:
            t = int(tokens[s])
            emitted[s].append(t)
            if j < positions - 1:
                if j < cuts[s]:
                    drafts[s, j] = t
                    survivors.append(s)
                else:
                    drafts[s, j] = rnd.choice([-1, (t + 1) % V])
        alive = survivors
    return drafts, emitted


@pytest.mark.parametrize("seed", range(4))
def test_speculative_equals_sample_stepped_and_advances_once_per_token(seed):
    rnd = random.Random(seed)
    k = rnd.choice([1, 3, 4])
    plain, spec = admitted(), admitted()
    active = rnd.sample([0, 1, 2, 3], rnd.randint(1, 4))
    logits = logits_for(5, k + 1, seed)
    cuts = {s: rnd.randint(0, k) for s in active}
    drafts, want = stepped_drafts(plain, logits, active, cuts, rnd)
    untouched = [s for s in range(4) if s not in active]
    before = {s: spec.position_of(s) for s in range(4)}
    out = spec.sample_speculative(logits, drafts, active_slots=active)
    for s in active:
        n = int(out.num_emitted[s])
        assert out.token_ids[s, :n].tolist() == want[s]
        assert spec.position_of(s) == before[s] + n == plain.position_of(s)
    for s in untouched:
        assert spec.position_of(s) == before[s]  # verified, not counted
        assert int(out.num_emitted[s]) >= 1 and bool((out.token_ids[s, :int(out.num_emitted[s])] >= 0).all())
    assert same(snapshot(spec), snapshot(plain))
    check_slot_state(spec.sampler)
    assert spec.last_speculative is out


def test_rejection_mode_through_the_generator_advances_host_and_device_together():
    gen = admitted()
    logits = logits_for(5, 4, 7)
    drafts = torch.randint(0, V, (5, 3), generator=torch.Generator().manual_seed(1))
    probs = torch.softmax(torch.randn(5, 3, V, generator=torch.Generator().manual_seed(2)), dim=-1)
    before = [gen.position_of(s) for s in range(4)]
    out = gen.sample_speculative(logits, drafts, draft_probs=probs)
    assert [gen.position_of(s) for s in range(4)] == [before[s] + int(out.num_emitted[s]) for s in range(4)]
    check_slot_state(gen.sampler)
    assert bool((gen.sampler.state.position[4] == 0).all())  # the empty lane is never counted


def test_stale_slots_and_bad_input_change_nothing():
    gen = admitted()
    logits = logits_for(5, 3, 1)
    drafts = torch.zeros(5, 2, dtype=torch.int64)
    state = snapshot(gen)
    for bad in (dict(target_logits=logits[:, 0]), dict(target_logits=torch.randn(6, 3, V)),
                dict(draft_token_ids=torch.full((5, 2), V)), dict(active_slots=[4]),
                dict(draft_token_ids=drafts[:, :1]), dict(mode="nope")):
        kwargs = {"target_logits": logits, "draft_token_ids": drafts, **bad}
        with pytest.raises(InvalidSamplingParams):
            gen.sample_speculative(kwargs.pop("target_logits"), kwargs.pop("draft_token_ids"), **kwargs)
        assert same(snapshot(gen), state)
    gen.apply_decode_state([BatchSamplingParams.from_requests(PARAMS)], reload_sampling_params=False,
                           reset_sampling_state=False, sampling_mode="host")
    state = snapshot(gen)
    with pytest.raises(StaleSamplingState):
        gen.sample_speculative(logits, drafts)
    assert same(snapshot(gen), state)


def test_seed_manager_advance_equals_repeated_get_new_values():
    a, b = SeedManager(3), SeedManager(3)
    for sm in (a, b):
        sm.reset_seed([5, 6, None], [0, 1, 2])
        sm.align_seed_counters_to_positions([0, 1, 2], [10, 20, 30])
    a.advance([0, 2], [3, 1])
    for _ in range(3):
        b.get_new_values([0])
    b.get_new_values([2])
    assert a.positions == b.positions == [13, 20, 31]
    for slots, counts in (([0], [1, 2]), ([0], [-1]), ([0, 0], [1, 1]), ([0], [2**32])):
        with pytest.raises(InvalidSamplingParams):
            a.advance(slots, counts)
    assert a.positions == [13, 20, 31]
