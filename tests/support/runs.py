"""Run the same requests through the reference and through a `Sampler`, and read kept sets back."""

from __future__ import annotations

from typing import Sequence

import torch

from tokensampler import Sampler, SamplingParams
from tokensampler.reference import ReferenceRequest, reference_sample


def run_reference(logits, params: Sequence[SamplingParams], *, seeds=None, positions=None, prompts=None,
                  outputs=None, vocab_size=None, logprobs_mode="raw_logprobs", eos=(), streams=None):
    batch = logits.shape[0]
    seeds = seeds or [p.seed if p.seed is not None else 0 for p in params]
    prompts = prompts or [[] for _ in range(batch)]
    outputs = outputs or [[] for _ in range(batch)]
    positions = positions or [len(prompts[b]) + len(outputs[b]) for b in range(batch)]
    streams = streams or [0] * batch
    requests = [ReferenceRequest(params[b], seeds[b], positions[b], prompts[b], outputs[b], streams[b], eos)
                for b in range(batch)]
    return reference_sample(logits, requests, vocab_size=vocab_size, logprobs_mode=logprobs_mode)


def run_sampler(logits, params: Sequence[SamplingParams], *, seeds=None, positions=None, prompts=None,
                outputs=None, vocab_size=None, logprobs_mode="raw_logprobs", eos=(), streams=None, config=None,
                backend=None, compile=None):
    """A fresh `Sampler` (with `config` as its `TorchStepConfig`, `backend` and `compile` as its choice)
    holding the rows, one step."""
    batch, padded = logits.shape
    prompts = prompts or [[] for _ in range(batch)]
    outputs = outputs or [[] for _ in range(batch)]
    streams = streams or [0] * batch
    sampler = Sampler(vocab_size or padded, max_slots=batch, padded_vocab_size=padded,
                      logprobs_mode=logprobs_mode, max_logprobs=max(20, padded), eos_token_ids=eos,
                      step_config=config, backend=backend, compile=compile)
    for b in range(batch):
        p = params[b]
        if seeds is not None:
            p = SamplingParams(**{**_fields(p), "seed": seeds[b]})
        sampler.add_request(b, p, prompts[b], output_token_ids=outputs[b],
                            position=None if positions is None else positions[b], stream=streams[b])
    return sampler.sample(logits)


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def assert_same_output(want, got) -> None:
    assert torch.equal(want.token_ids, got.token_ids), (want.token_ids, got.token_ids)
    assert torch.equal(want.valid, got.valid)
    assert (want.logprobs is None) == (got.logprobs is None)
    if want.logprobs is not None:
        for name in ("token_ranks", "top_token_ids"):
            a, b = getattr(want.logprobs, name), getattr(got.logprobs, name)
            assert a.shape == b.shape and torch.equal(a, b), (name, a, b)
        for name in ("token_logprobs", "top_logprobs"):
            assert_close_logprobs(getattr(want.logprobs, name), getattr(got.logprobs, name), name)


def assert_close_logprobs(want: torch.Tensor, got: torch.Tensor, name: str = "values") -> None:
    """Logprob values: equal infinities (padding, removed ids) and |diff| <= 1e-6 + 1e-6 |want|
    elsewhere (the normaliser's float32 rounding, docs/semantics.md)."""
    assert want.shape == got.shape, (name, want.shape, got.shape)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and torch.equal(want[~finite], got[~finite]), (name, want, got)
    diff = (want[finite].double() - got[finite].double()).abs()
    bound = 1e-6 + 1e-6 * want[finite].double().abs()
    assert bool((diff <= bound).all()), (name, want, got)


ENGINES = {"reference": run_reference, "sampler": run_sampler}


def kept_ids(engine, logits_row: Sequence[float], params: SamplingParams, **kw) -> set[int]:
    """The ids the definition keeps: finite processed logits with logprobs over the whole vocabulary."""
    p = SamplingParams(**{**_fields(params), "logprobs": -1})
    logits = torch.tensor([list(logits_row)], dtype=torch.float32)
    out = ENGINES[engine](logits, [p], logprobs_mode="processed_logits", **kw)
    values = out.logprobs.top_logprobs[0]
    ids = out.logprobs.top_token_ids[0]
    return {int(i) for i, v in zip(ids, values) if v > float("-inf")}


def processed_values(engine, logits_row, params: SamplingParams, **kw) -> torch.Tensor:
    """The processed logits by id (float32 [V])."""
    p = SamplingParams(**{**_fields(params), "logprobs": -1})
    logits = torch.tensor([list(logits_row)], dtype=torch.float32)
    out = ENGINES[engine](logits, [p], logprobs_mode="processed_logits", **kw)
    values = torch.empty(len(logits_row))
    values[out.logprobs.top_token_ids[0]] = out.logprobs.top_logprobs[0]
    return values
