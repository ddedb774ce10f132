"""`SamplingParams(bad_words_token_ids=...)`, vLLM's semantics, on every backend.

A one-token bad word is always removed; a longer one removes its last token while the request's
output (not its prompt) ends with its other tokens. The state keeps each slot's latest output tokens
on the device (`SamplerState.recent_tokens`), shifted by every recorded token, moved with the slot
and rebuilt by `reset_history` / `add_request`. Cases: vLLM's `test_sampler_bad_words` (tests/v1/
sample/test_sampler.py: batch sizes 1, 2, 32; word lengths (1,), (1, 3), (2, 2); equal logits; outputs
edited so that a prefix matches), histories built across steps by the sampler itself, random mixed
batches against the reference, the state operations, and the argument checks.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

import tests.support.split_cases as dc
from tests.support.backends import BACKENDS, make_sampler
from tokensampler import BatchSamplingParams, InvalidSamplingParams, Sampler, SamplingParams
from tokensampler.engine.batch_params import format_sampling_params, scatter_sampling_params_to_slots
from tokensampler.reference import ReferenceRequest, bad_word_ids, reference_sample

NEG_INF = float("-inf")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the Triton interpreter's discarded lanes


def underlying(sampler) -> list[Sampler]:
    """The Sampler(s) behind a backend wrapper (every rank of a split)."""
    if hasattr(sampler, "samplers"):
        return sampler.samplers
    return [getattr(sampler, "sampler", sampler)]


# ------------------------------------------------------------------ vLLM's test_sampler_bad_words
VOCAB_SIZE = 1024
NUM_OUTPUT_TOKENS = 20


def vllm_case(batch_size: int, lengths: tuple[int, ...], rng: np.random.Generator):
    """vLLM's construction: random bad words per row (one row without any when batch >= 2), random
    outputs of 20 tokens; for each row, one word's prefix is written at the end of the output (or,
    for a word not chosen, the last output token is made a token no word starts with). Returns the
    words, the outputs and the expected removed ids (the last tokens of every word sharing that prefix)."""
    words = {b: [rng.choice(VOCAB_SIZE, size=n, replace=True).tolist() for n in lengths] for b in range(batch_size)}
    if batch_size >= 2:
        words.pop(int(rng.choice(batch_size)), None)
    outputs = [rng.integers(0, VOCAB_SIZE, size=NUM_OUTPUT_TOKENS).tolist() for _ in range(batch_size)]
    expected: dict[int, list[int]] = {}
    for b, row_words in words.items():
        last: list[int] = []
        for word in row_words:
            if len(word) == 1:
                last.append(word[0])
            elif rng.choice([True, False]):
                prefix = word[:-1]
                outputs[b][-len(prefix):] = prefix
                last.extend(w[-1] for w in row_words if w[:-1] == prefix)
                break
            else:
                starts = {w[0] for w in row_words}
                outputs[b][-1] = int(rng.choice(sorted(set(range(VOCAB_SIZE)) - starts)))
        expected[b] = last
    return words, outputs, expected


@pytest.mark.parametrize("backend", ["direct", "block", "split2"])
@pytest.mark.parametrize("batch_size", [1, 2, 32])
@pytest.mark.parametrize("lengths", [(1,), (1, 3), (2, 2)])
def test_vllm_bad_words_cases(backend, batch_size, lengths):
    """Equal logits (1e-2), greedy rows, the processed logits of the whole vocabulary: exactly the
    expected ids are -inf in the rows with bad words, none elsewhere."""
    rng = np.random.default_rng(batch_size * 10 + len(lengths) + sum(lengths))
    words, outputs, expected = vllm_case(batch_size, lengths, rng)
    sampler = make_sampler(backend, VOCAB_SIZE, max_slots=batch_size, logprobs_mode="processed_logits")
    for b in range(batch_size):
        params = SamplingParams(temperature=0.0, logprobs=-1, bad_words_token_ids=words.get(b, ()))
        prompt = rng.integers(0, VOCAB_SIZE, size=int(rng.integers(1, 64))).tolist()
        sampler.add_request(b, params, prompt, output_token_ids=outputs[b])
    out = sampler.sample(torch.full((batch_size, VOCAB_SIZE), 1e-2))
    for b in range(batch_size):
        values = torch.empty(VOCAB_SIZE)
        values[out.logprobs.top_token_ids[b]] = out.logprobs.top_logprobs[b]
        removed = set(torch.nonzero(values == NEG_INF).squeeze(-1).tolist())
        assert removed == set(expected.get(b, [])), (b, words.get(b), outputs[b][-3:])
        params = SamplingParams(bad_words_token_ids=words.get(b, ()))
        assert removed == bad_word_ids(params, outputs[b])  # the reference's rule, the same sets


# ------------------------------------------------------------------ histories the sampler records
A, B_, C, D, E = 5, 6, 7, 8, 9


def peak(vocab: int, order: list[int]) -> torch.Tensor:
    """A logits row whose largest values are at `order` (descending), everything else below."""
    row = torch.linspace(-1.0, 0.0, vocab)
    for rank, token in enumerate(order):
        row[token] = 10.0 - rank
    return row


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_words_follow_the_recorded_output_not_the_prompt(backend):
    """Slot 0 builds [A, B] itself over two steps, then C is banned (the next best, D, is taken);
    slot 1 was admitted with an output ending [A, B]: C banned at once; slot 2's prompt ends [A, B]
    but its output is empty: C allowed. E (a one-token word) is never returned. Then a step that
    is not recorded leaves the history; `state.move` carries it to another slot; `reset_history`
    rebuilds it; `set_params` keeps it."""
    if backend == "kernels":
        pytest.importorskip("triton")
    vocab, padded = 64, 66
    words = [(A, B_, C), (E,)]
    sampler = make_sampler(backend, vocab, max_slots=6, padded_vocab_size=padded)
    params = SamplingParams(temperature=0.0, bad_words_token_ids=words)
    sampler.add_request(0, params, [1, 2, A, B_])
    sampler.add_request(1, params, [3], output_token_ids=[4, A, B_])
    sampler.add_request(2, params, [1, A, B_])

    def step(orders, slots=(0, 1, 2), record=None):
        logits = torch.stack([torch.cat([peak(vocab, o), torch.full((padded - vocab,), 1e4)]) for o in orders])
        return sampler.sample(logits, list(slots), record=record).token_ids.tolist()

    assert step([[A], [C, D], [C, D]]) == [A, D, C]
    assert step([[B_], [E, B_], [E, A]]) == [B_, B_, A]  # E: a one-token bad word, always removed
    assert step([[C, D], [A], [A]]) == [D, A, A]  # slot 0's output ends [A, B]: C banned
    # slot 1 now ends [.., B, A], slot 2 [.., A, A]; a step not recorded for slot 1 changes nothing
    assert step([[A], [B_], [B_]], record=torch.tensor([True, False, True])) == [A, B_, B_]
    assert step([[B_], [C, D], [C, D]]) == [B_, C, D]  # slot 1 still ends [B, A]; slot 2 [A, B]
    # slot 0 ends [A, B]: moved to slot 5 it keeps banning C
    for s in underlying(sampler):
        s.state.move(torch.tensor([5]), torch.tensor([0]))
        s.state.params[0] = None
    assert step([[C, D]], slots=(5,)) == [D]
    # rebuilt: slot 1's output becomes [.., A, B] (padding -1 anywhere), then C is banned there
    sampler.reset_history([1], None, torch.tensor([[9, -1, A, -1, B_, -1]]))
    assert step([[C, D]], slots=(1,)) == [D]
    sampler.reset_history([1], None, None)  # no output at all: nothing matches
    assert step([[C, D]], slots=(1,)) == [C]
    sampler.set_params([2], [dataclasses.replace(params, seed=3)])  # slot 2 ended [.., A, B, D]: keeps it
    assert step([[C, E], [B_]], slots=(2, 1)) == [C, B_]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_longer_word_admitted_later_grows_the_kept_history(backend):
    """Slot 0 (two-token words) keeps matching after slot 1 is admitted with a four-token word,
    which matches the output slot 1 was admitted with."""
    if backend == "kernels":
        pytest.importorskip("triton")
    vocab = 60
    sampler = make_sampler(backend, vocab, max_slots=2)
    sampler.add_request(0, SamplingParams(temperature=0.0, bad_words_token_ids=[(A, C)]), [], output_token_ids=[A])
    assert sampler.sample(peak(vocab, [C, D])[None], [0]).token_ids.tolist() == [D]
    sampler.add_request(1, SamplingParams(temperature=0.0, bad_words_token_ids=[(1, 2, 3, C), (A, D)]), [],
                        output_token_ids=[1, 2, 3])
    assert underlying(sampler)[0].state.history_depth == 3
    logits = torch.stack([peak(vocab, [A]), peak(vocab, [C, D, E])])
    assert sampler.sample(logits, [0, 1]).token_ids.tolist() == [A, D]  # slot 1: C banned; D kept ([3] != [A])
    assert sampler.sample(peak(vocab, [C, D])[None], [0]).token_ids.tolist() == [D]  # slot 0 ends [.., A]


def random_bad_words_case(backend: str, case_seed: int) -> None:
    """Mixed rows (greedy, sampled, penalties, logprobs), bad words built from the rows' own
    outputs and likely tokens, a token bitmask on some steps; four steps against the reference."""
    rnd = random.Random(case_seed)
    gen = torch.Generator().manual_seed(case_seed)
    vocab = rnd.choice([40, 97, 130])
    padded = -(-(vocab + rnd.choice([0, 7])) // 6) * 6
    batch = rnd.randint(2, 5)
    mode = dc.MODES[case_seed % 4]
    sampler = make_sampler(backend, vocab, max_slots=batch, padded_vocab_size=padded, logprobs_mode=mode)
    requests = []
    hot = rnd.sample(range(vocab), 6)  # the tokens the logits favour
    for b in range(batch):
        outputs = [rnd.choice(hot) for _ in range(rnd.choice([0, 1, 3]))]
        last = outputs[-2:] if outputs else []
        words = [(rnd.choice(hot),), (*last, rnd.choice(hot)), (rnd.choice(hot), rnd.choice(hot)),
                 (rnd.choice(hot), rnd.choice(hot), rnd.choice(hot))][:rnd.randint(1, 4)]
        params = SamplingParams(temperature=rnd.choice([0.0, 0.7, 1.2]), top_k=rnd.choice([0, 3]),
                                seed=rnd.randrange(2**63), logprobs=rnd.choice([None, 0, 3]),
                                repetition_penalty=rnd.choice([1.0, 1.3]), bad_words_token_ids=words)
        prompt = [rnd.choice(hot) for _ in range(3)]
        seed = sampler.add_request(b, params, prompt, output_token_ids=outputs)
        requests.append(ReferenceRequest(params, seed, len(prompt) + len(outputs), prompt, list(outputs)))
    for step in range(4):
        logits = torch.randn(batch, padded, generator=gen)
        logits[:, hot] += 4.0
        logits[:, vocab:] = 1e4
        dtype = rnd.choice([torch.float32, torch.bfloat16])
        mask = dc.random_bitmask(rnd, batch, vocab) if step == 2 else None
        allowed = None
        if mask is not None:
            from tokensampler.reference import bitmask_allowed_ids
            allowed = bitmask_allowed_ids(mask, vocab)
        got = sampler.sample(logits.to(dtype), token_bitmask=mask)
        want = reference_sample(logits.to(dtype), requests, vocab_size=vocab, logprobs_mode=mode, allowed=allowed)
        assert not dc.compare(f"{backend} seed {case_seed} step {step}", got, want)
        for req, token in zip(requests, want.token_ids.tolist()):
            req.output_token_ids.append(token)
            req.position += 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case_seed", range(3))
def test_random_batches_with_bad_words_match_the_reference(backend, case_seed):
    if backend == "kernels":
        pytest.importorskip("triton")
    random_bad_words_case(backend, 10 * case_seed + BACKENDS.index(backend))


def test_direct_route_bans_in_place_and_restores_the_logits(monkeypatch):
    """Float32 rows with bad words (and penalties) take the direct route: -inf is written at the
    banned ids of the caller's logits and the original values are back after the call."""
    from tokensampler.backends.torch_step import candidates
    from tokensampler.backends.torch_step.routes import Values
    seen = []
    real = candidates.sample_rows
    monkeypatch.setattr(candidates, "sample_rows", lambda *a, **k: seen.append(
        k.get("values", Values.IN_PLACE) is Values.IN_PLACE) or real(*a, **k))
    from tokensampler.tools.workloads import make_logits
    vocab = 20000
    logits = make_logits(3, vocab, seed=2)  # peaked rows: a candidate list (flat rows need the block route)
    top = logits.topk(2, dim=-1).indices.tolist()
    before = logits.clone()
    params = [SamplingParams(temperature=0.6, seed=1, bad_words_token_ids=[(top[0][0],)]),
              SamplingParams(temperature=0.6, seed=2, bad_words_token_ids=[(7, top[1][0])], presence_penalty=1.0),
              SamplingParams(temperature=0.0, bad_words_token_ids=[(top[2][0],), (top[2][1],)])]
    sampler = Sampler(vocab, max_slots=3)
    outputs = [[], [7], []]
    for slot, p in enumerate(params):
        sampler.add_request(slot, p, [1], output_token_ids=outputs[slot])
    got = sampler.sample(logits)
    assert seen == [False] and torch.equal(logits, before)
    requests = [ReferenceRequest(p, p.seed or 0, 1 + len(o), [1], o) for p, o in zip(params, outputs)]
    want = reference_sample(logits, requests)
    assert got.token_ids.tolist() == want.token_ids.tolist()
    assert got.token_ids[0] != top[0][0] and got.token_ids[1] != top[1][0] and got.token_ids[2] not in top[2]


# ------------------------------------------------------------------ the state
def test_recent_tokens_are_updated_on_the_device_by_record_tokens():
    sampler = Sampler(50, max_slots=3)
    sampler.add_request(0, SamplingParams(bad_words_token_ids=[(1, 2, 3)]), [9, 9], output_token_ids=[4])
    sampler.add_request(1, SamplingParams(), [], output_token_ids=[5, 6, 7])
    st = sampler.state
    assert st.recent_tokens.tolist()[:2] == [[-2, 4], [6, 7]]
    st.record_tokens(torch.tensor([1, 0]), torch.tensor([8, 10]))
    assert st.recent_tokens.tolist()[:2] == [[4, 10], [7, 8]]
    st.record_tokens(torch.tensor([0, 1]), torch.tensor([11, 12]), torch.tensor([False, True]))
    assert st.recent_tokens.tolist()[:2] == [[4, 10], [8, 12]]
    st.rebuild_history(torch.tensor([0, 1]), None, torch.tensor([[3, -1, -1, -1], [-1, 1, 2, 3]]))
    assert st.recent_tokens.tolist()[:2] == [[-2, 3], [2, 3]]
    assert st.bad_words.tolist()[0] == [[1, 2, 3]]


def test_bad_words_are_checked_at_construction_and_admission():
    for bad in ([[]], [1, 2], "ab", [[1, -2]], [[1.5]], [["a"]], 3):
        with pytest.raises(InvalidSamplingParams) as err:
            SamplingParams(bad_words_token_ids=bad)
        assert err.value.field == "bad_words_token_ids"
    assert SamplingParams(bad_words_token_ids=[[1, 2], (3,)]).bad_words_token_ids == ((1, 2), (3,))
    assert SamplingParams(bad_words_token_ids=None).bad_words_token_ids == ()
    sampler = Sampler(10, max_slots=1)
    with pytest.raises(InvalidSamplingParams) as err:
        sampler.add_request(0, SamplingParams(bad_words_token_ids=[[1, 10]]), [])
    assert (err.value.field, err.value.value) == ("bad_words_token_ids", 10)
    assert sampler.state.bad_words is None and sampler.state.params[0] is None


def test_batch_params_carry_bad_words_stop_and_ignore_eos():
    requests = [SamplingParams(bad_words_token_ids=[(1, 2)], stop=("x",), ignore_eos=True), SamplingParams()]
    batch = BatchSamplingParams.from_requests(requests)
    assert {"bad_words_token_ids", "stop", "ignore_eos"} <= set(batch.per_lane_fields())
    assert batch.to_requests() == requests
    formatted = format_sampling_params(batch, 3)
    assert formatted.to_requests()[:2] == requests and formatted.to_requests()[2].bad_words_token_ids == ()
    scalar = BatchSamplingParams(bad_words_token_ids=[[4], [5, 6]], stop=["a", "b"], temperature=[0.5, 1.0])
    assert scalar.per_lane_fields() == ["temperature"]
    assert all(p.bad_words_token_ids == ((4,), (5, 6)) and p.stop == ("a", "b") for p in scalar.to_requests())
    placed = scatter_sampling_params_to_slots(BatchSamplingParams(bad_words_token_ids=[[[3]]], stop=[["z"]]), [1], 2)
    assert placed.to_requests()[1].bad_words_token_ids == ((3,),) and placed.to_requests()[0].stop == ()


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_row_the_bad_words_empty_gets_its_raw_greedy_id(temperature):
    """Float32 rows with bad words qualify for the direct route; a row whose every id the bad words
    remove has no id left: the probe's fact sends the call to the block route, which gives it the
    first maximum of its raw logits (valid False), as the definition does; the logits are unchanged."""
    from tokensampler.tools.workloads import make_logits
    vocab = 5000
    logits = make_logits(2, vocab, seed=4)
    logits[0] = NEG_INF
    logits[0, 7], logits[0, 11] = 1.0, 2.0
    before = logits.clone()
    params = [SamplingParams(temperature=temperature, seed=1, bad_words_token_ids=[(7,), (11,)]),
              SamplingParams(temperature=0.6, seed=2, bad_words_token_ids=[(3,)])]
    sampler = Sampler(vocab, max_slots=2)
    for slot, p in enumerate(params):
        sampler.add_request(slot, p, [1])
    got = sampler.sample(logits)
    assert torch.equal(logits, before)
    want = reference_sample(logits, [ReferenceRequest(p, p.seed or 0, 1, [1], []) for p in params])
    assert got.token_ids.tolist() == want.token_ids.tolist() and got.token_ids[0] == 11
    assert got.valid.tolist() == want.valid.tolist() == [False, True]
