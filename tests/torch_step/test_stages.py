"""backends/torch_step/stages.py: one implementation per stage of the definition.

The registry matches the plan's flags (a flag without a stage, or a stage without a flag, fails
here); the composed edits give reference.py's z after step 5 (greedy rows: the oracle's processed
logits; equal values, up to the sign of a zero), with every edit, bad words on the recorded output
and a token bitmask; the cell form (the direct route's) writes the same values and puts the
caller's logits back bit for bit; `filter_columns` carries the rows' parameters.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tests.support.bitmask import pack_bits
from tests.support.speculative_cases import random_logits
from tokensampler import Sampler, SamplingParams
from tokensampler.backends.torch_step import masking, stages
from tokensampler.core import rng
from tokensampler.core.plan import EDIT_STAGES, FILTER_STAGES, StepPlan, plan_step
from tokensampler.reference import ReferenceRequest, reference_sample_row


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


# ------------------------------------------------------------------ the registry and the plan
def test_every_plan_flag_is_a_stage_with_one_implementation():
    flags = {f.name for f in dataclasses.fields(StepPlan) if f.type in ("bool", bool)}
    assert flags == (set(EDIT_STAGES) - {"token_bitmask"}) | set(FILTER_STAGES)
    assert tuple(stages.EDITS) == EDIT_STAGES  # the definition's order
    assert set(stages.CELL_EDITS) <= set(stages.EDITS)
    assert len(set(stages.EDITS.values())) == len(stages.EDITS)


def test_plan_lists_the_stages_its_rows_need_in_order():
    rows = [SamplingParams(temperature=0.0, repetition_penalty=1.2, bad_words_token_ids=[[1]]),
            SamplingParams(temperature=0.7, top_p=0.9, min_p=0.1, logit_bias={2: 1.0}, dry_multiplier=0.5),
            SamplingParams(temperature=0.0, top_k=3, min_tokens=2, stop_token_ids=(4,), allowed_token_ids=[1, 2])]
    plan = plan_step(rows, 10)
    assert plan.edits() == ("allowed_ids", "bad_words", "min_tokens", "logit_bias", "penalties", "dry")
    assert plan.edits(token_bitmask=True) == EDIT_STAGES
    assert "dry" not in plan_step(rows[:1], 10).edits()
    assert plan.filters == ("min_p", "top_p")  # top-k only on a greedy row: ignored
    assert plan_step([SamplingParams(temperature=0.0)], 10).edits() == ()
    assert plan_step([SamplingParams(temperature=0.0)], 10).plain_greedy
    assert not plan_step([SamplingParams(temperature=0.0, logit_bias={1: 2.0})], 10).plain_greedy


# ------------------------------------------------------------------ the edits against the oracle
def random_case(seed: int):
    """A sampler holding greedy rows with every edit (allowed ids, bad words matching the output or
    not, stop and EOS ids below min_tokens, bias, the three penalties), their histories, a bitmask,
    and logits with NaN, +inf, -inf and padding."""
    rnd = random.Random(seed)
    vocab = rnd.choice([5, 40, 300])
    padded = vocab + rnd.choice([0, 3])
    batch = rnd.randint(1, 7)
    eos = (rnd.randrange(vocab),)
    params, prompts, outputs = [], [], []
    for _ in range(batch):
        fields: dict = {"temperature": 0.0}
        if rnd.random() < 0.5:
            fields.update(repetition_penalty=rnd.choice([0.8, 1.5]), frequency_penalty=rnd.choice([0.0, 0.6, -0.3]),
                          presence_penalty=rnd.choice([0.0, 1.0]))
        if rnd.random() < 0.4:
            fields["logit_bias"] = {rnd.randrange(vocab): rnd.choice([-100.0, -2.5, 3.0]) for _ in range(3)}
        if rnd.random() < 0.3:
            fields["allowed_token_ids"] = tuple(rnd.sample(range(vocab), k=min(vocab, rnd.randint(1, 6))))
        if rnd.random() < 0.4:
            fields.update(min_tokens=rnd.randint(1, 4), stop_token_ids=(rnd.randrange(vocab),))
        words = []
        if rnd.random() < 0.6:
            words = [[rnd.randrange(vocab)]] + [[rnd.randrange(vocab) for _ in range(rnd.randint(2, 3))]
                                                for _ in range(2)]
            fields["bad_words_token_ids"] = words
        params.append(SamplingParams(**fields))
        prompts.append([rnd.randrange(vocab) for _ in range(rnd.randrange(5))])
        multi = [w for w in words if len(w) > 1]
        outputs.append(list(rnd.choice(multi)[:-1]) if multi and rnd.random() < 0.6
                       else [rnd.randrange(vocab) for _ in range(rnd.randrange(4))])
    sampler = Sampler(vocab, max_slots=batch + 2, padded_vocab_size=padded, eos_token_ids=eos)
    slots = rnd.sample(range(batch + 2), batch)
    for b, slot in enumerate(slots):
        sampler.add_request(slot, params[b], prompts[b], output_token_ids=outputs[b])
    allowed = [set(range(vocab)) - set(rnd.sample(range(vocab), rnd.randint(0, vocab // 2))) for _ in range(batch)]
    bitmask = pack_bits(allowed, -(-vocab // 32) + rnd.choice([0, 1])) if rnd.random() < 0.7 else None
    logits = random_logits(rnd, batch, 1, vocab, padded)[:, 0]
    requests = [ReferenceRequest(params[b], sampler.seed_of(slots[b]), 0, prompts[b], outputs[b], 0, eos)
                for b in range(batch)]
    return sampler, slots, params, logits, bitmask, allowed, requests, vocab


def edited(sampler, slots, params, logits, bitmask, vocab) -> torch.Tensor:
    z = stages.clean_logits(torch.empty((len(slots), vocab)), logits)
    rows = stages.StageRows(sampler.state, torch.tensor(slots), params, bitmask)
    stages.apply_edits(z, rows, plan_step(params, vocab).edits(bitmask is not None))
    return masking.saturate_posinf(z)


@pytest.mark.parametrize("case", range(30))
def test_composed_edits_are_the_oracles_z_after_step_5(case):
    sampler, slots, params, logits, bitmask, allowed, requests, vocab = random_case(case)
    got = edited(sampler, slots, params, logits, bitmask, vocab)
    for b, request in enumerate(requests):
        mask = None if bitmask is None else allowed[b]
        want = reference_sample_row(logits[b], request, vocab, "processed_logits", mask)[2][1]
        # equal values; the sign of a zero may differ: the oracle subtracts f * 0 and p * 0 at ids
        # never seen (-0 - (-0) = +0 for a negative f or p), the stage leaves those ids alone
        assert torch.equal(got[b], want), (case, b, got[b], want)


def test_each_edit_changes_what_the_definition_says():
    """One edit at a time on a hand-built row: which ids it removes and what it adds."""
    vocab = 6
    params = SamplingParams(temperature=0.0, allowed_token_ids=[0, 1, 2, 3, 4], bad_words_token_ids=[[1], [5, 2]],
                            min_tokens=3, stop_token_ids=(3,), logit_bias={0: 2.0}, repetition_penalty=2.0,
                            frequency_penalty=0.5)
    sampler = Sampler(vocab, max_slots=1)
    sampler.add_request(0, params, [4], output_token_ids=[5, 0])  # the output does not end with 5: id 2 stays
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    rows = stages.StageRows(sampler.state, torch.tensor([0]), [params], pack_bits([{0, 1, 2, 3, 4}], 1))
    want = {"allowed_ids": [1, 2, 3, 4, 5, NEG], "token_bitmask": [1, 2, 3, 4, 5, NEG],
            "bad_words": [1, NEG, 3, 4, 5, 6], "min_tokens": [1, 2, 3, NEG, 5, 6],
            "logit_bias": [3, 2, 3, 4, 5, 6],
            # id 4 seen in the prompt: 5 / 2; ids 5 and 0 in the output: (z / 2) - 0.5
            "penalties": [0.0, 2, 3, 4, 2.5, 2.5]}
    for name, row in want.items():
        z = stages.clean_logits(torch.empty(1, vocab), logits)
        stages.EDITS[name](z, rows)
        assert z[0].tolist() == row, name


NEG = float("-inf")


# ------------------------------------------------------------------ the cell form
@pytest.mark.parametrize("case", range(30))
def test_cell_edits_write_the_same_values_and_restore_the_callers_logits(case):
    sampler, slots, params, logits, _, _, _, vocab = random_case(100 + case)
    params = [dataclasses.replace(p, allowed_token_ids=None, logit_bias=None, min_tokens=0) for p in params]
    for b, slot in enumerate(slots):
        sampler.set_params([slot], [params[b]])
    names = plan_step(params, vocab).edits()
    assert set(names) <= set(stages.CELL_EDITS)
    logits = logits.nan_to_num(nan=0.0)[:, :vocab].contiguous()  # the direct route's rows: no NaN
    before = logits.clone()
    want = stages.apply_edits(logits.clone(), stages.StageRows(sampler.state, torch.tensor(slots), params), names)
    undo = stages.edit_cells(logits, stages.StageRows(sampler.state, torch.tensor(slots), params), names)
    assert torch.equal(bits(logits), bits(want))
    stages.restore_cells(logits, undo)
    assert torch.equal(bits(logits), bits(before))


def test_cell_edits_restore_an_id_that_is_both_banned_and_penalised():
    sampler = Sampler(4, max_slots=1)
    params = SamplingParams(temperature=1.0, bad_words_token_ids=[[2]], repetition_penalty=2.0, frequency_penalty=1.0)
    sampler.add_request(0, params, [2], output_token_ids=[2, 1])
    logits = torch.tensor([[1.0, 3.0, 5.0, -1.0]])
    rows = stages.StageRows(sampler.state, torch.tensor([0]), [params])
    undo = stages.edit_cells(logits, rows, ("bad_words", "penalties"))
    assert logits.tolist() == [[1.0, 0.5, NEG, -1.0]]
    stages.restore_cells(logits, undo)
    assert logits.tolist() == [[1.0, 3.0, 5.0, -1.0]]


# ------------------------------------------------------------------ the filters' columns
def test_filter_columns_carry_the_rows_parameters_and_noise_keys():
    sampler = Sampler(10, max_slots=3)
    rows = [SamplingParams(temperature=0.5, top_k=3, seed=1), SamplingParams(temperature=1.5, top_p=0.8, seed=2),
            SamplingParams(temperature=1.0, min_p=0.2, seed=3)]
    for slot, p in zip([2, 0, 1], rows):
        sampler.add_request(slot, p, [1, 2])
    slots = torch.tensor([2, 0, 1])
    cols = stages.filter_columns(sampler.state, slots[:2], rows[:2])
    assert cols.temperature.tolist() == [0.5, 1.5] and cols.top_k.tolist() == [3, 0]
    assert cols.top_p.tolist() == [1.0, 0.8] and cols.min_p.tolist() == [0.0, 0.0]
    assert (cols.any_min_p, cols.any_top_k, cols.any_top_p) == (False, True, True)
    st = sampler.state
    assert torch.equal(cols.keys, rng.row_key(st.seed[slots[:2]], st.position[slots[:2]], st.stream[slots[:2]]))
    assert stages.filter_columns(sampler.state, slots, rows).any_min_p


# ------------------------------------------------------------------ the kernels' hand-off
def test_a_stage_without_a_kernel_mirror_is_handed_to_the_torch_step(monkeypatch):
    from tokensampler.backends.triton import config as kernel_config

    monkeypatch.setenv("TOKENSAMPLER_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not kernel_config.triton_available():
        pytest.skip("Triton is not installed")
    sampler = Sampler(10, max_slots=2)
    sampler.add_request(0, SamplingParams(temperature=0.0, bad_words_token_ids=[[1]]), [])
    sampler.add_request(1, SamplingParams(temperature=0.7, top_k=3), [])
    logits = torch.randn(1, 10)
    with_words, without = plan_step([sampler.params_of(0)], 10), plan_step([sampler.params_of(1)], 10)
    backends = sampler.backends
    assert backends.choose(logits, with_words) is backends.kernels  # every stage is mirrored today
    monkeypatch.setattr(kernel_config, "KERNEL_STAGES", kernel_config.KERNEL_STAGES - {"bad_words"})
    assert backends.choose(logits, with_words) is backends.torch_step
    assert backends.choose(logits, without) is backends.kernels
    monkeypatch.setattr(kernel_config, "KERNEL_STAGES", kernel_config.KERNEL_STAGES - {"top_k"})
    assert backends.choose(logits, without) is backends.torch_step
