"""A `SamplingGenerator` over a vocabulary split (`group=`): the same tokens and log-probs as the
unsplit generator at every step of an engine schedule, on every rank, and errors on every rank.

The schedule (tests/support/engine_split_cases.py) runs admissions, partial prefills (also while other
slots are stale), device and host remaps, host decodes, rebuilds, parameter changes and traced
steps; `support.engine.Engine` also checks each token against a fresh unsplit `Sampler`. Two
transports: threads of this process (ThreadExchange) and forked gloo process groups of 2 and 3 ranks.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

import tests.support.engine_split_cases as gc
import tests.support.split_cases as dc
from tests.support.slot_state import check_slot_state
from tokensampler import (
    InvalidSamplingParams,
    InvalidSlotRemap,
    Sampler,
    SamplingGenerator,
    SamplingParams,
    SplitMismatch,
    TraceMismatch,
)
from tokensampler.engine.batch_params import BatchSamplingParams

COVERED = ("device_remap", "host_remap", "host_decode", "rebuild", "partial_prefill", "partial_prefill_while_stale",
           "traced", "refused", "retune", "finish")


# ------------------------------------------------------------------ the schedule, threads
@pytest.mark.parametrize(("world", "seed"), [(2, 45), (2, 7), (3, 43), (3, 8)])
def test_split_generator_equals_unsplit_generator_threads(world, seed):
    (vocab, padded, mode), = gc.CONFIGS[world]
    results = dc.run_threads(world, lambda ex: gc.check_schedule(ex, ex.rank, world, vocab, padded, mode, seed, 70))
    failures = [line for bad, _, _ in results for line in bad]
    assert not failures, "\n".join(failures[:10])
    tokens = [t for _, t, _ in results]
    assert all(t == tokens[0] for t in tokens) and len(tokens[0]) >= 30  # every rank, every device step
    counts = results[0][2]
    missing = [name for name in COVERED if not counts.get(name)]
    assert not missing, (missing, counts)


# ------------------------------------------------------------------ the Sampler's slot-state methods
def test_split_slot_state_methods_equal_unsplit_and_keep_each_rank_slice():
    """record mask, set_params, set_noise and reset_history on a split Sampler (padding spanning two
    ranks, ids at rank edges): the same outputs as the unsplit Sampler, and the slices of the
    penalty state put together are the unsplit state."""
    vocab, padded, world = 30, 48, 3  # width 16: rank 1 holds ids 16..29 + 2 padding, rank 2 only padding
    edges = [0, 15, 16, 29]
    first = [SamplingParams(seed=1, temperature=0.9, frequency_penalty=0.7, presence_penalty=0.3, logprobs=3),
             SamplingParams(seed=2, temperature=0.0, repetition_penalty=1.5),
             SamplingParams(seed=3, top_k=4, logit_bias={15: 3.0}, logprobs=2)]
    later = [SamplingParams(seed=1, temperature=1.2, logit_bias={16: 5.0, 29: -100.0, 15: 2.0}, logprobs=5,
                            repetition_penalty=1.3),
             SamplingParams(seed=9, allowed_token_ids=(0, 15, 16, 29), top_p=0.7, min_tokens=4,
                            stop_token_ids=(16,)),
             SamplingParams(seed=3, min_tokens=2, stop_token_ids=(15, 29), top_k=2, presence_penalty=2.0)]
    gen = torch.Generator().manual_seed(8)
    steps = [torch.randn(3, padded, generator=gen) * 2 for _ in range(5)]
    for logits in steps:
        logits[:, edges] += 3.0  # the edge ids are in play
        logits[:, 16] += 4.0     # a stop id that wins unless min_tokens removes it

    def drive(sampler: Sampler, rank: int, world_size: int):
        width = padded // world_size
        part = lambda t: steps[t][:, rank * width:(rank + 1) * width]
        for slot, params in enumerate(first):
            sampler.add_request(slot, params, [0, 15, 16])
        outs = [sampler.sample(part(0), record=torch.tensor([True, False, True]))]
        outs.append(sampler.sample(part(1)))
        for slot, params in enumerate(later):
            sampler.set_params([slot], [params])
        sampler.set_noise([2, 0], [2**64 - 5, 11], [7, 3], [1, 0])
        sampler.reset_history([0, 1], torch.tensor([[15, 16, -1], [29, 0, 29]]),
                              torch.tensor([[16, 16, 15, -1], [-1, 29, -1, -1]]))
        outs += [sampler.sample(part(t), record=torch.tensor([t != 3, True, t != 2])) for t in (2, 3, 4)]
        st = sampler.state
        state = (st.prompt_mask.clone(), st.output_counts.clone(), st.output_len.clone(), st.position.clone())
        return outs, state

    want, whole = drive(Sampler(vocab, max_slots=3, padded_vocab_size=padded, eos_token_ids=(1,),
                                logprobs_mode="processed_logprobs"), 0, 1)
    results = dc.run_threads(world, lambda ex: drive(Sampler(vocab, max_slots=3, padded_vocab_size=padded,
                                                             eos_token_ids=(1,), logprobs_mode="processed_logprobs",
                                                             group=ex), ex.rank, world))
    assert whole[2].tolist() == [5, 4, 4] and whole[3].tolist() == [5, 7, 9]  # the record mask and set_noise
    assert want[4].token_ids[1] != 16 and want[3].token_ids[1] != 16  # min_tokens of the new params
    for rank, (outs, state) in enumerate(results):
        for t, (got, expected) in enumerate(zip(outs, want, strict=True)):
            assert not dc.compare(f"rank {rank} step {t}", got, expected)
        assert torch.equal(state[2], whole[2]) and torch.equal(state[3], whole[3])  # replicated columns
    prompt = torch.cat([state[0] for _, state in results], dim=1)
    counts = torch.cat([state[1] for _, state in results], dim=1)
    assert torch.equal(prompt[:, :vocab], whole[0]) and not prompt[:, vocab:].any()
    assert torch.equal(counts[:, :vocab], whole[1]) and not counts[:, vocab:].any()


# ------------------------------------------------------------------ errors on every rank
def _raises(fn, error, field):
    try:
        fn()
    except error as exc:
        assert field is None or exc.field == field, (exc.field, field)
        return exc
    raise AssertionError(f"expected {error.__name__}")


def _split_generator_errors(ex):
    """Each bad call raises on every rank (its own error on the rank that failed, SplitMismatch on
    the others) and changes nothing: the following steps equal an unsplit generator's."""
    vocab, padded = 61, 64
    width = padded // ex.world_size
    last = ex.rank == ex.world_size - 1
    gens = [SamplingGenerator(vocab, max_batch_size=4, padded_vocab_size=padded, device="cpu", group=group,
                              seed_source=gc.seeded_source(5), logprobs_mode="processed_logprobs")
            for group in (ex, None)]
    params = BatchSamplingParams.from_requests([SamplingParams(temperature=0.8, top_k=5, logprobs=2),
                                                SamplingParams(seed=4, presence_penalty=1.0, logit_bias={31: 2.0,
                                                                                                         32: 3.0})])
    prompts = torch.tensor([[31, 32, 5], [60, -1, -1]])
    for gen in gens:
        assert gen.apply_prefill_state(sampling_params=params, prompt_tokens=prompts, empty_slots=[0, 2])[0] \
            == gc.seeded_source(5)()
    split, whole = gens
    sampler = split.sampler
    other = "group"
    buffer = torch.randn(4, padded, generator=torch.Generator().manual_seed(2))
    bound = buffer[:, ex.rank * width:(ex.rank + 1) * width]  # the tensor a traced step is bound to
    assert torch.equal(split.sample(bound, enable_trace=True)[0], whole.sample(buffer)[0])
    checks = [
        ("remap of a wrong length on one rank", lambda: split.apply_decode_state(
            params, reload_sampling_params=False, reset_sampling_state=False,
            slot_remap=[0, 1, 2] if last else [0, 1, 2, 3]), InvalidSlotRemap if last else SplitMismatch,
         "slot_remap" if last else other),
        ("ranks' remaps differ", lambda: split.apply_decode_state(
            params, reload_sampling_params=False, reset_sampling_state=False,
            slot_remap=[1, 0, 2, 3] if last else [0, 1, 3, 2]), SplitMismatch, "apply_decode_state"),
        ("ranks' modes differ", lambda: split.apply_decode_state(
            params, reload_sampling_params=False, reset_sampling_state=False,
            sampling_mode="host" if last else "device"), SplitMismatch, "apply_decode_state"),
        ("an empty active slot on one rank", lambda: split.sample(
            torch.zeros(4, width), active_slots=[0, 1] if last else [0, 2]), InvalidSamplingParams,
         "active_slots" if last else other),
        ("a traced step with another logits tensor on one rank", lambda: split.sample(
            bound.clone() if last else bound, enable_trace=True), TraceMismatch if last else SplitMismatch,
         "logits" if last else other),
        ("prefill prompts differ", lambda: split.apply_prefill_state(
            sampling_params=params, prompt_tokens=torch.where(prompts >= 0, (prompts + int(last)) % vocab, prompts),
            empty_slots=[1, 3]),
         SplitMismatch, "apply_prefill_state"),
        ("prefill id out of range on one rank", lambda: split.apply_prefill_state(
            sampling_params=params, prompt_tokens=prompts + 3 * int(last), empty_slots=[1, 3]),
         InvalidSamplingParams, "prompt_tokens" if last else other),
        ("release differs", lambda: split.release_slots([2] if last else [0]), SplitMismatch, "release_slots"),
        ("set_params differ", lambda: sampler.set_params([0], [SamplingParams(top_k=3 if last else 4)]),
         SplitMismatch, "params"),
        ("set_params invalid on one rank", lambda: sampler.set_params([0], [SamplingParams(
            logit_bias={vocab if last else 3: 1.0})]), InvalidSamplingParams, "logit_bias" if last else other),
        ("set_noise differ", lambda: sampler.set_noise([0], [1], [5 if last else 6], [0]), SplitMismatch,
         "seeds/positions/streams"),
        ("reset_history differ", lambda: sampler.reset_history([0], torch.tensor([[3 if last else 4]]), None),
         SplitMismatch, "token histories"),
        ("reset_history id out of range on one rank", lambda: sampler.reset_history(
            [0], torch.tensor([[vocab if last else 4]]), None), InvalidSamplingParams,
         "prompt_token_ids" if last else other),
        ("record masks differ", lambda: sampler.sample(torch.zeros(4, width), record=torch.tensor(
            [True, False, last, False])), SplitMismatch, "params"),
        ("record mask of a wrong shape on one rank", lambda: sampler.sample(torch.zeros(4, width), record=torch.tensor(
            [True] * (3 if last else 4))), InvalidSamplingParams, "record" if last else other),
    ]
    failures = []
    for label, call, error, field in checks:
        try:
            _raises(call, error, field)
        except AssertionError as exc:
            failures.append(f"rank {ex.rank}: {label}: {exc}")
    rng = torch.Generator().manual_seed(3)
    for step in range(3):
        logits = torch.randn(4, padded, generator=rng)
        buffer.copy_(logits)
        got = split.sample(bound, enable_trace=step == 1)
        want = whole.sample(logits)
        failures += dc.compare(f"rank {ex.rank} after errors step {step}", split.last_output, whole.last_output)
        assert torch.equal(got[0], want[0])
    check_slot_state(split.sampler)
    return failures


def test_split_generator_errors_raise_on_every_rank_before_state_changes():
    failures = [line for bad in dc.run_threads(2, _split_generator_errors) for line in bad]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(("differ", "field"), [({"max_batch_size": 3}, "Sampler"),
                                               ({"sampling_dp": 2, "max_batch_size": 1}, "SamplingGenerator"),
                                               ({"seed_source": gc.seeded_source(1)}, "SamplingGenerator"),
                                               ({"logprobs_mode": "raw_logits"}, "Sampler")])
def test_ranks_building_different_generators_raise_on_every_rank(differ, field):
    """Ranks whose generators differ (lanes, seed source, modes) would run different collectives:
    construction raises SplitMismatch on every rank first (the split Sampler's own agreement
    catches what it holds, the generator's the rest)."""
    def run(ex):
        kwargs = {"max_batch_size": 2, **(differ if ex.rank == 1 else {})}
        with pytest.raises(SplitMismatch) as err:
            SamplingGenerator(20, padded_vocab_size=20, device="cpu", group=ex, **kwargs)
        return err.value.field

    assert dc.run_threads(2, run) == [field] * 2


@pytest.mark.parametrize("differ", [{"max_slots": 3}, {"eos_token_ids": (2,)}, {"logprobs_mode": "raw_logits"},
                                    {"padded_vocab_size": 21}])
def test_ranks_building_different_split_samplers_raise_on_every_rank(differ):
    """The split Sampler agrees on its construction arguments too (the rank whose own check fails,
    here a padded width that is not a multiple of the group, raises that error)."""
    def run(ex):
        kwargs = {"max_slots": 2, "padded_vocab_size": 20, **(differ if ex.rank == 1 else {})}
        with pytest.raises(InvalidSamplingParams) as err:
            Sampler(20, group=ex, **kwargs)
        return err.value.field

    fields = dc.run_threads(2, run)
    assert fields == (["group", "padded_vocab_size"] if "padded_vocab_size" in differ else ["Sampler"] * 2)


def test_unseeded_requests_share_rank_zeros_stream_and_batch_buckets_sample_the_first_lanes():
    """Without a seed_source, every rank's generator draws the same seeds (rank 0's stream); the
    tokens, also for a batch bucket smaller than the lanes, are an unsplit generator's with those seeds."""
    vocab, padded, world = 40, 42, 3
    params = BatchSamplingParams.from_requests([SamplingParams(top_k=5), SamplingParams(), SamplingParams(seed=4)])
    rng = torch.Generator().manual_seed(6)
    steps = [torch.randn(rows, padded, generator=rng) for rows in (4, 2, 3)]

    def drive(gen, rank, width):
        seeds = gen.apply_prefill_state(sampling_params=params, prompt_tokens=[[1], [2], [39]], empty_slots=[0, 1, 3])
        return seeds, [gen.sample(logits[:, rank * width:(rank + 1) * width])[0].tolist() for logits in steps]

    results = dc.run_threads(world, lambda ex: drive(SamplingGenerator(vocab, max_batch_size=4, device="cpu",
                                                                       padded_vocab_size=padded, group=ex),
                                                     ex.rank, padded // world))
    seeds = results[0][0]
    assert all(r[0] == seeds for r in results) and len(set(seeds)) == 3 and seeds[2] == 4
    drawn = iter(seeds[:2])
    whole = SamplingGenerator(vocab, max_batch_size=4, device="cpu", padded_vocab_size=padded,
                              seed_source=lambda: next(drawn))
    assert drive(whole, 0, padded) == results[0]
    assert all(r == results[0] for r in results)


# ------------------------------------------------------------------ real gloo process groups
def test_gloo_split_generators_of_2_and_3_ranks(tmp_path):
    """One fork of 3 gloo ranks; groups of ranks [0, 2) and [0, 3) run the schedule against the
    unsplit generator, then a schedule with the default (shared) seed source."""
    world = 3
    jobs = [("schedule", w, *gc.CONFIGS[w][0], 70 + w, 30) for w in (2, 3)]
    jobs.append(("default_seeds", 3, 30, 48, 91, 20))
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(gc.gloo_worker, args=(world, str(tmp_path / "store"), str(tmp_path), jobs), nprocs=world,
                       join=True, start_method=method)
    reports = []
    for rank in range(world):
        with open(tmp_path / f"rank{rank}.json") as handle:
            reports.append(json.load(handle))
        assert reports[-1]["crash"] is None, reports[-1]["crash"]
        assert not reports[-1]["failures"], "\n".join(reports[-1]["failures"][:10])
    assert [len(r["results"]) for r in reports] == [3, 3, 2]
    for job in jobs:
        results = [res for r in reports for res in r["results"] if res["job"] == list(job)]
        assert len(results) == job[1]
        assert all(res["tokens"] == results[0]["tokens"] for res in results), job  # the same on every rank
        assert len(results[0]["tokens"]) >= 15
        if job[0] == "default_seeds":
            assert all(res["seeds"] == results[0]["seeds"] for res in results) and results[0]["seeds"]
        else:
            assert all(results[0]["counts"].get(name) for name in ("device_remap", "host_decode", "rebuild")), \
                results[0]["counts"]

