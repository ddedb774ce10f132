"""The backend and compile choices are made once, when a `Sampler` is made: no environment read on
the per-call path."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch

from tokensampler import SamplingGenerator, SamplingParams
from tokensampler.engine.batch_params import BatchSamplingParams
from tokensampler.sampler import Sampler


class RecordingEnviron(MutableMapping):
    """`os.environ` that records the key of every access (reads, writes, iteration)."""

    def __init__(self, real: MutableMapping) -> None:
        self.real, self.reads = real, []

    def __getitem__(self, key):
        self.reads.append(key)
        return self.real[key]

    def __setitem__(self, key, value):
        self.reads.append(key)
        self.real[key] = value

    def __delitem__(self, key):
        self.reads.append(key)
        del self.real[key]

    def __iter__(self):
        self.reads.append("<iter>")
        return iter(self.real)

    def __len__(self):
        self.reads.append("<len>")
        return len(self.real)

    def __contains__(self, key):
        self.reads.append(key)
        return key in self.real


PLANS = {
    "greedy": SamplingParams(temperature=0.0),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    "logprobs": SamplingParams(temperature=0.7, top_k=20, seed=2, logprobs=3),
    "penalties": SamplingParams(temperature=0.9, min_p=0.05, seed=3, repetition_penalty=1.3,
                                frequency_penalty=0.5, presence_penalty=0.2),
}


def test_no_environment_read_on_the_per_call_path(monkeypatch):
    """A Sampler (torch step, eager) and a SamplingGenerator are made; then `os.environ` records
    every access while several plans are sampled and a generator decodes: nothing is read."""
    vocab = 300
    sampler = Sampler(vocab, max_slots=4)
    for slot, params in enumerate(PLANS.values()):
        sampler.add_request(slot, params, [1, 2, 3], output_token_ids=[4, 5])
    generator = SamplingGenerator(vocab, max_batch_size=4, device="cpu")
    generator.apply_prefill_state(sampling_params=BatchSamplingParams.from_requests(list(PLANS.values())),
                                  prompt_tokens=torch.full((4, 3), 7), empty_slots=[0, 1, 2, 3])
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    recorder = RecordingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", recorder)
    for slot in range(4):  # each plan alone, then all together
        sampler.sample(logits[slot:slot + 1], [slot])
    sampler.sample(logits)
    sampler.sample(logits.to(torch.bfloat16))
    tokens, logprobs = generator.sample(logits)
    generator.apply_decode_state(BatchSamplingParams(), reload_sampling_params=False, reset_sampling_state=False)
    generator.sample(logits)
    monkeypatch.undo()
    assert recorder.reads == [], sorted(set(recorder.reads))
    assert tokens.shape == (4,) and logprobs is not None
