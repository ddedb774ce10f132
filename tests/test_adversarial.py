"""The adversarial campaign (tests/support/adversarial/; its command: benchmarks/adversarial.py),
bounded: about 10^6 draws through every path against reference.py, with zero invalid ids,
mismatches and unexpected exceptions; and the bugs it found, each as a regression test.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.support.adversarial.campaign import run_campaign, table
from tests.support.adversarial.cases import make_case
from tests.support.adversarial.findings import Finding
from tokensampler import InvalidSamplingParams, Sampler, SamplingParams, sample
from tokensampler.backends.torch_step.config import TorchStepConfig
from tokensampler.parallel import ThreadExchange, ThreadHub
from tokensampler.reference import ReferenceRequest, reference_sample

# most draws on the torch step (tiny vocabularies, batches up to 16384 rows), a few thousand through
# `sample` and the split, a hundred rows through the Triton kernels in the interpreter (~0.1 s a row)
CI_BUDGET = {"torch": 982_000, "sample": 12_000, "split2": 3_000, "split3": 3_000, "kernels": 120}
CI_SEED = 20261130


def test_bounded_campaign_finds_nothing():
    report = run_campaign(CI_BUDGET, CI_SEED)
    total = report["total"]
    lines = [Finding(**f).line(CI_SEED) for f in report["findings"][:10]]
    message = table(report) + "\n" + "\n".join(lines)
    assert total["draws"] >= 1_000_000, message
    for path, budget in CI_BUDGET.items():
        assert report["paths"][path]["draws"] >= budget, message
    for counter in ("invalid_ids", "mismatches", "other_exceptions", "rejected_valid", "accepted_invalid",
                    "oracle_disagreements", "reference_invalid_ids"):
        assert total[counter] == 0, f"{counter}\n{message}"
    assert report["failures"] == 0, message
    assert total["library_errors"] > 0 and total["reference_rows"] > 1000, message  # invalid input was tried


def test_bounded_campaign_through_the_compiled_step_finds_nothing(monkeypatch):
    """The torch path's CI budget with the samplers compiling (`Sampler(compile=True)`: the fused route
    and the compiled reductions; the campaign above runs them eager). Its case 11 (T = FLT_MAX, a list
    floor overflowing to -inf) crashed the fused route before its noise level was clamped."""
    from tests.support.adversarial import runner
    from tokensampler.backends.torch_step import step as step_module
    monkeypatch.setitem(runner.COMPILE, "compile", True)
    fused_calls = []
    real = step_module.TorchStep._fused_route
    monkeypatch.setattr(step_module.TorchStep, "_fused_route",
                        lambda self, *a, **k: fused_calls.append(1) or real(self, *a, **k))
    report = run_campaign({"torch": CI_BUDGET["torch"]}, CI_SEED)
    total = report["total"]
    message = table(report)
    assert report["paths"]["torch"]["draws"] >= CI_BUDGET["torch"], message
    for counter in ("invalid_ids", "mismatches", "other_exceptions", "rejected_valid", "accepted_invalid",
                    "oracle_disagreements"):
        assert total[counter] == 0, f"{counter}\n{message}"
    assert report["failures"] == 0 and len(fused_calls) >= 20, (len(fused_calls), message)  # 26 calls at this seed


def test_a_case_is_a_function_of_seed_path_and_index():
    one, two = make_case(3, "torch", 5), make_case(3, "torch", 5)
    assert [r.kwargs for r in one.rows] == [r.kwargs for r in two.rows] and one.slots == two.slots
    assert torch.equal(one.step(0).logits.view(torch.int32 if one.dtype == torch.float32 else torch.int16),
                       two.step(0).logits.view(torch.int32 if two.dtype == torch.float32 else torch.int16))


# ------------------------------------------------------------------ regressions of what the campaign found
@pytest.mark.parametrize("name,value", [
    ("temperature", 5e-324), ("temperature", 1e-46), ("temperature", 3.4028235e38), ("temperature", 1e300),
    ("repetition_penalty", 5e-324), ("repetition_penalty", 1e-46), ("repetition_penalty", 3.5e38),
])
def test_float32_unusable_temperature_and_repetition_penalty_are_rejected(name, value):
    """float32(value) of 0 or inf made NaN of 0/0, -inf/inf, -inf*0 (reference.py then returned
    removed ids); values above float32's largest raised RuntimeError at admission."""
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**{name: value})
    assert info.value.field == name


@pytest.mark.parametrize("name,value", [("temperature", 1.401298464324817e-45), ("temperature", 3.4028234663852886e38),
                                        ("repetition_penalty", 1.401298464324817e-45),
                                        ("repetition_penalty", 3.4028234663852886e38), ("temperature", -0.0)])
def test_float32_extremes_are_accepted_and_sampled_as_the_reference(name, value):
    logits = torch.tensor([[0.0, 1.0, -1.0, 0.5, -3e38, 3e38]])
    params = SamplingParams(**{name: value, "seed": 4, "allowed_token_ids": [0, 1, 3, 4, 5], "logprobs": -1})
    got = sample(logits, params, prompt_token_ids=[[0, 2, 4]], positions=[0], logprobs_mode="processed_logits")
    want = reference_sample(logits, [ReferenceRequest(params, 4, 0, [0, 2, 4])], logprobs_mode="processed_logits")
    assert got.token_ids.tolist() == want.token_ids.tolist() and got.valid.tolist() == want.valid.tolist()
    assert torch.equal(got.logprobs.top_token_ids, want.logprobs.top_token_ids)


@pytest.mark.parametrize("top_k,min_tokens", [(2**63, 0), (10**30, 0), (0, 2**63), (5, 10**30)])
def test_top_k_and_min_tokens_beyond_int64(top_k, min_tokens):
    """They raised "Overflow when unpacking long long" at admission (and reference.py "int too big")."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0]])
    params = SamplingParams(top_k=top_k, min_tokens=min_tokens, stop_token_ids=[1], seed=9)
    got = sample(logits, params, positions=[3])
    want = reference_sample(logits, [ReferenceRequest(params, 9, 3)])
    assert got.token_ids.tolist() == want.token_ids.tolist()
    if min_tokens:
        assert got.token_ids.tolist() != [1]  # the stop id stays removed


@pytest.mark.parametrize("kw", [{"min_p": 0.5}, {"top_k": 30}])
def test_top_p_histogram_of_a_row_spanning_less_than_a_float32_step(kw):
    """A kept span below bins / 3.4e38 (here ~1.8e-37: z / T with a huge T) made the histogram's
    scale inf and the value at its lower end 0 * inf = NaN, no bin: bincount raised RuntimeError."""
    a, b, ninf = 8.816208191686542e-38, 2.938735877055719e-39, float("-inf")
    row = [0.0, -a, -a, 0.0, a, a, ninf, a, -a, 0.0, 0.0, a, 0.0, a, 0.0, -a, a, a, -a, 0.0, -a, -a, 0.0, 0.0, a, -a,
           -8.228461016275398e-38, b, ninf, -a, a, b, a]
    logits = torch.tensor([row])
    params = SamplingParams(seed=5, top_p=0.5, **kw)
    config = TorchStepConfig(direct_route=False, candidate_cap=2, dense_bracket_cap=1, dense_block=3, block_elements=7,
                             flat_block_elements=7)
    sampler = Sampler(len(row), max_slots=1, step_config=config, backend="torch")
    sampler.add_request(0, params, [])
    want = reference_sample(logits, [ReferenceRequest(params, 5, 0)])
    assert sampler.sample(logits).token_ids.tolist() == want.token_ids.tolist()


@pytest.mark.parametrize("world", [2, 3])
def test_split_row_emptied_by_the_temperature_is_invalid(world):
    """Every kept z / T underflowing to -inf leaves no id: the split returned id 0 (here not an
    allowed id) with valid=True; the definition gives the raw greedy id with valid=False."""
    vocab, padded = 4, 6 if world == 3 else 4
    params = [SamplingParams(temperature=0.5, seed=1, allowed_token_ids=[2, 3]), SamplingParams(seed=2, logprobs=2)]
    logits = torch.tensor([[5.0, 1.0, -3e38, -3e38, 0.0, 0.0], [1.0, 3.0, -2.0, 0.0, 0.0, 0.0]])[:, :padded]
    want = reference_sample(logits, [ReferenceRequest(p, p.seed, 0) for p in params], vocab_size=vocab)
    hub, outs, width = ThreadHub(world), [None] * world, padded // world

    def rank(r: int) -> None:
        sampler = Sampler(vocab, max_slots=2, padded_vocab_size=padded, group=ThreadExchange(hub, r))
        for slot, p in enumerate(params):
            sampler.add_request(slot, p, [])
        outs[r] = sampler.sample(logits[:, r * width:(r + 1) * width])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for out in outs:
        assert out.token_ids.tolist() == want.token_ids.tolist() == [0, 1]
        assert out.valid.tolist() == want.valid.tolist() == [False, True]
        assert torch.equal(out.logprobs.token_ranks, want.logprobs.token_ranks)


def test_kernel_logprobs_keep_their_precision_far_from_zero():
    """The kernels computed s - (max + log total) in float32: at |z| ~ 1e5 the value lost log total
    to rounding (-3.21875 for -log 25 = -3.2188759)."""
    pytest.importorskip("triton")
    logits = torch.tensor([[93622.86] * 25 + [0.0]])
    for mode in ("raw_logprobs", "processed_logprobs"):
        params = SamplingParams(seed=3, logprobs=2)
        sampler = Sampler(26, max_slots=1, logprobs_mode=mode, backend="triton")
        sampler.add_request(0, params, [])
        got = sampler.sample(logits).logprobs
        want = reference_sample(logits, [ReferenceRequest(params, 3, 0)], logprobs_mode=mode).logprobs
        assert torch.allclose(got.top_logprobs, want.top_logprobs, atol=1e-6, rtol=1e-6), (mode, got, want)
        assert torch.allclose(got.token_logprobs, want.token_logprobs, atol=1e-6, rtol=1e-6)
