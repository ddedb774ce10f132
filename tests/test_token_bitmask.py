"""`Sampler.sample(..., token_bitmask=...)`: a grammar's int32 bitmask (xgrammar's layout) removes, for
one step, every id whose bit is 0 (step 3 of docs/semantics.md).

On every backend (tests/support/backends.py: the CPU step on both routes, the Triton kernels in the
interpreter, the vocabulary split over 2 and 3 thread ranks): random batches (vocabularies with
padding, fp32/bf16/fp16, mixed parameters, seeds) give the reference's tokens and logprobs with the
mask as an allowed set, the same tokens as the same ids given as allowed_token_ids, the mask applies
to that step only, and a row the mask empties is invalid with its raw greedy id (never a padded id).
Plus the layout pinned to xgrammar's own masks, the bit unpacking, and the argument checks.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

import tests.support.split_cases as dc
from tests.support.backends import BACKENDS, make_sampler
from tests.support.bitmask import pack_bits as pack
from tokensampler import InvalidSamplingParams, Sampler, SamplingParams, sample
from tokensampler.backends.torch_step import masking
from tokensampler.reference import ReferenceRequest, bitmask_allowed_ids, reference_sample

NEG_INF = float("-inf")
MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# the Triton interpreter evaluates both sides of every tl.where (log(0), inf - inf in discarded lanes)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def random_mask_sets(rnd: random.Random, vocab: int, batch: int) -> list[set[int]]:
    """Per row: a few ids, most ids, every id, none, one id, or the ids 31 / 63 (bit 31: the sign bit)."""
    sets = []
    for _ in range(batch):
        kind = rnd.choice(["few", "few", "most", "all", "none", "one", "sign"])
        if kind == "few":
            sets.append(set(rnd.sample(range(vocab), min(vocab, rnd.randint(2, 12)))))
        elif kind == "most":
            sets.append(set(range(vocab)) - set(rnd.sample(range(vocab), vocab // 3)))
        elif kind == "all":
            sets.append(set(range(vocab)))
        elif kind == "none":
            sets.append(set())
        elif kind == "one":
            sets.append({rnd.randrange(vocab)})
        else:
            sets.append({i for i in (31, 63, 95) if i < vocab} | {rnd.randrange(vocab)})
    return sets


def random_params(rnd: random.Random, vocab: int) -> SamplingParams:
    """Mixed rows without allowed ids: greedy or sampled, filters, penalties, bias, min_tokens, logprobs."""
    kw: dict = {"seed": rnd.randrange(2**64), "temperature": rnd.choice([0.0, 0.5, 1.0, 1.0, 1.7])}
    kw["top_k"] = rnd.choice([0, 0, 1, 3, 20])
    kw["top_p"] = rnd.choice([1.0, 1.0, 0.3, 0.9])
    kw["min_p"] = rnd.choice([0.0, 0.0, 0.1])
    if rnd.random() < 0.4:
        kw.update(repetition_penalty=rnd.choice([0.7, 1.3]), frequency_penalty=rnd.choice([0.0, 0.5]),
                  presence_penalty=rnd.choice([0.0, -1.0, 1.0]))
    if rnd.random() < 0.3:
        kw["logit_bias"] = {rnd.randrange(vocab): rnd.choice([-100.0, 3.0, 100.0]) for _ in range(2)}
    if rnd.random() < 0.3:
        kw.update(min_tokens=rnd.choice([1, 5]), stop_token_ids=rnd.sample(range(vocab), 2))
    kw["logprobs"] = rnd.choice([None, None, 0, 2, 5])
    return SamplingParams(**kw)


def random_logits(rnd: random.Random, gen: torch.Generator, batch: int, vocab: int, padded: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Gaussian, tied, LLM-like and holey rows; the padding columns hold huge values, so a padded id
    returned cannot go unnoticed."""
    rows = []
    for _ in range(batch):
        kind = rnd.choice(["gauss", "ties", "llm", "holes"])
        row = torch.randn(vocab, generator=gen) * rnd.choice([0.5, 3.0])
        if kind == "ties":
            row = torch.randint(0, 4, (vocab,), generator=gen).float()
        elif kind == "llm":
            row = 12.0 - 2.0 * torch.log(torch.randperm(vocab, generator=gen).float() + 1.0)
        elif kind == "holes":
            holes = torch.randint(0, vocab, (vocab // 3,), generator=gen)
            row[holes[: vocab // 6]] = float("nan")
            row[holes[vocab // 6:]] = NEG_INF
        rows.append(torch.cat([row, torch.full((padded - vocab,), 1e4)]))
    return torch.stack(rows).to(dtype)


def with_allowed(params: SamplingParams, ids: set[int]) -> SamplingParams:
    return dataclasses.replace(params, allowed_token_ids=tuple(sorted(ids))) if ids else params


# ------------------------------------------------------------------------------ the layout
def test_packing_matches_xgrammar_and_bit_31_is_the_sign_bit():
    xgr = pytest.importorskip("xgrammar")
    vocab = 100
    words = xgr.get_bitmask_shape(1, vocab)[1]
    info = xgr.TokenizerInfo([f"<{i}>" for i in range(vocab)], stop_token_ids=[0])
    compiled = xgr.GrammarCompiler(info).compile_grammar('root ::= "<31>" | "<63>" | "<5>" | "<95>"')
    mask = xgr.allocate_token_bitmask(1, vocab)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask, 0)
    allowed = bitmask_allowed_ids(mask, vocab)[0]
    assert {31, 63, 95, 5} <= allowed and len(allowed) < 20
    assert torch.equal(mask, pack([allowed], words)) and int(mask[0, 0]) < 0  # id 31: the sign bit
    # the sampler keeps exactly the ids xgrammar's own apply_token_bitmask_inplace keeps
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0))
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, mask)
    out = sample(logits, SamplingParams(temperature=0.0, logprobs=-1), logprobs_mode="processed_logits",
                 token_bitmask=mask)
    kept = set(out.logprobs.top_token_ids[0][out.logprobs.top_logprobs[0] > NEG_INF].tolist())
    assert kept == set(torch.nonzero(theirs[0] > NEG_INF).squeeze(-1).tolist()) == allowed


@pytest.mark.parametrize("start, width", [(0, 100), (0, 64), (31, 70), (40, 24), (96, 40), (120, 30), (7, 1)])
def test_bitmask_removed_reads_the_bits_of_any_column_range(start, width):
    gen = torch.Generator().manual_seed(start + width)
    mask = torch.randint(-(2**31), 2**31, (3, 4), generator=gen, dtype=torch.int64).to(torch.int32)
    want = torch.zeros(3, width, dtype=torch.bool)
    for b in range(3):
        for c in range(width):
            i = start + c
            want[b, c] = i >= 128 or not ((int(mask[b, i // 32]) & 0xFFFFFFFF) >> (i % 32)) & 1
    assert torch.equal(masking.bitmask_removed(mask, start, width), want)
    assert torch.equal(masking.bitmask_removed(mask, start, width, invert=False), ~want)


def test_torch_unpack_equals_numpy_unpack(monkeypatch):
    """The shift-based unpack (non-CPU tensors, big-endian hosts) gives the same bits."""
    mask = torch.randint(-(2**31), 2**31, (4, 6), generator=torch.Generator().manual_seed(3),
                         dtype=torch.int64).to(torch.int32)
    want = masking.bitmask_removed(mask, 13, 170)
    monkeypatch.setattr(masking.sys, "byteorder", "big")
    assert torch.equal(masking.bitmask_removed(mask, 13, 170), want)


@pytest.mark.parametrize("density", [0.003, 0.05, 0.5, 1.0])
@pytest.mark.parametrize("start, width", [(0, 5000), (0, 4993), (3, 700), (64, 1000), (4990, 30), (13, 1)])
def test_table_lookup_removal_equals_masked_fill(density, start, width, monkeypatch):
    """The +-inf table with `minimum` (numpy row by row, torch with a buffer, a few rows at a time)
    removes exactly the ids `bitmask_removed` names, +inf included, and skips all-ones rows; any
    column offset."""
    monkeypatch.setattr(masking, "SPREAD_ELEMENTS", 2 * width)  # the torch lookup: 1-2 rows per chunk
    gen = torch.Generator().manual_seed(int(density * 1000) + start)
    z = torch.randn(5, width, generator=gen)
    z[1, :: 7] = float("inf")
    z[2, :10] = NEG_INF
    allowed = [set(torch.nonzero(torch.rand(5024, generator=gen) < density).squeeze(-1).tolist()) for _ in range(4)]
    mask = pack(allowed + [set(range(5024))], 157)  # the last row allows everything: skipped
    want = z.masked_fill(masking.bitmask_removed(mask, start, width), NEG_INF)
    assert torch.equal(masking.remove_by_bitmask(z.clone(), mask, start), want)
    buffers = []
    buffer = lambda n: buffers.append(n) or torch.empty(n)
    assert torch.equal(masking.remove_by_bitmask(z.clone(), mask, start, buffer=buffer), want)
    assert torch.equal(masking.remove_by_bitmask(z[:4].clone(), mask[:4], start, buffer=buffer), want[:4])
    assert bool(buffers) == (start % 8 == 0 and density < 1.0)  # the torch lookup: every row masked, aligned
    assert torch.equal(masking.remove_by_bitmask(z[4:].clone(), mask[4:], start, buffer=buffer), z[4:])


# ------------------------------------------------------------------------------ random batches, every backend
def run_case(backend: str, case_seed: int) -> None:
    rnd = random.Random(case_seed)
    gen = torch.Generator().manual_seed(case_seed)
    vocab = rnd.choice([37, 64, 97, 150, 203])
    padded = -(-(vocab + rnd.choice([0, 5, 30])) // 6) * 6  # divisible by 2 and 3 ranks
    words = -(-vocab // 32) + rnd.choice([0, 0, 2])
    batch = rnd.randint(2, 6)
    max_slots = batch + 2
    slots = rnd.sample(range(max_slots), batch)
    mode = MODES[case_seed % 4]
    dtype = rnd.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16])
    eos = (rnd.randrange(vocab),)
    params = [random_params(rnd, vocab) for _ in range(batch)]
    prompts = [[rnd.randrange(vocab) for _ in range(rnd.choice([0, 4]))] for _ in range(batch)]
    outputs = [[rnd.randrange(vocab) for _ in range(rnd.choice([0, 3]))] for _ in range(batch)]
    sets = random_mask_sets(rnd, vocab, batch)
    padding_bits = [set(range(vocab, 32 * words)) if rnd.random() < 0.7 else set() for _ in range(batch)]
    mask = pack(sets, words, padding_bits)  # bits of padded ids set: they must be ignored
    kw = dict(max_slots=max_slots, padded_vocab_size=padded, logprobs_mode=mode, eos_token_ids=eos)
    masked = make_sampler(backend, vocab, **kw)
    twin = make_sampler(backend, vocab, **kw)  # the same ids as allowed_token_ids
    requests = []
    for b in range(batch):
        seed = masked.add_request(slots[b], params[b], prompts[b], output_token_ids=outputs[b])
        twin.add_request(slots[b], with_allowed(params[b], sets[b]), prompts[b], output_token_ids=outputs[b])
        requests.append(ReferenceRequest(params[b], seed, len(prompts[b]) + len(outputs[b]), prompts[b],
                                         list(outputs[b]), 0, eos))
    for step in range(3):
        logits = random_logits(rnd, gen, batch, vocab, padded, dtype)
        step_mask = mask if step == 0 else None  # the mask applies to its own step only
        got = masked.sample(logits, slots, token_bitmask=step_mask)
        want = reference_sample(logits, requests, vocab_size=vocab, logprobs_mode=mode,
                                allowed=sets if step == 0 else None)
        assert not dc.compare(f"{backend} case {case_seed} step {step}", got, want)
        assert bool((got.token_ids < vocab).all())
        if step == 0:
            same = twin.sample(logits, slots)
            for b in range(batch):
                if sets[b]:
                    assert int(same.token_ids[b]) == int(got.token_ids[b]), (b, sets[b])
                    assert int(got.token_ids[b]) in sets[b] or not bool(got.valid[b])
                else:  # emptied: invalid, the raw greedy id of the real ids
                    assert not bool(got.valid[b]) and int(got.token_ids[b]) < vocab
        for req, token in zip(requests, want.token_ids.tolist()):
            req.output_token_ids.append(token)
            req.position += 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case_seed", range(4))
def test_bitmask_equals_allowed_ids_and_reference(backend, case_seed):
    if backend == "kernels":
        pytest.importorskip("triton")
    run_case(backend, 100 * case_seed + BACKENDS.index(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_row_is_invalid_and_never_a_padded_id(backend):
    """Every real id's bit 0, every padding bit 1 (and huge padded logits): the row is invalid and
    returns the raw greedy id of the real ids; the other rows are unaffected."""
    if backend == "kernels":
        pytest.importorskip("triton")
    vocab, padded = 100, 132
    logits = torch.full((3, padded), 1e4)
    logits[:, :vocab] = torch.arange(vocab, dtype=torch.float32).flip(0) / 10  # raw greedy id: 0
    logits[1, 40] = 50.0
    sets = [set(), set(), {70, 80}]
    mask = pack(sets, 5, [set(range(vocab, 160))] * 3)
    sampler = make_sampler(backend, vocab, max_slots=3, padded_vocab_size=padded)
    for slot, temperature in enumerate([0.0, 0.8, 0.8]):
        sampler.add_request(slot, SamplingParams(temperature=temperature, seed=slot, top_p=0.9), [])
    out = sampler.sample(logits, token_bitmask=mask)
    assert out.valid.tolist() == [False, False, True]
    assert out.token_ids.tolist()[:2] == [0, 40] and int(out.token_ids[2]) in (70, 80)
    after = sampler.sample(logits)  # the next step has no mask: row 1's maximum, 40
    assert after.valid.tolist() == [True, True, True] and int(after.token_ids[1]) == 40


def test_llm_sized_rows_sparse_mask_both_routes():
    """LLM-shaped rows at a large vocabulary, a grammar-like sparse mask (the block's sparse copy)
    and a dense one, on the direct-route and block-route samplers: the reference's tokens."""
    from tokensampler.backends.torch_step.config import TorchStepConfig
    from tokensampler.tools.workloads import make_bitmask, make_logits
    vocab = 40000
    logits = make_logits(4, vocab, seed=9)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, logprobs=2) for s in range(4)]
    for mask in (make_bitmask(logits, 700), make_bitmask(logits, 30000)):
        allowed = bitmask_allowed_ids(mask, vocab)
        requests = [ReferenceRequest(p, p.seed, 0) for p in params]
        want = reference_sample(logits, requests, vocab_size=vocab, allowed=allowed)
        for direct in (True, False):
            sampler = Sampler(vocab, max_slots=4, step_config=TorchStepConfig(direct_route=direct))
            for slot, p in enumerate(params):
                sampler.add_request(slot, p, [])
            assert not dc.compare("llm rows", sampler.sample(logits, token_bitmask=mask), want)


@pytest.mark.parametrize("mode", MODES)
def test_sparse_masks_with_every_stage_match_the_reference(mode, monkeypatch):
    """Every row allows few ids (the grammar's usual), with greedy, top-k, top-p, min-p, penalised,
    tied and tiny-temperature rows, id 0 kept and removed, an emptied row, and the whole processed
    row compared (logprobs = V); the mask goes through the table lookup of the block route."""
    calls = []
    real = masking.remove_by_bitmask
    monkeypatch.setattr(masking, "remove_by_bitmask", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    rnd = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    vocab, padded, batch = 300, 304, 8
    logits = random_logits(rnd, gen, batch, vocab, padded, torch.float32)
    logits[3, :vocab] = torch.round(logits[3, :vocab])  # ties among the kept ids
    params = [SamplingParams(temperature=0.0, logprobs=vocab),
              SamplingParams(temperature=0.7, top_k=2, seed=1, logprobs=vocab),
              SamplingParams(temperature=1.0, top_p=0.6, seed=2, logprobs=vocab),
              SamplingParams(temperature=1.3, min_p=0.2, seed=3, logprobs=vocab),
              SamplingParams(temperature=0.9, seed=4, repetition_penalty=1.5, presence_penalty=1.0, logprobs=vocab),
              SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=vocab),
              SamplingParams(temperature=1e-3, seed=5, logprobs=vocab), SamplingParams(temperature=1.0, seed=6)]
    sets = [{0, 5, 17, 250}, set(range(0, 300, 11)), {1, 2, 3, 299}, {0}, set(range(40, 72)), {6, 7}, {8, 200}, set()]
    mask = pack(sets, 10)
    prompts, outputs = [[5, 17]] * batch, [[0, 250, 5]] * batch
    sampler = Sampler(vocab, max_slots=batch, padded_vocab_size=padded, logprobs_mode=mode, max_logprobs=vocab)
    requests = []
    for b, p in enumerate(params):
        seed = sampler.add_request(b, p, prompts[b], output_token_ids=outputs[b])
        requests.append(ReferenceRequest(p, seed, 5, prompts[b], outputs[b]))
    got = sampler.sample(logits, token_bitmask=mask)
    want = reference_sample(logits, requests, vocab_size=vocab, logprobs_mode=mode, allowed=sets)
    assert calls and not dc.compare(f"sparse masks {mode}", got, want)


def test_stateless_sample_takes_the_mask():
    logits = torch.randn(2, 70, generator=torch.Generator().manual_seed(1))
    mask = pack([{3, 60}, {5}], 3)
    out = sample(logits, SamplingParams(temperature=1.0, seed=4), token_bitmask=mask)
    assert int(out.token_ids[0]) in (3, 60) and int(out.token_ids[1]) == 5


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("bad, field_name", [
    (torch.zeros(2, 3, dtype=torch.int64), "token_bitmask.dtype"),
    (torch.zeros(2, 3, dtype=torch.uint8), "token_bitmask.dtype"),
    (torch.zeros(6, dtype=torch.int32), "token_bitmask.shape"),
    (torch.zeros(3, 3, dtype=torch.int32), "token_bitmask.shape"),
    (torch.zeros(2, 2, dtype=torch.int32), "token_bitmask.shape"),  # 2 words < ceil(70 / 32)
    (torch.zeros(2, 3, dtype=torch.int32, device="meta"), "token_bitmask.device"),
    ([[0, 0, 0], [0, 0, 0]], "token_bitmask"),
])
def test_bad_bitmask_is_rejected_before_any_state_change(bad, field_name):
    sampler = Sampler(70, max_slots=2)
    for slot in range(2):
        sampler.add_request(slot, SamplingParams(seed=slot, frequency_penalty=0.5), [1], output_token_ids=[2])
    positions = sampler.state.position.clone()
    counts = sampler.state.output_counts.clone()
    with pytest.raises(InvalidSamplingParams) as err:
        sampler.sample(torch.randn(2, 70), token_bitmask=bad)
    assert err.value.field == field_name and err.value.allowed
    assert torch.equal(sampler.state.position, positions) and torch.equal(sampler.state.output_counts, counts)


def test_split_rejects_a_bad_mask_on_every_rank():
    """One rank's bad mask: it raises its own error, the others `SplitMismatch`, nothing changes."""
    from tokensampler import SplitMismatch

    def body(exchange):
        sampler = Sampler(61, max_slots=2, padded_vocab_size=64, group=exchange)
        sampler.add_request(0, SamplingParams(seed=1), [])
        good = pack([{5}], 2)
        mine = good.to(torch.int64) if exchange.rank == 1 else good
        logits = torch.randn(1, 32, generator=torch.Generator().manual_seed(exchange.rank))
        try:
            sampler.sample(logits, token_bitmask=mine)
        except InvalidSamplingParams as exc:
            caught = (type(exc).__name__, exc.field)
        else:
            caught = None
        return caught, int(sampler.state.position[0]), int(sampler.sample(logits, token_bitmask=good).token_ids[0])

    results = dc.run_threads(2, body)
    assert results[1][0] == ("InvalidSamplingParams", "token_bitmask.dtype")
    assert results[0][0][0] == SplitMismatch.__name__
    assert [r[1] for r in results] == [0, 0] and [r[2] for r in results] == [5, 5]


def test_reference_unpack_is_literal():
    mask = pack([{0, 31, 32, 69}], 3, [{70, 95}])
    assert bitmask_allowed_ids(mask, 70) == [{0, 31, 32, 69}]
    assert math.ceil(70 / 32) == mask.shape[1]
