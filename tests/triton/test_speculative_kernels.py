"""Speculative verification on the Triton kernels (the interpreter without a GPU): match mode token
for token against the torch step, and the same state afterwards; rejection mode (torch ops on
the logits' device whatever the backend) gives the same tokens under either setting."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from tests.support.speculative_cases import (  # noqa: E402
    assert_same_state,
    make_sampler,
    random_logits,
    random_params,
    snapshot,
    step_plainly,
)
from tokensampler.backends.triton.config import KernelConfig  # noqa: E402
from tokensampler.core.plan import plan_step  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = KernelConfig(prepare_block=32, select_block=64, logprobs_block=64, pivots=8, splits=2, num_warps=4,
                     window_cap=16, window_block=8)


def case(seed: int):
    rnd = random.Random(seed)
    vocab = rnd.choice([40, 90])
    padded = vocab + 6
    batch = rnd.randint(2, 4)
    k = rnd.choice([1, 3])
    # without DRY: its plans hand the step to the torch step, and these tests are about the kernels
    params = [dataclasses.replace(random_params(rnd, vocab, mirostat=False), dry_multiplier=0.0) for _ in range(batch)]
    prompts = [[rnd.randrange(vocab) for _ in range(rnd.randrange(4))] for _ in range(batch)]
    outputs = [[rnd.randrange(vocab) for _ in range(rnd.randrange(3))] for _ in range(batch)]
    logits = random_logits(rnd, batch, k + 1, vocab, padded).to(DEVICE)
    return rnd, vocab, padded, batch, k, params, prompts, outputs, logits


def build(vocab, padded, params, prompts, outputs, batch, backend):
    return make_sampler(vocab, padded, params, prompts, outputs, list(range(batch)), max_slots=batch,
                        eos=(0,), device=DEVICE, kernel_config=SMALL, backend=backend)


@pytest.mark.parametrize("seed", range(8))
def test_match_mode_on_the_kernels_equals_the_torch_step(seed):
    rnd, vocab, padded, batch, k, params, prompts, outputs, logits = case(seed)
    plain = build(vocab, padded, params, prompts, outputs, batch, "torch")
    width = max(plan_step(params, vocab).logprobs_width, 0)
    drafts, want, _ = step_plainly(plain, logits, list(range(batch)), [rnd.randint(0, k) for _ in range(batch)],
                                   rnd, vocab, width)
    torch_twin = build(vocab, padded, params, prompts, outputs, batch, "torch")
    on_torch = torch_twin.sample_speculative(logits, drafts.to(DEVICE))
    on_kernels_sampler = build(vocab, padded, params, prompts, outputs, batch, "triton")
    on_kernels = on_kernels_sampler.sample_speculative(logits, drafts.to(DEVICE))
    assert on_kernels_sampler.backends._kernels is not None  # the kernel step ran
    assert torch.equal(on_kernels.token_ids.cpu(), want) and torch.equal(on_torch.token_ids.cpu(), want)
    assert torch.equal(on_kernels.num_emitted.cpu(), on_torch.num_emitted.cpu())
    assert torch.equal(on_kernels.valid.cpu(), on_torch.valid.cpu())
    if on_torch.logprobs is not None:
        assert torch.equal(on_kernels.logprobs.top_token_ids.cpu(), on_torch.logprobs.top_token_ids.cpu())
        assert torch.equal(on_kernels.logprobs.token_ranks.cpu(), on_torch.logprobs.token_ranks.cpu())
        assert torch.allclose(on_kernels.logprobs.token_logprobs.cpu(), on_torch.logprobs.token_logprobs.cpu(),
                              atol=1e-5, rtol=0)
    assert_same_state(snapshot(on_kernels_sampler), snapshot(plain))


def test_rejection_mode_is_the_same_under_either_backend_setting():
    rnd, vocab, padded, batch, k, params, prompts, outputs, logits = case(11)
    drafts = torch.randint(-1, vocab, (batch, k), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    probs = torch.softmax(torch.randn(batch, k, padded, generator=torch.Generator().manual_seed(1)), -1).to(DEVICE)
    results = []
    for backend in ("torch", "triton"):
        sampler = build(vocab, padded, params, prompts, outputs, batch, backend)
        results.append((sampler.sample_speculative(logits, drafts, draft_probs=probs).token_ids.cpu(),
                        snapshot(sampler)))
    assert torch.equal(results[0][0], results[1][0])
    assert_same_state(results[0][1], results[1][1])
