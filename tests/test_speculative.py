"""Speculative verification (`Sampler.sample_speculative`): vLLM's greedy cases, match mode equal to
the plain sampler stepped one position at a time, rejection mode's distribution and acceptance
rate, the Gumbel-max coupling of a tokensampler-sampled draft, padding, bad input, the split.

Every statistical test uses fixed seeds (deterministic) and has a control that shows it rejects
a wrong distribution or rate."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from scipy import stats

from tests.support.bitmask import pack_bits
from tests.support.speculative_cases import (
    assert_logprobs_equal,
    assert_same_state,
    make_sampler,
    random_logits,
    random_params,
    snapshot,
    step_plainly,
)
from tokensampler import (
    InvalidSamplingParams,
    Sampler,
    SamplingParams,
    SpeculativeOutput,
    UnsupportedOnSplit,
)
from tokensampler.core import rng
from tokensampler.core.constants import NEG_INF
from tokensampler.core.plan import plan_step
from tokensampler.reference import ReferenceRequest, mirostat_mu_after, reference_sample_row
from tokensampler.speculative import (
    ACCEPT_STREAM_BITS,
    RESIDUAL_STREAM_BITS,
    STREAM_LIMIT,
    accept_stream,
    residual_stream,
    target_rows,
)

MODES = ("match", "rejection")
GREEDY = SamplingParams(temperature=0.0)


def greedy_logits(targets: list[list[int]], vocab: int) -> torch.Tensor:
    """[B, K+1, vocab]: position j of row b has its maximum at targets[b][j]."""
    logits = torch.zeros(len(targets), len(targets[0]), vocab)
    for b, row in enumerate(targets):
        for j, token in enumerate(row):
            logits[b, j, token] = 5.0
    return logits


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a float tensor (NaN-safe equality)."""
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def greedy_sampler(batch: int, vocab: int = 10) -> Sampler:
    sampler = Sampler(vocab, max_slots=batch)
    for b in range(batch):
        sampler.add_request(b, GREEDY, [0])
    return sampler


# ------------------------------------------------------------------ vLLM's documented greedy cases
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("drafts, targets, want", [
    ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),            # all accepted, bonus 4
    ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5, -1, -1]]),          # first mismatch: the target's token, stop
    ([[1, 2], [3, -1]], [[1, 2, 5], [3, 4, 6]], [[1, 2, 5], [3, 4, -1]]),  # a shorter row
    ([[-1, -1, -1]], [[7, 2, 3, 4]], [[7, -1, -1, -1]]),      # no draft: the bonus-position token only
    ([[]], [[8]], [[8]]),                                     # K = 0
])
def test_vllm_greedy_cases(mode, drafts, targets, want):
    sampler = greedy_sampler(len(drafts))
    out = sampler.sample_speculative(greedy_logits(targets, 10), torch.tensor(drafts, dtype=torch.int64).reshape(
        len(drafts), -1), mode=mode)
    assert isinstance(out, SpeculativeOutput)
    assert out.token_ids.tolist() == want
    assert out.num_emitted.tolist() == [sum(t >= 0 for t in row) for row in want]
    assert out.token_ids.dtype == out.num_emitted.dtype == torch.int64
    assert [sampler.position_of(b) for b in range(len(drafts))] == [1 + n for n in out.num_emitted.tolist()]


def test_default_mode_follows_draft_probs():
    sampler = greedy_sampler(1)
    logits = greedy_logits([[1, 2, 3]], 10)
    # greedy rows ignore q: both modes give the same tokens; a match call refuses draft_probs
    out = sampler.sample_speculative(logits, torch.tensor([[1, 4]]), draft_probs=torch.full((1, 2, 10), 0.1))
    assert out.token_ids.tolist() == [[1, 2, -1]]
    with pytest.raises(InvalidSamplingParams, match="draft_probs"):
        sampler.sample_speculative(logits, torch.tensor([[1, 4]]), draft_probs=torch.full((1, 2, 10), 0.1),
                                   mode="match")


# ------------------------------------------------------------------ match mode = plain sampling stepped
@pytest.mark.parametrize("case", range(10))
def test_match_mode_equals_plain_sampler_stepped(case):
    rnd = random.Random(1000 + case)
    vocab = rnd.choice([7, 30, 100])
    padded = vocab + rnd.choice([0, 3])
    batch = rnd.randint(1, 7)
    k = rnd.choice([0, 1, 3, 4])
    mode = rnd.choice(["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"])
    dtype = rnd.choice([torch.float32, torch.float32, torch.bfloat16])
    eos = (rnd.randrange(vocab),)
    params = [random_params(rnd, vocab) for _ in range(batch)]
    prompts = [[rnd.randrange(vocab) for _ in range(rnd.randrange(5))] for _ in range(batch)]
    outputs = [[rnd.randrange(vocab) for _ in range(rnd.randrange(4))] for _ in range(batch)]
    slots = rnd.sample(range(batch + 2), batch)
    kwargs = dict(max_slots=batch + 2, logprobs_mode=mode, eos=eos)
    plain = make_sampler(vocab, padded, params, prompts, outputs, slots, **kwargs)
    spec = make_sampler(vocab, padded, params, prompts, outputs, slots, **kwargs)
    logits = random_logits(rnd, batch, k + 1, vocab, padded, dtype)
    cuts = [rnd.randint(0, k) for _ in range(batch)]
    width = plan_step(params, vocab).logprobs_width
    drafts, want, want_lp = step_plainly(plain, logits, slots, cuts, rnd, vocab, max(width, 0))
    before = logits.clone()
    out = spec.sample_speculative(logits, drafts, slots=slots)
    assert torch.equal(out.token_ids, want), (out.token_ids, want, drafts)
    assert out.num_emitted.tolist() == (want >= 0).sum(dim=1).tolist()
    assert_logprobs_equal(out.logprobs, want_lp)
    assert_same_state(snapshot(spec), snapshot(plain))  # counts, positions, output lengths, every column
    assert torch.equal(bits(before), bits(logits))  # the caller's logits are left as they were


def test_match_mode_history_advances_between_positions():
    """A frequency penalty on the drafted token changes the next position's token: with history
    the target's greedy token at position 1 is id 2 (id 1 penalised), without it id 1."""
    sampler = Sampler(4, max_slots=1)
    sampler.add_request(0, SamplingParams(temperature=0.0, frequency_penalty=2.0), [])
    logits = torch.tensor([[[0.0, 3.0, 0.0, 0.0], [0.0, 3.0, 2.0, 0.0]]])
    for mode in MODES:
        sampler.add_request(0, SamplingParams(temperature=0.0, frequency_penalty=2.0), [])
        out = sampler.sample_speculative(logits, torch.tensor([[1]]), mode=mode)
        assert out.token_ids.tolist() == [[1, 2]], mode
        assert int(sampler.state.output_counts[0, 1]) == 1 and int(sampler.state.output_len[0]) == 2


# ------------------------------------------------------------------ a pure function of the inputs
@pytest.mark.parametrize("mode", MODES)
def test_same_request_same_tokens_alone_other_slot_any_batch(mode):
    rnd = random.Random(5)
    vocab, batch, k = 40, 6, 3
    params = [random_params(rnd, vocab, logprobs=False) for _ in range(batch)]
    prompts = [[rnd.randrange(vocab) for _ in range(3)] for _ in range(batch)]
    logits = random_logits(rnd, batch, k + 1, vocab, vocab)
    drafts = torch.randint(-1, vocab, (batch, k), generator=torch.Generator().manual_seed(3))
    probs = torch.softmax(torch.randn(batch, k, vocab, generator=torch.Generator().manual_seed(4)), -1) \
        if mode == "rejection" else None
    together = make_sampler(vocab, vocab, params, prompts, [[]] * batch, list(range(batch)), max_slots=batch)
    want = together.sample_speculative(logits, drafts, draft_probs=probs, mode=mode).token_ids
    for b in range(batch):
        alone = make_sampler(vocab, vocab, [params[b]], [prompts[b]], [[]], [4], max_slots=5)
        got = alone.sample_speculative(logits[b:b + 1], drafts[b:b + 1], slots=[4],
                                       draft_probs=None if probs is None else probs[b:b + 1], mode=mode)
        assert torch.equal(got.token_ids[0], want[b]), b
    order = list(reversed(range(batch)))
    shuffled = make_sampler(vocab, vocab, [params[b] for b in order], [prompts[b] for b in order], [[]] * batch,
                            list(range(batch)), max_slots=batch)
    got = shuffled.sample_speculative(logits[order], drafts[order], mode=mode,
                                      draft_probs=None if probs is None else probs[order])
    assert torch.equal(got.token_ids, want[order])


# ------------------------------------------------------------------ rejection mode: its pieces
@pytest.mark.parametrize("case", range(12))
def test_target_distribution_is_the_definitions_kept_set(case):
    """`target_rows` (rejection mode's p) against reference.py: the final z (z / T on the kept set,
    -inf elsewhere) bit for bit, and the canonical token."""
    rnd = random.Random(300 + case)
    vocab = rnd.choice([5, 40, 300])
    batch = rnd.randint(1, 6)
    eos = (rnd.randrange(vocab),)
    params = [random_params(rnd, vocab, logprobs=False) for _ in range(batch)]
    prompts = [[rnd.randrange(vocab) for _ in range(rnd.randrange(5))] for _ in range(batch)]
    outputs = [[rnd.randrange(vocab) for _ in range(rnd.randrange(4))] for _ in range(batch)]
    sampler = make_sampler(vocab, vocab + 2, params, prompts, outputs, list(range(batch)), max_slots=batch, eos=eos)
    logits = random_logits(rnd, batch, 1, vocab, vocab + 2)[:, 0]
    plan = plan_step(params, vocab)
    got = target_rows(sampler.state, logits, torch.arange(batch), plan)
    for b in range(batch):
        request = ReferenceRequest(params[b], sampler.seed_of(b), len(prompts[b]) + len(outputs[b]), prompts[b],
                                   outputs[b], 0, eos)
        token, valid, (_, final) = reference_sample_row(logits[b], request, vocab, "processed_logits")
        assert int(got.tokens[b]) == token and bool(got.valid[b]) == valid, b
        if valid:
            assert torch.equal(got.final[b], final), (b, got.final[b], final)
            assert bool(got.sampled[b]) == (not params[b].greedy)


def test_reserved_streams_are_disjoint_from_request_streams():
    streams = torch.tensor([0, 1, 5, STREAM_LIMIT - 1])
    accept, residual = accept_stream(streams), residual_stream(streams)
    assert bool((accept >= STREAM_LIMIT).all()) and bool((residual >= STREAM_LIMIT).all())
    assert set(accept.tolist()).isdisjoint(residual.tolist())
    assert ACCEPT_STREAM_BITS & RESIDUAL_STREAM_BITS == ACCEPT_STREAM_BITS != RESIDUAL_STREAM_BITS
    assert max(residual_stream(streams).tolist()) < 2**32


def test_rejection_mode_bonus_and_history_equal_plain_sampling():
    """Peaked targets accept every draft (p(x) > 1 - 1e-9 > u); the bonus token is then the plain
    sampler's token with the drafts in the history (penalties, min_tokens, logprobs)."""
    rnd = random.Random(9)
    vocab, batch, k = 50, 6, 3
    params = [dataclasses.replace(random_params(rnd, vocab), allowed_token_ids=None, logit_bias=None,
                                  temperature=rnd.choice([0.0, 0.8, 1.0]), top_k=0, top_p=1.0, min_p=0.0,
                                  min_tokens=0, stop_token_ids=())
              for _ in range(batch)]
    prompts = [[rnd.randrange(vocab) for _ in range(3)] for _ in range(batch)]
    drafts = torch.randint(0, vocab, (batch, k), generator=torch.Generator().manual_seed(1))
    logits = torch.randn(batch, k + 1, vocab, generator=torch.Generator().manual_seed(2))
    for b in range(batch):
        for j in range(k):
            logits[b, j, drafts[b, j]] = 60.0
    plain = make_sampler(vocab, vocab, params, prompts, [[]] * batch, list(range(batch)), max_slots=batch)
    spec = make_sampler(vocab, vocab, params, prompts, [[]] * batch, list(range(batch)), max_slots=batch)
    width = max(plan_step(params, vocab).logprobs_width, 0)
    want, want_lp = step_plainly(plain, logits, list(range(batch)), [k] * batch, rnd, vocab, width)[1:]
    assert torch.equal(want[:, :k], drafts)
    out = spec.sample_speculative(logits, drafts, mode="rejection")
    assert torch.equal(out.token_ids, want)
    assert_logprobs_equal(out.logprobs, want_lp)
    assert_same_state(snapshot(spec), snapshot(plain))


def test_rejection_mode_with_no_drafts_is_plain_sampling():
    rnd = random.Random(11)
    vocab, batch = 60, 8
    params = [random_params(rnd, vocab) for _ in range(batch)]
    prompts = [[rnd.randrange(vocab) for _ in range(3)] for _ in range(batch)]
    logits = random_logits(rnd, batch, 1, vocab, vocab + 4)
    plain = make_sampler(vocab, vocab + 4, params, prompts, [[]] * batch, list(range(batch)), max_slots=batch)
    spec = make_sampler(vocab, vocab + 4, params, prompts, [[]] * batch, list(range(batch)), max_slots=batch)
    want = plain.sample(logits[:, 0])
    out = spec.sample_speculative(logits, torch.empty((batch, 0), dtype=torch.int64), mode="rejection")
    assert out.token_ids[:, 0].tolist() == want.token_ids.tolist()
    assert torch.equal(out.valid[:, 0], want.valid)
    assert_same_state(snapshot(spec), snapshot(plain))


# ------------------------------------------------------------------ rejection mode: the distribution
VOCAB = 6
P_LOGITS = torch.tensor([2.0, 1.2, 0.5, 0.0, -0.5, -1.0])
Q_LOGITS = torch.tensor([-1.0, 0.0, 1.5, 0.5, 1.0, -0.5])
TRIALS = 4000
PROMPT = [3, 3, 1]
TARGETS = {
    "plain": SamplingParams(temperature=1.0),
    "top_k": SamplingParams(temperature=0.7, top_k=3),
    "top_p": SamplingParams(temperature=1.3, top_p=0.75),
    "min_p_penalties": SamplingParams(temperature=1.0, min_p=0.12, repetition_penalty=1.6, frequency_penalty=0.5),
    # the full-row samplers (steps 7, 10.1-10.5; XTC with probability 1, so every seed's coin applies it)
    "typical_epsilon_eta": SamplingParams(temperature=1.0, typical_p=0.85, epsilon_cutoff=0.01, eta_cutoff=0.02),
    "dynatemp_sigma_xtc": SamplingParams(temperature=0.9, dynatemp_range=0.6, top_n_sigma=3.0,
                                         xtc_probability=1.0, xtc_threshold=0.2),
    # Mirostat at mu = 2 tau = 3: the ids of surprise <= 3 bits (0 and 1 of P_LOGITS)
    "mirostat": SamplingParams(temperature=1.0, mirostat_tau=1.5, mirostat_eta=0.1),
}
DRAFT = SamplingParams(temperature=1.0)


def filtered_probs(params: SamplingParams, logits: torch.Tensor, position: int, outputs=()) -> torch.Tensor:
    """The definition's filtered distribution (reference.py's final z, softmax over the kept ids)."""
    request = ReferenceRequest(params, 0, position, PROMPT, list(outputs), 0)
    final = reference_sample_row(logits, request, logits.shape[-1], "processed_logits")[2][1]
    return torch.softmax(final.to(torch.float64), dim=-1)


def draw_drafts(source: str, seeds: list[int], position: int) -> torch.Tensor:
    """Drafts from q: sampled by tokensampler with each row's seed at the same position (coupled
    with the target's canonical noise), or by torch.multinomial with a fixed generator."""
    if source == "torch":
        q = filtered_probs(DRAFT, Q_LOGITS, position)
        return torch.multinomial(q, len(seeds), replacement=True, generator=torch.Generator().manual_seed(17))
    draft = Sampler(VOCAB, max_slots=len(seeds))
    for b, seed in enumerate(seeds):
        draft.add_request(b, dataclasses.replace(DRAFT, seed=seed), PROMPT)
    return draft.sample(Q_LOGITS.expand(len(seeds), VOCAB).contiguous()).token_ids


def rejection_trial(target: SamplingParams, with_probs: bool, source: str, trials: int = TRIALS):
    """(first emitted tokens, whether the first draft was accepted, the drafts) over `trials` seeds."""
    seeds = [10_000 + i for i in range(trials)]
    position = len(PROMPT)
    drafts = draw_drafts(source, seeds, position)
    sampler = Sampler(VOCAB, max_slots=trials)
    for b, seed in enumerate(seeds):
        sampler.add_request(b, dataclasses.replace(target, seed=seed), PROMPT)
    logits = P_LOGITS.expand(trials, 2, VOCAB).contiguous()
    probs = filtered_probs(DRAFT, Q_LOGITS, position).to(torch.float32).expand(trials, 1, VOCAB).contiguous() \
        if with_probs else None
    out = sampler.sample_speculative(logits, drafts[:, None], draft_probs=probs, mode="rejection")
    return out.token_ids[:, 0], out.num_emitted >= 2, drafts


def chi_square_pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=p.numel()).to(torch.float64)
    support = p > 0
    if bool((counts[~support] > 0).any()):
        return 0.0  # a removed id was emitted
    return float(stats.chisquare(counts[support].numpy(), (p[support] * counts.sum()).numpy()).pvalue)


def binomial_close(hits: torch.Tensor, expected: float, sigmas: float = 4.5) -> bool:
    n = hits.numel()
    rate = float(hits.to(torch.float64).mean())
    return abs(rate - expected) <= sigmas * math.sqrt(max(expected * (1 - expected), 1e-12) / n)


@pytest.mark.parametrize("source", ["tokensampler", "torch"])
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_rejection_mode_emits_the_target_distribution(target, with_probs, source):
    params = TARGETS[target]
    position = len(PROMPT)
    p = filtered_probs(params, P_LOGITS, position)
    q = filtered_probs(DRAFT, Q_LOGITS, position)
    first, accepted, drafts = rejection_trial(params, with_probs, source)
    assert chi_square_pvalue(first, p) > 1e-4
    # the acceptance rate: sum min(p, q) with q given; sum q(x) p(x) for one-hot drafts
    expected = float(torch.minimum(p, q).sum()) if with_probs else float((p * q).sum())
    assert binomial_close(accepted, expected), (float(accepted.double().mean()), expected)
    # controls: the same statistics reject a wrong distribution and a wrong rate
    assert chi_square_pvalue(first, q) < 1e-8
    assert chi_square_pvalue(drafts, p) < 1e-8  # emitting the drafts unverified would be caught
    other = float((p * q).sum()) if with_probs else float(torch.minimum(p, q).sum())
    assert not binomial_close(accepted, other)


def test_rejection_mode_never_emits_a_removed_id():
    """Drafts and q concentrated on ids top-k removes: accepted never, residual never there."""
    params = SamplingParams(temperature=1.0, top_k=2, seed=1)
    sampler = Sampler(VOCAB, max_slots=500)
    for b in range(500):
        sampler.add_request(b, dataclasses.replace(params, seed=b), [])
    logits = P_LOGITS.expand(500, 3, VOCAB).contiguous()
    drafts = torch.full((500, 2), 5, dtype=torch.int64)
    probs = torch.zeros(500, 2, VOCAB)
    probs[:, :, 5] = 0.9
    probs[:, :, 0] = 0.1
    out = sampler.sample_speculative(logits, drafts, draft_probs=probs)
    assert set(out.token_ids[:, 0].tolist()) <= {0, 1} and bool((out.num_emitted == 1).all())
    # q(0) = 0.1 < p(0): id 0 keeps mass in the residual, id 1 all of its own
    p = filtered_probs(SamplingParams(temperature=1.0, top_k=2), P_LOGITS, 0)
    residual = (p - probs[0, 0].double()).clamp(min=0)
    assert chi_square_pvalue(out.token_ids[:, 0], residual / residual.sum()) > 1e-4


# ------------------------------------------------------------------ match mode: the Gumbel-max coupling
def coupling_probability(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(argmax(log p + g) == argmax(log q + g)) for shared Gumbel noise g."""
    total = 0.0
    for i in range(p.numel()):
        if p[i] > 0 and q[i] > 0:
            total += 1.0 / float(torch.maximum(p / p[i], q / q[i]).sum())
    return total


@pytest.mark.parametrize("filters", [{}, {"top_k": 4}])
def test_match_mode_acceptance_is_the_gumbel_max_coupling(filters):
    trials = TRIALS
    position = len(PROMPT)
    target = SamplingParams(temperature=1.0, **filters)
    draft_params = SamplingParams(temperature=1.0, **filters)
    p = filtered_probs(target, P_LOGITS, position)
    q = filtered_probs(draft_params, Q_LOGITS, position)
    seeds = [50_000 + i for i in range(trials)]
    draft = Sampler(VOCAB, max_slots=trials)
    sampler = Sampler(VOCAB, max_slots=trials)
    for b, seed in enumerate(seeds):
        draft.add_request(b, dataclasses.replace(draft_params, seed=seed), PROMPT)
        sampler.add_request(b, dataclasses.replace(target, seed=seed), PROMPT)
    drafts = draft.sample(Q_LOGITS.expand(trials, VOCAB).contiguous()).token_ids
    out = sampler.sample_speculative(P_LOGITS.expand(trials, 2, VOCAB).contiguous(), drafts[:, None])
    accepted = out.num_emitted >= 2
    coupled = coupling_probability(p, q)
    assert binomial_close(accepted, coupled), (float(accepted.double().mean()), coupled)
    assert chi_square_pvalue(out.token_ids[:, 0], p) > 1e-4  # match mode emits exactly the target's tokens
    # control: independent drafts would be accepted at sum p q, which the test tells apart
    assert not binomial_close(accepted, float((p * q).sum()))


# ------------------------------------------------------------------ padding, sparse rows, any drafts
@pytest.mark.parametrize("mode", MODES)
def test_no_padded_removed_or_missing_id_on_a_padded_vocabulary(mode):
    vocab, padded, batch, k = 151_936, 152_064, 4, 4
    gen = torch.Generator().manual_seed(0)
    logits = torch.full((batch, k + 1, padded), NEG_INF)
    live = torch.randint(0, vocab, (batch, k + 1, 12), generator=gen)
    logits.scatter_(2, live, torch.randn(batch, k + 1, 12, generator=gen) * 3)
    logits[:, :, vocab:] = 1e4  # padding columns at a large value
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.9, top_p=0.8, top_k=5, seed=2),
              SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.3, seed=3)]
    sampler = Sampler(vocab, max_slots=batch, padded_vocab_size=padded)
    for b in range(batch):
        sampler.add_request(b, params[b], [int(live[b, 0, 0])])
    # drafts: the live ids of each position (a chance to be accepted), removed ids, padding never
    drafts = torch.where(torch.rand(batch, k, generator=gen) < 0.7, live[:, :k, 0],
                         torch.randint(0, vocab, (batch, k), generator=gen))
    probs = None
    if mode == "rejection":
        probs = torch.rand(batch, k, padded, generator=gen)
        probs[:, :, vocab:] = 50.0  # mass on padding columns: never read
        probs /= probs.sum(-1, keepdim=True)
    out = sampler.sample_speculative(logits, drafts, draft_probs=probs, mode=mode)
    tokens, num = out.token_ids, out.num_emitted
    for b in range(batch):
        n = int(num[b])
        assert 1 <= n <= k + 1
        emitted = tokens[b, :n]
        assert bool((emitted >= 0).all()) and bool((emitted < vocab).all()), emitted
        assert bool((tokens[b, n:] == -1).all())
        finite = torch.isfinite(logits[b, torch.arange(n), emitted])
        assert bool(finite.all()), (b, emitted)  # never an id removed by the -inf holes
        assert torch.equal(emitted[:n - 1], drafts[b, :n - 1])


# ------------------------------------------------------------------ bad input
def bad_calls(vocab: int, padded: int):
    good_logits = torch.randn(2, 3, padded)
    good_drafts = torch.tensor([[1, 2], [3, -1]])
    probs = torch.full((2, 2, padded), 1.0 / padded)
    return [
        ("target_logits", dict(target_logits=torch.randn(2, padded), draft_token_ids=good_drafts)),
        ("target_logits", dict(target_logits=torch.randn(2, 0, padded), draft_token_ids=good_drafts[:, :0])),
        ("target_logits.shape[2]", dict(target_logits=torch.randn(2, 3, padded + 1), draft_token_ids=good_drafts)),
        ("target_logits.dtype", dict(target_logits=good_logits.double(), draft_token_ids=good_drafts)),
        ("draft_token_ids", dict(draft_token_ids=torch.tensor([[1, 2, 3], [3, -1, -1]]))),
        ("draft_token_ids", dict(draft_token_ids=good_drafts.float())),
        ("draft_token_ids", dict(draft_token_ids=good_drafts.bool())),
        ("draft_token_ids", dict(draft_token_ids=[[1, 2], [3, -1]])),
        ("draft_token_ids", dict(draft_token_ids=torch.tensor([[1, vocab], [3, -1]]))),
        ("draft_token_ids", dict(draft_token_ids=torch.tensor([[1, vocab + 1], [3, -1]]))),  # a padded id
        ("draft_token_ids", dict(draft_token_ids=torch.tensor([[1, 2], [-2, -1]]))),
        ("draft_probs", dict(draft_probs=probs[:, :1])),
        ("draft_probs", dict(draft_probs=probs[..., :vocab])),
        ("draft_probs", dict(draft_probs=probs.to(torch.int64))),
        ("draft_probs", dict(draft_probs=probs, mode="match")),
        ("mode", dict(mode="greedy")),
        ("slots", dict(slots=[0, 0])),
        ("slot", dict(slots=[0, 5])),
        ("slot", dict(slots=[0, 2])),  # not occupied
        ("record", dict(record=torch.tensor([True]))),
    ]


@pytest.mark.parametrize("index", range(20))
def test_bad_input_raises_and_leaves_state_unchanged(index):
    vocab, padded = 20, 24
    sampler = Sampler(vocab, max_slots=4, padded_vocab_size=padded)
    for b in range(2):
        sampler.add_request(b, SamplingParams(temperature=0.8, repetition_penalty=1.2, seed=b), [1, 2],
                            output_token_ids=[3])
    field, call = bad_calls(vocab, padded)[index]
    kwargs = dict(target_logits=torch.randn(2, 3, padded), draft_token_ids=torch.tensor([[1, 2], [3, -1]]))
    kwargs.update(call)
    before = snapshot(sampler)
    with pytest.raises(InvalidSamplingParams) as raised:
        sampler.sample_speculative(kwargs.pop("target_logits"), kwargs.pop("draft_token_ids"), **kwargs)
    assert raised.value.field == field, raised.value
    assert_same_state(snapshot(sampler), before)


def test_bad_calls_list_is_complete():
    assert len(bad_calls(20, 24)) == 20


def test_reserved_stream_rejected_in_rejection_mode_only():
    sampler = Sampler(8, max_slots=1)
    sampler.add_request(0, SamplingParams(temperature=1.0, seed=3), [1], stream=STREAM_LIMIT)
    before = snapshot(sampler)
    logits = torch.randn(1, 2, 8)
    with pytest.raises(InvalidSamplingParams, match="stream"):
        sampler.sample_speculative(logits, torch.tensor([[2]]), mode="rejection")
    assert_same_state(snapshot(sampler), before)
    sampler.sample_speculative(logits, torch.tensor([[2]]), mode="match")  # match mode uses no reserved stream


def test_empty_batch():
    sampler = greedy_sampler(1)
    out = sampler.sample_speculative(torch.zeros(0, 3, 10), torch.zeros(0, 2, dtype=torch.int64))
    assert out.token_ids.shape == (0, 3) and out.num_emitted.shape == (0,)


def test_record_mask_verifies_without_advancing():
    sampler = greedy_sampler(2)
    logits = greedy_logits([[1, 2, 3], [4, 5, 6]], 10)
    for mode in MODES:
        before = [sampler.position_of(b) for b in range(2)]
        out = sampler.sample_speculative(logits, torch.tensor([[1, 2], [4, 0]]), mode=mode,
                                         record=torch.tensor([False, True]))
        assert out.token_ids.tolist() == [[1, 2, 3], [4, 5, -1]]
        assert [sampler.position_of(b) for b in range(2)] == [before[0], before[1] + 2]


# ------------------------------------------------------------------ the acceptance noise itself
def test_acceptance_uniform_is_keyed_by_seed_position_token_in_its_stream():
    """One sampled row at one position: the draft is accepted iff U(seed, pos, x, accept stream)
    * q(x) < p(x), whatever the canonical noise says."""
    position = len(PROMPT)
    p = filtered_probs(SamplingParams(temperature=1.0), P_LOGITS, position)
    accepted_any = rejected_any = False
    for seed in range(40):
        sampler = Sampler(VOCAB, max_slots=1)
        sampler.add_request(0, SamplingParams(temperature=1.0, seed=seed), PROMPT)
        out = sampler.sample_speculative(P_LOGITS.expand(1, 2, VOCAB).contiguous(), torch.tensor([[0]]),
                                         mode="rejection")
        u = float(rng.U(seed, position, 0, ACCEPT_STREAM_BITS))
        want = u < float(p[0])
        assert bool(out.num_emitted[0] == 2) == want, seed
        accepted_any |= want
        rejected_any |= not want
    assert accepted_any and rejected_any


# ------------------------------------------------------------------ the vocabulary split
def test_split_match_mode_equals_unsplit_and_rejection_is_refused():
    from tests.support.split_cases import run_threads

    rnd = random.Random(21)
    vocab, padded, batch, k, world = 61, 64, 4, 3, 2
    params = [random_params(rnd, vocab, logprobs=False) for _ in range(batch)]
    # the full-row samplers run on a split too (the rows gathered whole): one each on rows 0-2
    params[0] = dataclasses.replace(params[0], temperature=1.0, typical_p=0.8, dynatemp_range=0.5)
    params[1] = dataclasses.replace(params[1], temperature=0.7, mirostat_tau=1.5, mirostat_eta=0.5)
    params[2] = dataclasses.replace(params[2], temperature=1.2, xtc_probability=1.0, xtc_threshold=0.05,
                                    top_n_sigma=2.0, epsilon_cutoff=0.01)
    prompts = [[rnd.randrange(vocab) for _ in range(3)] for _ in range(batch)]
    logits = random_logits(rnd, batch, k + 1, vocab, padded)
    unsplit = make_sampler(vocab, padded, params, prompts, [[]] * batch, list(range(batch)), max_slots=batch)
    cuts = [rnd.randint(0, k) for _ in range(batch)]
    plain = make_sampler(vocab, padded, params, prompts, [[]] * batch, list(range(batch)), max_slots=batch)
    drafts, want, _ = step_plainly(plain, logits, list(range(batch)), cuts, rnd, vocab, 0)
    assert torch.equal(unsplit.sample_speculative(logits, drafts).token_ids, want)
    width = padded // world

    def rank(exchange):
        sampler = make_sampler(vocab, padded, params, prompts, [[]] * batch, list(range(batch)), max_slots=batch,
                               group=exchange)
        part = logits[:, :, exchange.rank * width:(exchange.rank + 1) * width].contiguous()
        out = sampler.sample_speculative(part, drafts)
        refused = None
        try:
            sampler.sample_speculative(part, drafts, mode="rejection")
        except UnsupportedOnSplit as error:
            refused = error
        return out.token_ids, [sampler.position_of(b) for b in range(batch)], refused, sampler.mus_of(range(batch))

    for tokens, positions, refused, mus in run_threads(world, rank):
        assert torch.equal(tokens, want)
        assert positions == [unsplit.position_of(b) for b in range(batch)]
        assert mus == unsplit.mus_of(range(batch)) and mus[1] != 3.0  # row 1's mu moved as unsplit
        assert refused is not None and refused.field == "mode" and isinstance(refused, InvalidSamplingParams)


def test_rejection_mode_honours_a_one_token_bad_word():
    """A banned id that would win everywhere: rejection mode never accepts it as a draft, never
    draws it from the residual, and the bonus position (the ordinary step) never emits it."""
    sampler = Sampler(8, max_slots=200)
    for b in range(200):
        sampler.add_request(b, SamplingParams(temperature=1.0, seed=b, bad_words_token_ids=[[3]]), [1])
    logits = torch.zeros(200, 3, 8)
    logits[:, :, 3] = 50.0
    out = sampler.sample_speculative(logits, torch.full((200, 2), 3), mode="rejection")
    assert bool((out.num_emitted == 1).all())  # the draft 3 has p = 0: rejected at once
    assert 3 not in out.token_ids[:, 0].tolist() and bool((out.token_ids[:, 0] >= 0).all())
    out = sampler.sample_speculative(logits, torch.full((200, 2), -1), mode="rejection")
    assert 3 not in out.token_ids[:, 0].tolist()


# ------------------------------------------------------------------ bad words and the token bitmask


def target_probs_of(params: SamplingParams, logits: torch.Tensor, position: int, outputs=(),
                    allowed: set[int] | None = None) -> torch.Tensor:
    """The definition's filtered distribution at one position (reference.py's final z, softmax over
    the kept ids) after `outputs` (bad words read them), with this position's bitmask as `allowed`."""
    request = ReferenceRequest(params, 0, position, PROMPT, list(outputs), 0)
    final = reference_sample_row(logits, request, logits.shape[-1], "processed_logits", allowed)[2][1]
    return torch.softmax(final.to(torch.float64), dim=-1)


SPEC_TRIALS = 8000
FIRST_DRAFT = 1  # every row drafts id 1 first (q one-hot there), then a draft from q


def two_position_trial(target: SamplingParams, bitmask: torch.Tensor | None = None, trials: int = SPEC_TRIALS):
    """K = 2 rejection-mode verification of `trials` seeded rows: drafts (FIRST_DRAFT, x ~ q) with
    q given at both positions. Returns the output, the second drafts and the sampler."""
    position = len(PROMPT)
    q = filtered_probs(DRAFT, Q_LOGITS, position)
    second = torch.multinomial(q, trials, replacement=True, generator=torch.Generator().manual_seed(23))
    drafts = torch.stack([torch.full((trials,), FIRST_DRAFT), second], dim=1)
    probs = torch.zeros(trials, 2, VOCAB)
    probs[:, 0, FIRST_DRAFT] = 1.0
    probs[:, 1] = q.to(torch.float32)
    sampler = Sampler(VOCAB, max_slots=trials)
    for b in range(trials):
        sampler.add_request(b, dataclasses.replace(target, seed=70_000 + b), PROMPT)
    logits = P_LOGITS.expand(trials, 3, VOCAB).contiguous()
    masks = None if bitmask is None else bitmask.expand(trials, *bitmask.shape).contiguous()
    out = sampler.sample_speculative(logits, drafts, draft_probs=probs, mode="rejection", token_bitmask=masks)
    return out, second, sampler


def assert_two_positions(out, p0: torch.Tensor, p1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A `two_position_trial`'s first tokens follow p0, the first draft is accepted with p0's
    probability of it, and the second tokens of the rows that accepted it follow p1. Returns
    (first tokens, second tokens)."""
    first = out.token_ids[:, 0]
    assert chi_square_pvalue(first, p0) > 1e-4
    accepted = out.num_emitted >= 2  # the first draft accepted: the history holds it at position 1
    assert binomial_close(accepted, float(p0[FIRST_DRAFT]))
    second = out.token_ids[accepted, 1]
    assert chi_square_pvalue(second, p1) > 1e-4
    return first, second


# bad words: id 2 always (one token); id 0 once the output ends with FIRST_DRAFT (two tokens), so
# the target at the second position depends on the draft accepted at the first
BAD_WORDS = SamplingParams(temperature=1.0, bad_words_token_ids=[[2], [FIRST_DRAFT, 0]])


def test_rejection_mode_emits_the_bad_word_filtered_target():
    position = len(PROMPT)
    out, _, sampler = two_position_trial(BAD_WORDS)
    p0 = target_probs_of(BAD_WORDS, P_LOGITS, position)
    p1 = target_probs_of(BAD_WORDS, P_LOGITS, position + 1, outputs=[FIRST_DRAFT])
    assert float(p0[2]) == 0.0 and float(p1[0]) == 0.0 and float(p1[2]) == 0.0
    first, second = assert_two_positions(out, p0, p1)
    assert second.numel() > 1000
    # controls: the same statistics reject the target without its bad words, or without the history
    assert chi_square_pvalue(first, target_probs_of(SamplingParams(temperature=1.0), P_LOGITS, position)) < 1e-8
    assert chi_square_pvalue(second, target_probs_of(BAD_WORDS, P_LOGITS, position + 1)) < 1e-8


# Mirostat with mu = 2 tau = 4.4 keeps ids 0-3 of P_LOGITS; the surprise of FIRST_DRAFT among them
# (2.01 bits) is below tau, so mu rises to 4.59 and id 4 joins at the next position
MIROSTAT = SamplingParams(temperature=1.0, mirostat_tau=2.2, mirostat_eta=1.0)


def mirostat_target(mu: float | None, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the filtered target's probabilities, its final z) at `mu` (None: 2 tau)."""
    request = ReferenceRequest(MIROSTAT, 0, position, PROMPT, [], 0, mirostat_mu=mu)
    final = reference_sample_row(P_LOGITS, request, VOCAB, "processed_logits")[2][1]
    return torch.softmax(final.to(torch.float64), dim=-1), final


def test_rejection_mode_emits_the_mirostat_target_of_each_position_and_moves_mu():
    """Position 1's target uses mu after the token emitted at position 0 (an accepted FIRST_DRAFT):
    the emitted distribution at each position is the Mirostat-filtered target at that position's
    mu, and each slot's mu afterwards is the oracle's after the tokens it emitted."""
    position = len(PROMPT)
    out, _, sampler = two_position_trial(MIROSTAT)
    p0, final0 = mirostat_target(None, position)
    request = ReferenceRequest(MIROSTAT, 0, position, PROMPT, [], 0)
    mu1 = mirostat_mu_after(final0, final0 > NEG_INF, FIRST_DRAFT, request)
    p1, _ = mirostat_target(mu1, position + 1)
    assert float(p0[4]) == 0.0 and float(p1[4]) > 0.0  # mu moved, and the target with it
    first, second = assert_two_positions(out, p0, p1)
    assert chi_square_pvalue(second, p0) < 1e-8  # control: position 1 at the admitted mu
    # each slot's mu: the oracle's along the tokens the slot emitted (accepted, residual or bonus)
    sampler_mus = sampler.mus_of(range(out.token_ids.shape[0]))
    memo: dict = {}
    for b in range(0, out.token_ids.shape[0], 37):
        mu = None
        for j in range(int(out.num_emitted[b])):
            key = (mu, int(out.token_ids[b, j]))
            if key not in memo:
                _, final = mirostat_target(mu, position + j)
                memo[key] = mirostat_mu_after(final, final > NEG_INF, key[1],
                                              ReferenceRequest(MIROSTAT, 0, position + j, PROMPT, [], 0,
                                                               mirostat_mu=mu))
            mu = memo[key]
        assert sampler_mus[b] == mu, (b, out.token_ids[b])


# the bitmask of each position (the draft positions, then the bonus position)
MASK_SETS = [{0, 1, 3, 4}, {1, 2, 4, 5}, {3, 5}]
MASKED = SamplingParams(temperature=1.3, top_k=5)


def test_rejection_mode_emits_the_bitmask_filtered_target():
    position = len(PROMPT)
    bitmask = pack_bits(MASK_SETS, 1)  # [K+1, W]: one row per position
    out, _, sampler = two_position_trial(MASKED, bitmask)
    p0 = target_probs_of(MASKED, P_LOGITS, position, allowed=MASK_SETS[0])
    p1 = target_probs_of(MASKED, P_LOGITS, position + 1, [FIRST_DRAFT], allowed=MASK_SETS[1])
    p2 = target_probs_of(MASKED, P_LOGITS, position + 2, allowed=MASK_SETS[2])  # the history does not matter
    first, second = assert_two_positions(out, p0, p1)
    bonus = out.token_ids[out.num_emitted == 3, 2]
    assert bonus.numel() > 300 and set(bonus.tolist()) <= MASK_SETS[2]
    assert chi_square_pvalue(bonus, p2) > 1e-4
    # controls: without the mask, or with position 0's mask at position 1, the test fails
    assert chi_square_pvalue(first, target_probs_of(MASKED, P_LOGITS, position)) < 1e-8
    assert chi_square_pvalue(second, target_probs_of(MASKED, P_LOGITS, position + 1, allowed=MASK_SETS[0])) < 1e-8


def random_constrained_case(rnd: random.Random, vocab: int, batch: int, k: int):
    """Rows with bad words (one- and multi-token, on ids the outputs will hold), mixed parameters,
    and a random per-position bitmask [B, K+1, W] with a few ids masked out."""
    params = []
    for _ in range(batch):
        base = random_params(rnd, vocab, logprobs=False)
        words = [[rnd.randrange(vocab)] for _ in range(rnd.randint(0, 2))]
        words += [[rnd.randrange(vocab) for _ in range(rnd.randint(2, 3))] for _ in range(rnd.randint(0, 3))]
        params.append(dataclasses.replace(base, bad_words_token_ids=words))
    words = -(-vocab // 32) + rnd.choice([0, 1])
    allowed = [[set(range(vocab)) - set(rnd.sample(range(vocab), rnd.randint(0, vocab // 3)))
                for _ in range(k + 1)] for _ in range(batch)]
    bitmask = torch.stack([pack_bits(rows, words) for rows in allowed])
    return params, allowed, bitmask


@pytest.mark.parametrize("case", range(10))
def test_target_rows_with_bad_words_and_bitmask_is_the_definitions_kept_set(case):
    """`target_rows` with bad words on the recorded output and a token bitmask, against
    reference.py: the final z bit for bit and the canonical token."""
    rnd = random.Random(800 + case)
    vocab = rnd.choice([5, 40, 300])
    batch = rnd.randint(1, 6)
    params, allowed, bitmask = random_constrained_case(rnd, vocab, batch, 0)
    prompts = [[rnd.randrange(vocab) for _ in range(rnd.randrange(5))] for _ in range(batch)]
    # outputs that end with the prefix of a bad word half the time
    outputs = []
    for p in params:
        multi = [w for w in p.bad_words_token_ids if len(w) > 1]
        outputs.append(list(rnd.choice(multi)[:-1]) if multi and rnd.random() < 0.5 else
                       [rnd.randrange(vocab) for _ in range(rnd.randrange(3))])
    sampler = make_sampler(vocab, vocab + 2, params, prompts, outputs, list(range(batch)), max_slots=batch)
    logits = random_logits(rnd, batch, 1, vocab, vocab + 2)[:, 0]
    plan = plan_step(params, vocab)
    got = target_rows(sampler.state, logits, torch.arange(batch), plan, token_bitmask=bitmask[:, 0])
    for b in range(batch):
        request = ReferenceRequest(params[b], sampler.seed_of(b), len(prompts[b]) + len(outputs[b]), prompts[b],
                                   outputs[b], 0)
        token, valid, (_, final) = reference_sample_row(logits[b], request, vocab, "processed_logits", allowed[b][0])
        assert int(got.tokens[b]) == token and bool(got.valid[b]) == valid, b
        if valid:
            assert torch.equal(got.final[b], final), (b, got.final[b], final)


def reference_stepped(logits, params, prompts, seeds, drafts, allowed, vocab):
    """The oracle for rows whose verification is deterministic (greedy rows: accept while the draft
    equals the canonical token): reference.py one position at a time, the emitted tokens appended to
    the output (bad words read it), position j's bitmask as its allowed set."""
    batch, positions = logits.shape[:2]
    want = torch.full((batch, positions), -1, dtype=torch.int64)
    for b in range(batch):
        outputs = []
        for j in range(positions):
            request = ReferenceRequest(params[b], seeds[b], len(prompts[b]) + j, prompts[b], list(outputs), 0)
            token = reference_sample_row(logits[b, j], request, vocab, "raw_logprobs", allowed[b][j])[0]
            want[b, j] = token
            outputs.append(token)
            if j == positions - 1 or int(drafts[b, j]) != token:
                break
    return want


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", range(6))
def test_greedy_rows_with_bad_words_and_bitmask_equal_the_oracle_stepped(mode, case):
    rnd = random.Random(900 + case)
    vocab, batch, k = rnd.choice([12, 50]), rnd.randint(1, 6), rnd.choice([1, 3])
    params, allowed, bitmask = random_constrained_case(rnd, vocab, batch, k)
    params = [dataclasses.replace(p, temperature=0.0) for p in params]
    prompts = [[rnd.randrange(vocab) for _ in range(3)] for _ in range(batch)]
    logits = random_logits(rnd, batch, k + 1, vocab, vocab)
    sampler = make_sampler(vocab, vocab, params, prompts, [[]] * batch, list(range(batch)), max_slots=batch)
    seeds = [sampler.seed_of(b) for b in range(batch)]
    # drafts: the oracle's own tokens up to a random cut (bad words then fire on the drafts), then anything
    full = reference_stepped(logits, params, prompts, seeds, torch.full((batch, k), -2), allowed, vocab)
    drafts = torch.randint(0, vocab, (batch, k), generator=torch.Generator().manual_seed(case))
    for b in range(batch):
        cut = rnd.randint(0, k)
        drafts[b, :cut] = full[b, :cut]
    full = reference_stepped(logits, params, prompts, seeds, drafts, allowed, vocab)
    out = sampler.sample_speculative(logits, drafts, mode=mode, token_bitmask=bitmask)
    assert torch.equal(out.token_ids, full), (out.token_ids, full, drafts)


def test_reference_stepped_uses_the_history_for_bad_words():
    """Control of the oracle above: a two-token bad word fires only once its prefix was emitted."""
    vocab = 4
    params = [SamplingParams(temperature=0.0, bad_words_token_ids=[[1, 2]])]
    logits = torch.tensor([[[0.0, 5.0, 1.0, 0.0], [0.0, 0.0, 5.0, 1.0]]])
    allowed = [[set(range(vocab))] * 2]
    want = reference_stepped(logits, params, [[0]], [0], torch.tensor([[1]]), allowed, vocab)
    assert want.tolist() == [[1, 3]]  # id 2 banned after 1
    sampler = make_sampler(vocab, vocab, params, [[0]], [[]], [0], max_slots=1)
    assert sampler.sample_speculative(logits, torch.tensor([[1]]), mode="rejection").token_ids.tolist() == [[1, 3]]


@pytest.mark.parametrize("case", range(6))
def test_match_mode_with_bitmask_equals_plain_sampler_stepped_with_masks(case):
    """Match mode with a token bitmask per position and bad words: the plain sampler stepped one
    position at a time with that position's mask, tokens, logprobs and state."""
    rnd = random.Random(950 + case)
    vocab = rnd.choice([7, 40, 100])
    padded = vocab + rnd.choice([0, 3])
    batch, k = rnd.randint(1, 6), rnd.choice([1, 3])
    params, allowed, bitmask = random_constrained_case(rnd, vocab, batch, k)
    params = [dataclasses.replace(p, logprobs=rnd.choice([None, 2])) for p in params]
    prompts = [[rnd.randrange(vocab) for _ in range(3)] for _ in range(batch)]
    logits = random_logits(rnd, batch, k + 1, vocab, padded)
    plain = make_sampler(vocab, padded, params, prompts, [[]] * batch, list(range(batch)), max_slots=batch)
    spec = make_sampler(vocab, padded, params, prompts, [[]] * batch, list(range(batch)), max_slots=batch)
    drafts = torch.randint(0, vocab, (batch, k), generator=torch.Generator().manual_seed(case))
    want = torch.full((batch, k + 1), -1, dtype=torch.int64)
    alive = list(range(batch))
    for j in range(k + 1):
        got = plain.sample(logits[alive, j].contiguous(), alive, token_bitmask=bitmask[alive, j].contiguous())
        tokens = got.token_ids.tolist()
        survivors = []
        for i, b in enumerate(alive):
            want[b, j] = tokens[i]
            if j < k and rnd.random() < 0.7:
                drafts[b, j] = tokens[i]  # accepted: the next position sees it in the history
                survivors.append(b)
            elif j < k:
                drafts[b, j] = (tokens[i] + 1) % vocab
        alive = survivors
        if not alive:
            break
    out = spec.sample_speculative(logits, drafts, mode="match", token_bitmask=bitmask)
    assert torch.equal(out.token_ids, want), (out.token_ids, want)
    assert_same_state(snapshot(spec), snapshot(plain))


def test_rejection_bonus_position_takes_the_last_mask():
    """Peaked drafts accepted everywhere: the bonus token is the plain sampler's with the bonus
    position's mask (the last of K+1) and the drafts in the history."""
    rnd = random.Random(31)
    vocab, batch, k = 50, 6, 2
    params, allowed, bitmask = random_constrained_case(rnd, vocab, batch, k)
    params = [dataclasses.replace(p, allowed_token_ids=None, logit_bias=None, temperature=rnd.choice([0.0, 1.0]),
                                  top_k=0, top_p=1.0, min_p=0.0, min_tokens=0, bad_words_token_ids=())
              for p in params]
    prompts = [[rnd.randrange(vocab) for _ in range(3)] for _ in range(batch)]
    drafts = torch.tensor([[rnd.choice(sorted(allowed[b][j])) for j in range(k)] for b in range(batch)])
    logits = torch.randn(batch, k + 1, vocab, generator=torch.Generator().manual_seed(2))
    for b in range(batch):
        for j in range(k):
            logits[b, j, drafts[b, j]] = 60.0
        masked = rnd.randrange(vocab)  # the bonus position's mask removes the id that would win without it
        allowed[b][k].discard(masked)
        logits[b, k, masked] = 60.0
    bitmask[:, k] = pack_bits([allowed[b][k] for b in range(batch)], bitmask.shape[2])
    plain = make_sampler(vocab, vocab, params, prompts, [[]] * batch, list(range(batch)), max_slots=batch)
    spec = make_sampler(vocab, vocab, params, prompts, [[]] * batch, list(range(batch)), max_slots=batch)
    for j in range(k):
        plain.sample(logits[:, j].contiguous(), token_bitmask=bitmask[:, j].contiguous())
    want = plain.sample(logits[:, k].contiguous(), token_bitmask=bitmask[:, k].contiguous()).token_ids
    out = spec.sample_speculative(logits, drafts, mode="rejection", token_bitmask=bitmask)
    assert torch.equal(out.token_ids[:, :k], drafts)
    assert torch.equal(out.token_ids[:, k], want)
    assert all(int(want[b]) in allowed[b][k] for b in range(batch))
    assert_same_state(snapshot(spec), snapshot(plain))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad, field", [
    (lambda: torch.zeros(2, 3, 1, dtype=torch.int64), "token_bitmask.dtype"),
    (lambda: torch.zeros(2, 3, dtype=torch.int32), "token_bitmask"),
    (lambda: torch.zeros(2, 2, 1, dtype=torch.int32), "token_bitmask"),
    (lambda: torch.zeros(3, 3, 1, dtype=torch.int32), "token_bitmask"),
    (lambda: torch.zeros(2, 3, 0, dtype=torch.int32), "token_bitmask.shape"),
    (lambda: [[[-1]] * 3] * 2, "token_bitmask"),
])
def test_bad_speculative_bitmask_raises_and_leaves_state_unchanged(mode, bad, field):
    sampler = Sampler(20, max_slots=2)
    for b in range(2):
        sampler.add_request(b, SamplingParams(temperature=0.8, seed=b), [1])
    before = snapshot(sampler)
    with pytest.raises(InvalidSamplingParams) as raised:
        sampler.sample_speculative(torch.randn(2, 3, 20), torch.tensor([[1, 2], [3, -1]]), mode=mode,
                                   token_bitmask=bad())
    assert raised.value.field == field, raised.value
    assert_same_state(snapshot(sampler), before)
