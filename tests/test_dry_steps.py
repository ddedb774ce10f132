"""DRY (docs/semantics.md 5.1) in the steps: every backend against the oracle (`reference.py`).

The processed logits (DRY's penalised values included) and tokens of the torch step's two routes,
the Triton step (which hands DRY plans to the torch step) and the vocabulary split over 2 and 3
ranks equal the reference's on random batches with repetitive histories, sequence breakers and
every window; long histories (4,096 tokens, one token repeated, more than DRY_MAX_HISTORY) on one
row; the slot history follows remaps, history resets and the recorded tokens. Speculative
verification runs DRY through the shared random parameters (tests/support/speculative_cases.py).
"""

from __future__ import annotations

import random

import pytest
import torch

import tests.support.split_cases as dc
import tokensampler.reference as reference
from tests.support.backends import make_sampler
from tokensampler import Sampler, SamplingParams
from tokensampler.core.dry import DRY_MAX_HISTORY
from tokensampler.reference import ReferenceRequest, reference_sample

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the Triton interpreter's discarded lanes
BACKENDS = ("direct", "block", "kernels", "split2", "split3")
MODE = "processed_logits"


def repetitive(r: random.Random, vocab: int, n: int) -> list[int]:
    """A history that repeats phrases of a small alphabet, with some noise tokens."""
    alphabet = r.sample(range(vocab), r.randint(2, 6))
    phrase = [r.choice(alphabet) for _ in range(r.randint(2, 8))]
    out: list[int] = []
    while len(out) < n:
        out += phrase if r.random() < 0.7 else [r.randrange(vocab)]
    return out[:n]


def dry_params(r: random.Random, vocab: int, history: list[int]) -> SamplingParams:
    """DRY on most rows; breakers of 1-3 tokens, some of them pieces of `history` (so they bind)."""
    kw = dict(temperature=r.choice([0.0, 0.7, 1.0]), seed=r.randrange(2**63), logprobs=-1)
    if r.random() < 0.9:
        kw.update(dry_multiplier=r.choice([0.3, 0.8, 2.0]), dry_base=r.choice([1.0, 1.75, 3.0]),
                  dry_allowed_length=r.choice([1, 2, 3]), dry_penalty_last_n=r.choice([-1, -1, 0, 5, 40]))
        if r.random() < 0.6:
            breakers = []
            for _ in range(r.randint(1, 3)):
                length = r.randint(1, 3)
                if history and r.random() < 0.7:
                    start = r.randrange(max(1, len(history) - length))
                    breakers.append(tuple(history[start:start + length]))
                else:
                    breakers.append(tuple(r.randrange(vocab) for _ in range(length)))
            kw["dry_sequence_breakers"] = breakers
    for name, value in (("repetition_penalty", 1.3), ("top_k", 5), ("top_p", 0.9)):
        if r.random() < 0.25:
            kw[name] = value
    return SamplingParams(**kw)


class PenaltyCount:
    """Counts the ids the oracle's DRY changes (so that a test shows DRY fired)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ids = 0
        original = reference.apply_dry

        def counting(z, params, history):
            out = original(z, params, history)
            self.ids += int((out != z).sum())
            return out

        monkeypatch.setattr(reference, "apply_dry", counting)


def run_case(backend: str, case_seed: int, steps: int = 4) -> None:
    r = random.Random(case_seed)
    vocab, padded = r.choice([(16, 18), (50, 54), (300, 300)])
    batch = r.randint(1, 6)
    sampler = make_sampler(backend, vocab, max_slots=batch, padded_vocab_size=padded, logprobs_mode=MODE)
    requests = []
    for b in range(batch):
        prompt = repetitive(r, vocab, r.randint(0, 80))
        params = dry_params(r, vocab, prompt)
        seed = sampler.add_request(b, params, prompt)
        requests.append(ReferenceRequest(params, seed, len(prompt), prompt, []))
    for step in range(steps):
        logits = torch.randn(batch, padded, generator=torch.Generator().manual_seed(case_seed * 10 + step))
        got = sampler.sample(logits)
        want = reference_sample(logits, requests, vocab_size=vocab, logprobs_mode=MODE)
        assert not dc.compare(f"{backend} case {case_seed} step {step}", got, want)
        for req, token in zip(requests, want.token_ids.tolist()):
            req.output_token_ids.append(token)
            req.position += 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_batches_match_the_reference(backend, monkeypatch):
    if backend == "kernels":
        pytest.importorskip("triton")
    count = PenaltyCount(monkeypatch)
    for case_seed in range(8):
        run_case(backend, 1000 * BACKENDS.index(backend) + case_seed)
    assert count.ids >= 10  # DRY changed values in these cases


def one_row(params: SamplingParams, history: list[int], vocab: int, backend: str) -> None:
    """One row with `history` as its prompt, two steps, against the reference."""
    sampler = make_sampler(backend, vocab, max_slots=1, logprobs_mode=MODE)
    seed = sampler.add_request(0, params, history)
    request = ReferenceRequest(params, seed, len(history), history, [])
    for step in range(2):
        logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(step))
        got = sampler.sample(logits)
        want = reference_sample(logits, [request], vocab_size=vocab, logprobs_mode=MODE)
        assert not dc.compare(f"{backend} step {step}", got, want)
        request.output_token_ids.append(int(want.token_ids[0]))
        request.position += 1


def test_a_breaker_caps_the_repeat_length():
    """1 2 3 9 repeated: without a breaker the 3 after "... 1 2" repeats 6 tokens; with 3 as a breaker
    only the 3 tokens after the last 3 count (the oracle's own test: tests/test_dry.py)."""
    history = [5, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2]
    for breakers in ((), [(3,)], [(9, 1)], [(3, 9, 1)],
                     [(9,), (9, 1)], [(9, 1), (9,)], [(9, 1), (9, 1, 2)]):  # heads together: the longest tail
        for allowed in (1, 2):
            one_row(SamplingParams(temperature=0.0, logprobs=-1, dry_multiplier=1.0, dry_allowed_length=allowed,
                                   dry_sequence_breakers=breakers), history, 12, "direct")


LONG = {
    "phrases": (lambda r: repetitive(r, 200, 4096), {}),
    "one token": (lambda r: [7] * 5000, {"dry_base": 1.1}),  # every distance matches to the window's start
    "past the cap": (lambda r: repetitive(r, 200, DRY_MAX_HISTORY + 900), {}),
    "breakers": (lambda r: repetitive(r, 30, 3000), {"dry_sequence_breakers": [(3,), (5, 6), (1, 2, 4)]}),
    "window": (lambda r: repetitive(r, 30, 3000), {"dry_penalty_last_n": 100, "dry_allowed_length": 4}),
}


@pytest.mark.parametrize("name", sorted(LONG))
@pytest.mark.parametrize("backend", ("direct", "block", "split2"))
def test_long_histories_match_the_reference(name, backend, monkeypatch):
    history, fields = LONG[name]
    count = PenaltyCount(monkeypatch)
    vocab = 210
    params = SamplingParams(temperature=0.0, logprobs=-1, dry_multiplier=0.8, **fields)
    one_row(params, history(random.Random(name)), vocab, backend)
    assert count.ids >= 1


def test_the_history_follows_remaps_resets_and_steps(monkeypatch):
    count = PenaltyCount(monkeypatch)
    r = random.Random(3)
    vocab, slots = 40, 5
    sampler = Sampler(vocab, max_slots=slots, logprobs_mode=MODE, backend="torch")
    held: dict[int, ReferenceRequest] = {}
    for slot in range(4):
        params = SamplingParams(temperature=1.0, seed=slot, logprobs=-1, dry_multiplier=1.0,
                                dry_allowed_length=1, dry_penalty_last_n=r.choice([-1, 12]))
        prompt = repetitive(r, vocab, r.randint(5, 30))
        seed = sampler.add_request(slot, params, prompt)
        held[slot] = ReferenceRequest(params, seed, len(prompt), prompt, [])

    def step() -> None:
        depth = sampler.state.dry_depth
        for s, request in held.items():  # the state's DRY history: the latest prompt + output tokens
            row = sampler.state.dry_history[s]
            assert row[row >= 0].tolist() == [*request.prompt_token_ids, *request.output_token_ids][-depth:], s
        order = sorted(held)
        logits = torch.randn(len(order), vocab, generator=torch.Generator().manual_seed(r.randrange(2**31)))
        got = sampler.sample(logits, slots=order)
        want = reference_sample(logits, [held[s] for s in order], vocab_size=vocab, logprobs_mode=MODE)
        assert not dc.compare("remaps", got, want)
        for s, token in zip(order, want.token_ids.tolist()):
            held[s].output_token_ids.append(token)
            held[s].position += 1

    for _ in range(3):
        step()
    sampler.move_slots([4, 0, 1], [0, 1, 4 if 4 in held else 2])  # 0 -> 4, 1 -> 0, 2 -> 1
    held = {4: held[0], 0: held[1], 1: held[2], 3: held[3]}
    step()
    # outputs replaced, prompt kept (a preempted request resumed with its outputs so far)
    outputs = [r.randrange(vocab) for _ in range(6)]
    sampler.reset_history([4], None, torch.tensor([outputs]))
    held[4].output_token_ids[:] = outputs
    step()
    # prompt and outputs replaced
    prompt = repetitive(r, vocab, 20)
    sampler.reset_history([0], torch.tensor([prompt + [-1, -1]]), torch.tensor([[-1, 2, 3]]))
    held[0].prompt_token_ids, held[0].output_token_ids = prompt, [2, 3]
    step()
    step()
    assert count.ids >= 10
