"""Min-p and top-k thresholds that lie below the candidate list (backends/torch_step/candidates.py).

Such a threshold is at most the list's smallest value, so it needs a full-row pass only where no
other filter's exact threshold already reaches that value; the min-p pass runs column chunk by
column chunk. Checked: tokens and processed logprobs equal the reference on both routes whether the
pass is needed or skipped, the skip happens, and a single row with llama.cpp's default chain stays
under half a logits buffer of extra memory.
"""

from __future__ import annotations

import pytest
import torch

import tests.support.split_cases as dc
from tests.support.backends import make_sampler
from tokensampler import SamplingParams
from tokensampler.backends.torch_step import candidates
from tokensampler.reference import ReferenceRequest, reference_sample
from tokensampler.tools.bench_memory import step_memory_report
from tokensampler.tools.workloads import make_logits

VOCAB = 49152
LLAMA_DEFAULT = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


def count_min_p_passes(monkeypatch) -> list[int]:
    calls = []
    original = candidates._min_p_full_row
    monkeypatch.setattr(candidates, "_min_p_full_row",
                        lambda z, rows, *a: calls.append(rows.numel()) or original(z, rows, *a))
    return calls


def run(backend: str, logits: torch.Tensor, params: list[SamplingParams], mode: str):
    sampler = make_sampler(backend, logits.shape[1], max_slots=len(params), logprobs_mode=mode)
    for slot, p in enumerate(params):
        sampler.add_request(slot, p, [])
    got = sampler.sample(logits)
    want = reference_sample(logits, [ReferenceRequest(p, p.seed, 0) for p in params], logprobs_mode=mode)
    return got, want


@pytest.mark.parametrize("backend", ["direct", "block"])
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
@pytest.mark.parametrize("extra", [
    {"min_p": 1e-7, "top_k": 5},  # min-p far below the list, top-k inside it: min-p's pass is skipped
    {"min_p": 1e-7, "top_k": 20000},  # both below the list: both passes run
    LLAMA_DEFAULT,
])
def test_thresholds_below_the_list_match_the_reference(monkeypatch, backend, mode, extra):
    calls = count_min_p_passes(monkeypatch)
    logits = make_logits(4, VOCAB, seed=3)
    params = [SamplingParams(**{"temperature": 0.9, "top_p": 0.95, **extra}, seed=10 + b, logprobs=5)
              for b in range(4)]
    got, want = run(backend, logits, params, mode)
    assert not dc.compare(f"{backend} {mode} {extra}", got, want)
    if extra["top_k"] == 5:
        assert calls == []  # top-k's threshold, exact inside the list, is above min-p's
    if extra["top_k"] == 20000:
        assert sum(calls) >= 1  # nothing else covers min-p here


def test_one_row_of_llama_cpps_default_chain_stays_under_half_a_buffer():
    logits = make_logits(1, 151936, seed=0)
    sampler = make_sampler("torch", 151936, max_slots=1)
    sampler.add_request(0, SamplingParams(**LLAMA_DEFAULT, seed=1), [])
    report = step_memory_report(lambda: sampler.sample(logits), logits, 151936, lambda: sampler.workspace_bytes)
    assert report["ratio"] <= 0.5, report
