"""A small call (at most `TorchStepConfig.single_thread_elements` logits, or an all-greedy one of at most
`greedy_single_thread_elements`) runs on one torch thread, a larger one on the caller's; the tokens are
the same either way, and the caller's count is back after."""

from __future__ import annotations

import pytest
import torch

from tokensampler import Sampler, SamplingParams
from tokensampler.backends.torch_step import step as step_module
from tokensampler.backends.torch_step.config import TorchStepConfig
from tokensampler.tools.workloads import make_logits


@pytest.mark.parametrize("batch, vocab, single_thread_elements, threads", [
    (1, 2000, 1 << 18, 1), (4, 2000, 1 << 18, 1), (4, 2000, 7999, 2), (1, 300_000, 1 << 18, 2), (1, 2000, 0, 2)])
def test_a_call_runs_on_one_thread_only_when_it_is_small(monkeypatch, batch, vocab, single_thread_elements, threads):
    seen = []
    real = step_module.TorchStep._sample

    def recording(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(step_module.TorchStep, "_sample", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        logits = make_logits(batch, vocab, seed=batch)
        tokens = []
        for elements in (single_thread_elements, 0):
            sampler = Sampler(vocab, max_slots=batch, backend="torch", compile=False,
                              step_config=TorchStepConfig(single_thread_elements=elements))
            for slot in range(batch):
                sampler.add_request(slot, SamplingParams(seed=slot, temperature=0.9, top_p=0.9), [1, 2])
            tokens.append(sampler.sample(logits).token_ids.tolist())
            assert torch.get_num_threads() == 2
        assert seen == [threads, 2] and tokens[0] == tokens[1]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("temperature, greedy_elements, threads", [
    (0.0, 1 << 23, 1), (0.0, 0, 2), (0.0, 31 * 20_000, 2), (0.9, 1 << 23, 2)])
def test_an_all_greedy_call_runs_on_one_thread_up_to_its_own_limit(monkeypatch, temperature, greedy_elements,
                                                                    threads):
    """32 rows of 20,000 ids (over `single_thread_elements`): all greedy, on one thread where they are
    within `greedy_single_thread_elements`; a sampled batch of the same size keeps the caller's two."""
    seen = []
    real = step_module.TorchStep._sample
    monkeypatch.setattr(step_module.TorchStep, "_sample",
                        lambda self, *a, **k: seen.append(torch.get_num_threads()) or real(self, *a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        logits = make_logits(32, 20_000, seed=4)
        sampler = Sampler(20_000, max_slots=32, backend="torch",
                          step_config=TorchStepConfig(greedy_single_thread_elements=greedy_elements))
        for slot in range(32):
            sampler.add_request(slot, SamplingParams(seed=slot, temperature=temperature), [1, 2])
        tokens = sampler.sample(logits).token_ids
        assert seen == [threads] and torch.get_num_threads() == 2
        if temperature == 0.0:
            assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    finally:
        torch.set_num_threads(before)


def test_the_setting_is_checked():
    from tokensampler import InvalidSamplingParams
    with pytest.raises(InvalidSamplingParams, match="single_thread_elements"):
        TorchStepConfig(single_thread_elements=-1)
    with pytest.raises(InvalidSamplingParams, match="greedy_single_thread_elements"):
        TorchStepConfig(greedy_single_thread_elements=-1)
