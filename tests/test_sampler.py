"""Sampler: token-for-token equality with reference.py, determinism, state, and bad input."""

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokensampler import InvalidSamplingParams, Sampler, SamplingParams, sample
from tokensampler.core.constants import LOGPROBS_MODES
from tokensampler.reference import ReferenceRequest, reference_sample


def random_params(rng: random.Random, vocab: int, seed: int) -> SamplingParams:
    kind = rng.random()
    fields = {"seed": seed}
    if kind < 0.15:
        fields["temperature"] = 0.0
    else:
        fields["temperature"] = rng.choice([0.3, 0.7, 1.0, 1.5])
        if rng.random() < 0.5:
            fields["top_k"] = rng.choice([1, 2, 5, vocab // 2, vocab + 5])
        if rng.random() < 0.5:
            fields["top_p"] = rng.choice([0.05, 0.5, 0.9, 0.99, 1.0])
        if rng.random() < 0.3:
            fields["min_p"] = rng.choice([0.01, 0.1, 0.5])
    if rng.random() < 0.4:
        fields.update(repetition_penalty=rng.choice([0.8, 1.2, 2.0]), frequency_penalty=rng.uniform(-1, 1),
                      presence_penalty=rng.uniform(-1, 1))
    if rng.random() < 0.2:
        fields["logit_bias"] = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(3)}
    if rng.random() < 0.15:
        fields["allowed_token_ids"] = tuple(rng.sample(range(vocab), k=min(vocab, 4)))
    if rng.random() < 0.2:
        fields.update(min_tokens=rng.randint(1, 4), stop_token_ids=(rng.randrange(vocab),))
    if rng.random() < 0.5:
        fields["logprobs"] = rng.choice([0, 1, 3, -1])
    if rng.random() < 0.3:
        fields.update(dry_multiplier=rng.choice([0.5, 2.0]), dry_base=rng.choice([1.0, 1.75, 3.0]),
                      dry_allowed_length=rng.choice([1, 2]), dry_penalty_last_n=rng.choice([-1, 0, 5]),
                      dry_sequence_breakers=rng.choice([(), ((rng.randrange(vocab),), (rng.randrange(vocab), 0))]))
    return SamplingParams(**fields)


def random_logits(rng: random.Random, batch: int, vocab: int, padded: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(batch, padded, generator=gen) * rng.choice([0.5, 2.0, 8.0])
    if rng.random() < 0.5:  # ties: a coarse grid of values
        logits = torch.round(logits * 2) / 2
    logits[:, vocab:] = rng.choice([0.0, 50.0, float("inf"), float("nan")])  # padding is never sampled
    for b in range(batch):
        r = rng.random()
        if r < 0.05:
            logits[b, :vocab] = float("nan")
        elif r < 0.1:
            logits[b, rng.randrange(vocab)] = float("inf")
        elif r < 0.2:
            logits[b, torch.randperm(vocab, generator=gen)[: vocab // 2]] = float("-inf")
    return logits.to(dtype)


def assert_outputs_equal(got, want):
    assert torch.equal(got.token_ids.cpu(), want.token_ids), (got.token_ids, want.token_ids)
    assert torch.equal(got.valid.cpu(), want.valid)
    assert (got.logprobs is None) == (want.logprobs is None)
    if want.logprobs is not None:
        g, w = got.logprobs, want.logprobs
        assert torch.equal(g.token_ranks.cpu(), w.token_ranks)
        assert torch.equal(g.top_token_ids.cpu(), w.top_token_ids)
        assert torch.allclose(g.token_logprobs.cpu(), w.token_logprobs, atol=1e-5, rtol=0, equal_nan=True)
        assert torch.allclose(g.top_logprobs.cpu(), w.top_logprobs, atol=1e-5, rtol=0, equal_nan=True)


@settings(max_examples=int(os.environ.get("TOKENSAMPLER_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), batch=st.integers(1, 6), vocab=st.integers(2, 80),
       pad=st.sampled_from([0, 1, 7]), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       mode=st.sampled_from(LOGPROBS_MODES), steps=st.integers(1, 3))
def test_sampler_equals_reference(seed, batch, vocab, pad, dtype, mode, steps):
    rng = random.Random(seed)
    padded = vocab + pad
    eos = (rng.randrange(vocab),)
    params = [random_params(rng, vocab, seed=rng.randrange(-(2**63), 2**64)) for _ in range(batch)]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(6))] for _ in range(batch)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(4))] for _ in range(batch)]
    slots = rng.sample(range(batch + 3), batch)
    sampler = Sampler(vocab, max_slots=batch + 3, padded_vocab_size=padded, logprobs_mode=mode,
                      max_logprobs=5, eos_token_ids=eos)
    for b in range(batch):
        sampler.add_request(slots[b], params[b], prompts[b], output_token_ids=outputs[b])
    for _ in range(steps):
        logits = random_logits(rng, batch, vocab, padded, dtype)
        requests = [ReferenceRequest(params[b], params[b].seed, len(prompts[b]) + len(outputs[b]), prompts[b],
                                     list(outputs[b]), 0, eos) for b in range(batch)]
        want = reference_sample(logits, requests, vocab_size=vocab, logprobs_mode=mode)
        got = sampler.sample(logits, slots)
        assert_outputs_equal(got, want)
        for b in range(batch):
            outputs[b].append(int(want.token_ids[b]))


def _params(**kw):
    return SamplingParams(**{"temperature": 0.9, "top_k": 40, "top_p": 0.9, "seed": 1234, **kw})


def _tokens_for(sampler, slot, logits_rows, others=None):
    """Sample len(logits_rows) steps; the request sits in `slot`, other slots get other logits."""
    out = []
    for step, row in enumerate(logits_rows):
        slots = [slot] + (others or [])
        logits = torch.randn(len(slots), row.shape[0], generator=torch.Generator().manual_seed(99 + step))
        logits[0] = row
        out.append(int(sampler.sample(logits, slots).token_ids[0]))
    return out


def test_same_request_same_tokens_alone_in_batch_other_slot_and_after_churn():
    vocab = 300
    rows = [torch.randn(vocab, generator=torch.Generator().manual_seed(s)) * 3 for s in range(8)]
    alone = Sampler(vocab, max_slots=1)
    alone.add_request(0, _params(), [1, 2, 3])
    expected = _tokens_for(alone, 0, rows)

    big = Sampler(vocab, max_slots=64)
    for s in range(64):
        big.add_request(s, _params(seed=s) if s != 37 else _params(), [1, 2, 3] if s == 37 else [s])
    others = [s for s in range(64) if s != 37]
    assert _tokens_for(big, 37, rows, others) == expected

    churn = Sampler(vocab, max_slots=8)
    churn.add_request(5, _params(), [1, 2, 3])
    got = []
    for step, row in enumerate(rows):
        if step % 2 == 0:  # other requests come and go around it
            churn.add_request(step % 5, _params(seed=step, temperature=0.3), [step])
        else:
            churn.remove_request((step - 1) % 5)
        live = [5] + [s for s in range(8) if s != 5 and churn.state.params[s] is not None]
        logits = torch.randn(len(live), vocab)
        logits[0] = row
        got.append(int(churn.sample(logits, live).token_ids[0]))
    assert got == expected

    other_seed = Sampler(vocab, max_slots=1)
    other_seed.add_request(0, _params(seed=4321), [1, 2, 3])
    assert _tokens_for(other_seed, 0, rows) != expected


def test_unseeded_requests_report_a_seed_that_replays():
    vocab = 500
    rows = [torch.randn(vocab) for _ in range(6)]
    first = Sampler(vocab, max_slots=2)
    seed = first.add_request(1, SamplingParams(temperature=1.0), [7])
    assert first.seed_of(1) == seed
    tokens = _tokens_for(first, 1, rows)
    replay = Sampler(vocab, max_slots=1)
    replay.add_request(0, SamplingParams(temperature=1.0, seed=seed), [7])
    assert _tokens_for(replay, 0, rows) == tokens
    again = Sampler(vocab, max_slots=1)
    assert again.add_request(0, SamplingParams(), [7]) != seed


def test_streams_differ_for_n_choices():
    vocab = 1000
    logits = torch.zeros(4, vocab)  # uniform: choices only differ by noise
    sampler = Sampler(vocab, max_slots=4)
    for i in range(4):
        sampler.add_request(i, SamplingParams(seed=7, n=4), [1], stream=i)
    tokens = sampler.sample(logits).token_ids.tolist()
    assert len(set(tokens)) == 4


def test_history_and_position_advance_once_per_token():
    vocab = 50
    sampler = Sampler(vocab, max_slots=3)
    sampler.add_request(2, SamplingParams(seed=1), [4, 4, 5], output_token_ids=[6])
    assert sampler.position_of(2) == 4
    token = int(sampler.sample(torch.randn(1, vocab), [2]).token_ids[0])
    assert sampler.position_of(2) == 5
    counts = sampler.state.output_counts[2]
    assert int(counts[token]) == 1 + (token == 6) and int(counts.sum()) == 2
    assert sampler.state.prompt_mask[2].nonzero().flatten().tolist() == [4, 5]
    sampler.add_request(0, SamplingParams(seed=1), [1], position=100)
    assert sampler.position_of(0) == 100


def test_stateless_sample_equals_a_fresh_sampler():
    vocab, batch = 64, 5
    logits = torch.randn(batch, vocab + 4)
    params = [SamplingParams(seed=i, top_p=0.8, logprobs=2, repetition_penalty=1.3) for i in range(batch)]
    prompts = [[i, i + 1] for i in range(batch)]
    outputs = [[i + 2] for i in range(batch)]
    got = sample(logits, params, prompt_token_ids=prompts, output_token_ids=outputs, vocab_size=vocab)
    fresh = Sampler(vocab, max_slots=batch, padded_vocab_size=vocab + 4)
    for b in range(batch):
        fresh.add_request(b, params[b], prompts[b], output_token_ids=outputs[b])
    assert_outputs_equal(got, _cpu(fresh.sample(logits)))
    one = sample(logits, SamplingParams(seed=3, temperature=0), vocab_size=vocab)
    assert one.token_ids.tolist() == logits[:, :vocab].argmax(-1).tolist()


def _cpu(out):
    return out


def test_padded_ids_never_returned_over_a_million_draws():
    vocab, padded, batch = 6, 16, 2_000
    sampler = Sampler(vocab, max_slots=batch, padded_vocab_size=padded)
    for b in range(batch):
        sampler.add_request(b, SamplingParams(seed=b, temperature=2.0), [])
    logits = torch.zeros(batch, padded)
    logits[:, vocab:] = 1e4  # padding is far more likely than any real id, if it were sampled
    logits[::3, :vocab] = float("-inf")  # rows with nothing left fall back to a real id too
    seen = torch.zeros(padded, dtype=torch.int64)
    for _ in range(500):
        tokens = sampler.sample(logits).token_ids
        seen += torch.bincount(tokens, minlength=padded)
    assert int(seen.sum()) == 1_000_000
    assert int(seen[vocab:].sum()) == 0
    assert bool((seen[:vocab] > 0).all())


def test_invalid_params_leave_state_unchanged():
    vocab = 20
    sampler = Sampler(vocab, max_slots=2, max_logprobs=5)
    sampler.add_request(0, SamplingParams(seed=3), [1, 2])
    before = {name: t.clone() for name, t in vars(sampler.state).items() if isinstance(t, torch.Tensor)}
    bad_calls = [
        lambda: sampler.add_request(0, SamplingParams(logit_bias={20: 1.0}), [1]),
        lambda: sampler.add_request(0, SamplingParams(allowed_token_ids=(25,)), [1]),
        lambda: sampler.add_request(0, SamplingParams(stop_token_ids=(20,)), [1]),
        lambda: sampler.add_request(0, SamplingParams(logprobs=6), [1]),
        lambda: sampler.add_request(0, SamplingParams(), [1, 20]),
        lambda: sampler.add_request(0, SamplingParams(), [-1]),
        lambda: sampler.add_request(0, SamplingParams(), [1], output_token_ids=[99]),
        lambda: sampler.add_request(0, SamplingParams(), [1], position=-1),
        lambda: sampler.add_request(2, SamplingParams(), [1]),
        lambda: sampler.add_request(0, {"temperature": 1.0}, [1]),
    ]
    for call in bad_calls:
        with pytest.raises(InvalidSamplingParams):
            call()
    for name, t in vars(sampler.state).items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(t, before[name]), name
    assert sampler.seed_of(0) == 3 and sampler.params_of(0) == SamplingParams(seed=3)


def test_invalid_steps_raise_before_any_state_change():
    vocab = 20
    sampler = Sampler(vocab, max_slots=3, padded_vocab_size=24)
    sampler.add_request(0, SamplingParams(seed=3), [1])
    sampler.add_request(1, SamplingParams(seed=4), [1])
    bad = [
        (torch.zeros(2, 20), None, "logits.shape[1]"),
        (torch.zeros(2, 24, dtype=torch.float64), None, "logits.dtype"),
        (torch.zeros(24), None, "logits"),
        (torch.zeros(2, 24), [0], "slots"),
        (torch.zeros(2, 24), [0, 0], "slots"),
        (torch.zeros(2, 24), [0, 2], "slot"),
        (torch.zeros(2, 24), [0, 5], "slot"),
        (torch.zeros(3, 24), None, "slot"),
    ]
    for logits, slots, field in bad:
        with pytest.raises(InvalidSamplingParams) as info:
            sampler.sample(logits, slots)
        assert info.value.field == field
    assert sampler.position_of(0) == 1 and int(sampler.state.output_counts.sum()) == 0


@pytest.mark.parametrize("field,kwargs", [
    ("vocab_size", {"vocab_size": 0, "max_slots": 1}),
    ("max_slots", {"vocab_size": 5, "max_slots": 0}),
    ("padded_vocab_size", {"vocab_size": 5, "max_slots": 1, "padded_vocab_size": 4}),
    ("logprobs_mode", {"vocab_size": 5, "max_slots": 1, "logprobs_mode": "logits"}),
    ("max_logprobs", {"vocab_size": 5, "max_slots": 1, "max_logprobs": -1}),
    ("eos_token_ids", {"vocab_size": 5, "max_slots": 1, "eos_token_ids": (5,)}),
])
def test_invalid_sampler_construction(field, kwargs):
    vocab = kwargs.pop("vocab_size")
    with pytest.raises(InvalidSamplingParams) as info:
        Sampler(vocab, **kwargs)
    assert info.value.field == field


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_that_require_grad_give_the_same_tokens(dtype):
    """A model called outside torch.no_grad() hands over logits that require grad: every route
    (penalties write and restore, the block route's nan_to_num into its workspace) runs without
    autograd and gives the detached logits' tokens and logprobs; the logits keep their values."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 300, generator=gen, requires_grad=True)
    hidden = torch.randn(6, 64, generator=gen)
    logits = (hidden @ weight * 0.5).to(dtype)  # an autograd graph, as a model's forward leaves it
    logits.retain_grad()
    assert logits.requires_grad
    before = logits.detach().clone()
    params = [SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, seed=1),
              SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(temperature=1.0, top_k=20, min_p=0.05, logit_bias={3: 4.0}, seed=2, logprobs=3),
              SamplingParams(temperature=0.7, allowed_token_ids=(1, 5, 9), seed=3),
              SamplingParams(temperature=1.2, seed=4, logprobs=2),
              SamplingParams(temperature=0.9, top_p=0.5, min_tokens=2, stop_token_ids=(0,), seed=5)]
    histories = [[1, 2, 3, 2], [4, 4, 5], [6], [1, 5], [7, 8], [9]]

    def run(x):
        sampler = Sampler(300, max_slots=6, max_logprobs=5)
        for slot, (p, h) in enumerate(zip(params, histories)):
            sampler.add_request(slot, p, h[:1], output_token_ids=h[1:])
        return [sampler.sample(x) for _ in range(3)]

    with_grad, detached = run(logits), run(logits.detach().clone())
    for got, want in zip(with_grad, detached):
        assert torch.equal(got.token_ids, want.token_ids)
        assert torch.equal(got.logprobs.token_logprobs, want.logprobs.token_logprobs)
        assert not got.token_ids.requires_grad and not got.logprobs.token_logprobs.requires_grad
    assert torch.equal(logits.detach(), before)
    one = sample(logits, params[0])  # the stateless form too
    assert torch.equal(one.token_ids, sample(logits.detach(), params[0]).token_ids)
