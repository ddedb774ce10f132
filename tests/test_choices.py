"""The backend and compile choices are made once, when a `Sampler` is made (`backends.choice`):
explicit arguments win, the environment is the default read then, bad values raise before any
state, and no call after that reads the environment. The compile cache's private torch APIs
(`native.torch_private`) fall back to eager, with the same tokens and one warning."""

from __future__ import annotations

import os
import warnings
from collections.abc import MutableMapping

import pytest
import torch

from tokensampler import (
    CompileFallbackWarning,
    InvalidEnvironment,
    InvalidSamplingParams,
    SamplingGenerator,
    SamplingParams,
    sample,
)
from tokensampler.backends.choice import BACKEND_ENV, COMPILE_ENV, BackendChoice, resolve_names
from tokensampler.backends.torch_step import compile_cache, torch_private
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


@pytest.mark.parametrize("compiled", [False, True])
def test_no_environment_read_on_the_per_call_path(monkeypatch, compiled):
    """A Sampler (torch step, eager or compiled) and a SamplingGenerator are made; then `os.environ`
    records every access while several plans are sampled and a generator decodes: nothing is read.
    (Compiled: `Sampler.warmup` and the calls run once first, so that each compiled function has
    prepared its variants; preparing one reads inductor's cache directory.)"""
    vocab = 3000
    sampler = Sampler(vocab, max_slots=4, backend="torch", compile=compiled)
    for slot, params in enumerate(PLANS.values()):
        sampler.add_request(slot, params, [1, 2, 3], output_token_ids=[4, 5])
    generator = SamplingGenerator(vocab, max_batch_size=4, device="cpu", backend="torch", compile=False)
    generator.apply_prefill_state(sampling_params=BatchSamplingParams.from_requests(list(PLANS.values())),
                                  prompt_tokens=torch.full((4, 3), 7), empty_slots=[0, 1, 2, 3])
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 3

    def calls():
        for slot in range(4):  # each plan alone, then all together
            sampler.sample(logits[slot:slot + 1], [slot])
        sampler.sample(logits)
        sampler.sample(logits.to(torch.bfloat16))
        tokens, logprobs = generator.sample(logits)
        generator.apply_decode_state(BatchSamplingParams(), reload_sampling_params=False,
                                     reset_sampling_state=False)
        generator.sample(logits)
        return tokens, logprobs

    def compiled_calls() -> int:
        return sum(sum(per_layout.values()) for per_layout in compile_cache.call_counts().values())

    if compiled:  # the rows the fused route hands on take general routes that depend on the draw
        sampler.warmup()
        calls()
    before = compiled_calls()
    recorder = RecordingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", recorder)
    tokens, logprobs = calls()
    monkeypatch.undo()
    assert recorder.reads == [], sorted(set(recorder.reads))
    assert tokens.shape == (4,) and logprobs is not None
    assert (compiled_calls() > before) is compiled  # the compiled functions ran (only when compiled)


def test_the_environment_is_the_default_read_once_and_an_argument_wins(monkeypatch):
    """With no argument the sampler takes TOKENSAMPLER_BACKEND / TOKENSAMPLER_COMPILE as they are
    when it is made; changing them later changes nothing; an explicit argument wins over them."""
    monkeypatch.setenv(BACKEND_ENV, "torch")
    monkeypatch.setenv(COMPILE_ENV, "yes")
    by_default = Sampler(50, max_slots=1)
    assert by_default.backends.choice == BackendChoice("torch", True, False)
    assert by_default.backends.torch_step.compiled
    monkeypatch.setenv(COMPILE_ENV, "0")
    monkeypatch.setenv(BACKEND_ENV, "bogus")  # read by nothing from now on
    by_default.add_request(0, SamplingParams(seed=1), [])
    by_default.sample(torch.zeros(1, 50))
    assert by_default.backends.choice == BackendChoice("torch", True, False)
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert Sampler(50, max_slots=1).backends.choice.compile is False
    explicit = Sampler(50, max_slots=1, backend="auto", compile=True)
    assert explicit.backends.choice == BackendChoice("auto", True, False)  # auto on a CPU: the torch step
    monkeypatch.delenv(BACKEND_ENV)
    monkeypatch.delenv(COMPILE_ENV)
    assert resolve_names() == ("auto", True)  # unset: auto, compiled
    generator = SamplingGenerator(50, max_batch_size=2, device="cpu", backend="torch", compile=False, warmup=False)
    assert generator.sampler.backends.choice == BackendChoice("torch", False, False)


@pytest.mark.parametrize("kw,error,field,value", [
    (dict(backend="cuda"), InvalidSamplingParams, "backend", "cuda"),
    (dict(backend=0), InvalidSamplingParams, "backend", 0),
    (dict(compile="yes"), InvalidSamplingParams, "compile", "yes"),
    (dict(compile=1), InvalidSamplingParams, "compile", 1),
    (dict(env={BACKEND_ENV: "Cuda"}), InvalidEnvironment, BACKEND_ENV, "cuda"),
    (dict(env={COMPILE_ENV: "2"}), InvalidEnvironment, COMPILE_ENV, "2"),
])
def test_bad_choices_raise_naming_field_value_and_allowed(monkeypatch, kw, error, field, value):
    """Before any state: the Sampler, the generator and `sample` raise the same error."""
    for name, setting in kw.pop("env", {}).items():
        monkeypatch.setenv(name, setting)
    makers = [lambda: Sampler(10, max_slots=1, **kw),
              lambda: SamplingGenerator(10, max_batch_size=1, device="cpu", **kw),
              lambda: sample(torch.zeros(1, 10), SamplingParams(), **kw)]
    for make in makers:
        with pytest.raises(error) as err:
            make()
        assert err.value.field == field and err.value.value == value
        assert field in str(err.value) and "allowed" in str(err.value)
        assert "auto" in err.value.allowed or "True" in err.value.allowed or "on" in err.value.allowed


def test_forced_triton_without_a_way_to_run_it_raises_when_made(monkeypatch):
    """backend="triton" on CPU tensors needs Triton's interpreter: refused at construction."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InvalidEnvironment, match="TRITON_INTERPRET") as err:
        Sampler(10, max_slots=1, backend="triton")
    assert err.value.field == "backend"


# ------------------------------------------------------------------ private torch APIs fall back
def _break_private_api(monkeypatch, hook: str) -> None:
    """`torch_private.hook` raises as a torch that differs would (no artefact is loaded either, and
    the compiled functions hold no variant yet: each is prepared, and fails, on its first call)."""
    def broken(*args, **kw):
        raise AttributeError(f"module 'torch' has no attribute '{hook}' (simulated)")

    monkeypatch.setattr(torch_private, hook, broken)
    monkeypatch.setattr(torch_private, "load_artefact", broken)
    monkeypatch.setattr(torch_private, "_WARNED", [])
    for function in compile_cache._FUNCTIONS.values():  # restored after the test
        monkeypatch.setattr(function, "variants", {})
        monkeypatch.setattr(function, "eager", None)


@pytest.mark.parametrize("hook", ["size_oblivious", "aot_compile", "mark"])
def test_a_failing_private_api_falls_back_to_eager_with_one_warning(monkeypatch, hook):
    """The compiled functions a step calls run eagerly instead: the tokens (and logprob ranks and
    ids) are the eager sampler's, and one CompileFallbackWarning is emitted for all of them."""
    _break_private_api(monkeypatch, hook)
    vocab = 4000
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(3)) * 3
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=3),
              SamplingParams(temperature=1.0, seed=2, presence_penalty=0.5),
              SamplingParams(temperature=0.7, top_p=0.95, seed=3),
              SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=1.0, min_p=0.001, seed=5)]  # flat with min-p: the general routes
    outputs = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for compiled in (True, False):
            sampler = Sampler(vocab, max_slots=5, backend="torch", compile=compiled)
            for slot, p in enumerate(params):
                sampler.add_request(slot, p, [5, 6])
            outputs[compiled] = [sampler.sample(logits), sampler.sample(logits * 0.5)]
    fallbacks = [w for w in caught if issubclass(w.category, CompileFallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    assert "runs eagerly" in str(fallbacks[0].message) and hook in str(fallbacks[0].message)
    eager_now = [name for name, f in compile_cache._FUNCTIONS.items() if f.eager is not None]
    assert len(eager_now) >= 2, eager_now  # several functions fell back; one warning
    assert compile_cache.report()["functions"][eager_now[0]]["eager"].startswith("AttributeError")
    for got, want in zip(outputs[True], outputs[False]):
        assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.valid, want.valid)
        assert torch.equal(got.logprobs.top_token_ids, want.logprobs.top_token_ids)
        assert torch.equal(got.logprobs.token_ranks, want.logprobs.token_ranks)


def test_unknown_vector_lanes_keep_the_exact_normaliser(monkeypatch):
    """A torch whose ISA query raises: lanes unknown, logprobs from the exact eager path, one warning."""
    def broken():
        raise ImportError("no torch._inductor.cpu_vec_isa (simulated)")

    monkeypatch.setattr(torch_private, "_pick_vec_isa", broken)
    monkeypatch.setattr(torch_private, "_LANES", [])
    monkeypatch.setattr(torch_private, "_WARNED", [])
    from tokensampler.backends.torch_step import logprobs
    with pytest.warns(CompileFallbackWarning, match="normaliser"):
        assert logprobs.fast_normaliser(1000, True) == 0
    assert logprobs.aten_lanes() == 0
