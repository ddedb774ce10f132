"""Bad input to every public entry point: a `TokenSamplerError` (the library's `ValueError`, one
line naming the field, the value and what is allowed) or a correct result, never another
exception; after an error the object's state is what it was.

Each test takes a valid call and replaces one or two of its arguments by values from `WRONG`
(None, bools, out-of-range ints, NaN and infinities, strings, bytes, lists, dicts, objects, and
tensors of the wrong shape, dtype or device). Entry points: `SamplingParams`, `Sampler` (the
constructor and every method, `sample(token_bitmask=...)` and `sample_speculative` included),
`tokensampler.sample`, `SamplingGenerator` (the constructor and every method),
`resolve_request` and `load_generation_defaults`.

State unchanged: a stateful call is made on an object holding admitted requests, after taking a
deep copy of it (a twin that never sees the call). When the call raises, the object's per-slot
records (params, seed, position, stream, occupancy) and its next two sampling steps must equal the
twin's. Sizes (vocabulary, slots, lanes) are drawn small or invalid: a huge valid size is a
memory request, not a bad value.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tokensampler import (
    BatchSamplingParams,
    GenerationDefaults,
    LogprobsOutput,
    Sampler,
    SamplerOutput,
    SamplingGenerator,
    SamplingParams,
    SpeculativeOutput,
    TokenSamplerError,
    load_generation_defaults,
    resolve_request,
    sample,
)
from tokensampler.serving.generation_config import ACCEPTED_FIELDS

V, VP, SLOTS = 40, 48, 4  # vocabulary, padded width (two bitmask words cover V), sampler slots
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# TOKENSAMPLER_BAD_INPUT_SCALE=20 multiplies every test's examples (a deeper run than CI's ~20 s)
SCALE = float(os.environ.get("TOKENSAMPLER_BAD_INPUT_SCALE", "1"))


def examples(count: int) -> int:
    return max(1, round(count * SCALE))


# ------------------------------------------------------------------ wrong values
def _tensor(maker):
    return st.just(maker).map(lambda make: make())


TENSORS = st.one_of([_tensor(m) for m in (
    lambda: torch.randn(3, VP),                            # a valid logits batch for the admitted slots
    lambda: torch.randn(4, VP, dtype=torch.float16),
    lambda: torch.randn(2, VP + 1),                        # wrong width
    lambda: torch.randn(3, VP, dtype=torch.float64),       # wrong dtype
    lambda: torch.zeros(3, VP, dtype=torch.int32),
    lambda: torch.full((3, VP), math.nan),
    lambda: torch.randn(3, 3, VP),                         # speculative target shape
    lambda: torch.randn(4, 3, VP),
    lambda: torch.empty(3, VP, device="meta"),             # a device without data
    lambda: torch.empty(3, 2, dtype=torch.int32, device="meta"),
    lambda: torch.tensor(1.5),                             # 0-d
    lambda: torch.zeros(0),
    lambda: torch.zeros(0, VP),
    lambda: torch.tensor([1, 2, 3]),
    lambda: torch.tensor([0, 1, 3]),                       # the admitted slots
    lambda: torch.tensor([[1, 2], [3, -1], [4, 5]]),       # ids [3, 2]
    lambda: torch.tensor([[1, 2], [3, 4], [5, 6], [7, -1]]),
    lambda: torch.tensor([[-5, 2]]),
    lambda: torch.tensor([[V, 1]]),
    lambda: torch.tensor([[1.0, 2.0]]),
    lambda: torch.ones(3, dtype=torch.bool),
    lambda: torch.ones(4, dtype=torch.bool),
    lambda: torch.zeros(3, dtype=torch.complex64),
    lambda: torch.full((3, 2), -1, dtype=torch.int32),     # valid token bitmasks ([B, ceil(V / 32)])
    lambda: torch.full((3, 3), -1, dtype=torch.int32),
    lambda: torch.full((3, 1), -1, dtype=torch.int32),     # too few words
    lambda: torch.full((2, 2), -1, dtype=torch.int32),     # wrong batch
    lambda: torch.full((3, 2), -1, dtype=torch.int64),     # wrong dtype
    lambda: torch.full((3, 2, 1), -1, dtype=torch.int32),
    lambda: torch.full((3, 2), 0.5),
    lambda: torch.rand(3, 2, VP, dtype=torch.float64),     # draft probs
)])
BIG = st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, 2**64, 2**70, -(2**63) - 1, -(2**70)])


def atoms(ints: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=3), st.binary(max_size=2),
                     st.sampled_from(["cpu", "meta", "cuda", "auto", "match", "raw_logits", "host", "x"]),
                     st.builds(object))


def wrong(ints: st.SearchStrategy) -> st.SearchStrategy:
    """Values of every wrong kind, with `ints` as the integers (atoms, list items and dict values)."""
    small = st.one_of(st.none(), st.booleans(), st.integers(-3, V + 2), st.floats(-3, 3), st.text(max_size=2))
    return st.one_of(
        atoms(ints),
        TENSORS,
        st.lists(small, max_size=4),
        st.lists(st.integers(-2, V + 1), max_size=4).map(tuple),
        st.lists(st.lists(st.integers(-2, V + 1), max_size=3), max_size=4),
        st.lists(st.one_of(st.none(), st.lists(small, max_size=2), TENSORS), max_size=3),
        st.dictionaries(st.one_of(st.integers(-2, V + 1), st.text(max_size=2)), small, max_size=3),
        st.frozensets(st.integers(0, 3), max_size=3),
    )


WRONG = wrong(st.one_of(st.integers(-3, V + 9), BIG))
WRONG_SIZE = wrong(st.integers(-3, V + 9))  # for sizes: small when valid


def overrides(names: list[str], sizes: tuple[str, ...] = ()) -> st.SearchStrategy:
    """One or two of `names`, each given a wrong value (`SPECIAL[name]` for the parameter objects)."""
    return st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: SPECIAL.get(k, WRONG_SIZE if k in sizes else WRONG) for k in keys}))


TOKEN = st.integers(0, V + 2)  # ids in and just past the vocabulary
PARAMS = st.builds(
    SamplingParams, temperature=st.sampled_from([0.0, 0.7]), seed=st.one_of(st.none(), st.integers(0, 9)),
    logprobs=st.one_of(st.none(), st.integers(-1, 8)), min_tokens=st.integers(0, 3),
    logit_bias=st.one_of(st.none(), st.dictionaries(TOKEN, st.floats(-5, 5), max_size=2)),
    allowed_token_ids=st.one_of(st.none(), st.lists(TOKEN, min_size=1, max_size=3)),
    stop_token_ids=st.lists(TOKEN, max_size=2), bad_words_token_ids=st.lists(st.lists(TOKEN, min_size=1, max_size=3),
                                                                             max_size=2))
# a BatchSamplingParams with one or two wrong fields (scalars, or lists read as one entry per lane), the
# container fields (ids, words, strings, bias) drawn more often, with a scalar as often as anything else
CONTAINER_FIELDS = ["allowed_token_ids", "stop_token_ids", "stop", "bad_words_token_ids", "logit_bias"]
BATCH = st.deferred(lambda: st.dictionaries(
    st.sampled_from(PARAM_FIELDS + 2 * CONTAINER_FIELDS), st.one_of(atoms(st.integers(-3, V + 9)), WRONG),
    min_size=1, max_size=2).map(lambda kwargs: BatchSamplingParams(**kwargs)))
SPECIAL = {
    "params": st.one_of(PARAMS, WRONG),
    "sampling_params": st.one_of(BATCH, PARAMS, WRONG),
    "chunks": st.one_of(st.lists(st.one_of(BATCH, PARAMS), min_size=1, max_size=2), BATCH, WRONG),
}


def attempt(call):
    """(result, None) or (None, the library's error); any other exception fails the test."""
    try:
        return call(), None
    except TokenSamplerError as error:
        assert isinstance(error, ValueError)
        message = str(error)
        assert message and "\n" not in message, repr(message)
        assert isinstance(error.field, str) and error.field and error.field in message, message
        assert isinstance(error.allowed, str) and error.allowed, message
        return None, error


# ------------------------------------------------------------------ checks of a correct result
def assert_tokens(out, batch: int, vocab: int) -> None:
    assert isinstance(out, SamplerOutput)
    assert out.token_ids.shape == (batch,) and out.valid.shape == (batch,)
    assert bool(((out.token_ids >= 0) & (out.token_ids < vocab)).all())
    assert out.logprobs is None or isinstance(out.logprobs, LogprobsOutput)


def assert_speculative(out, vocab: int) -> None:
    assert isinstance(out, SpeculativeOutput)
    assert bool(((out.token_ids >= -1) & (out.token_ids < vocab)).all())
    assert bool((out.num_emitted >= 1).all()) or out.num_emitted.numel() == 0


def assert_normal_params(params) -> None:
    """A made `SamplingParams` is in its normal form: remaking it from its fields gives it back."""
    assert isinstance(params, SamplingParams)
    fields = {name: getattr(params, name) for name in params.__dataclass_fields__}
    fields["logit_bias"] = None if params.logit_bias is None else dict(params.logit_bias)
    assert SamplingParams(**fields) == params
    hash(params)


# ------------------------------------------------------------------ SamplingParams
PARAM_FIELDS = list(SamplingParams.__dataclass_fields__)


@settings(max_examples=examples(250), **SETTINGS)
@given(overrides(PARAM_FIELDS))
@example({"stop_token_ids": 5})  # the examples: failures found before (deeper runs), kept as regressions
@example({"stop": {"a": 1}})
@example({"allowed_token_ids": torch.tensor(1)})
@example({"temperature": torch.randn(3, VP)})  # a multi-line repr: the message is still one line
def test_sampling_params(kwargs):
    params, error = attempt(lambda: SamplingParams(**kwargs))
    if error is None:
        assert_normal_params(params)
    else:
        assert error.field.split("[")[0] in kwargs, (error.field, kwargs)


def test_the_known_failures():
    """The failures the hardening issue named: each is the library's error, naming the field."""
    cases = [
        ("stop_token_ids", lambda: SamplingParams(stop_token_ids=5)),
        ("params", lambda: sample(torch.randn(2, 8), None)),
        ("params", lambda: sample(torch.randn(2, 8), [1, 2])),
        ("prompt_token_ids", lambda: Sampler(8, max_slots=1).add_request(0, SamplingParams(), None)),
        ("prompt_token_ids", lambda: sample(torch.randn(1, 8), SamplingParams(), prompt_token_ids=[None])),
        ("output_token_ids", lambda: Sampler(8, max_slots=1).add_request(0, SamplingParams(), [1],
                                                                            output_token_ids=None)),
        ("prompt_tokens", lambda: SamplingGenerator(8, max_batch_size=1, device="cpu", warmup=False)
         .apply_prefill_state(sampling_params=SamplingParams(), prompt_tokens=None, empty_slots=[0])),
        ("device", lambda: Sampler(8, max_slots=1, device="nonsense")),
        ("token_bitmask", lambda: sample(torch.randn(1, 8), SamplingParams(), token_bitmask=[[1]])),
    ]
    for field, call in cases:
        with pytest.raises(TokenSamplerError) as raised:
            call()
        assert raised.value.field == field, (field, raised.value)


# ------------------------------------------------------------------ Sampler
SAMPLER_KWARGS = dict(vocab_size=V, max_slots=2, device="cpu", padded_vocab_size=VP, logprobs_mode="raw_logprobs",
                      max_logprobs=20, eos_token_ids=(2,), group=None, step_config=None, kernel_config=None)


@settings(max_examples=examples(150), **SETTINGS)
@given(overrides(list(SAMPLER_KWARGS), sizes=("vocab_size", "max_slots", "padded_vocab_size")))
@example({"device": "nonsense"})
@example({"device": 1.5})
@example({"step_config": 5})
def test_sampler_constructor(kwargs):
    kwargs = {**SAMPLER_KWARGS, **kwargs}
    sampler, _ = attempt(lambda: Sampler(**kwargs))
    if sampler is not None:  # a sampler that was made works
        sampler.add_request(0, SamplingParams(seed=1, top_p=0.9), [0])
        out = sampler.sample(torch.randn(1, sampler.padded_vocab_size))
        assert_tokens(out, 1, sampler.vocab_size)


ADMITTED = {
    0: (SamplingParams(seed=1, top_p=0.9, logprobs=2, presence_penalty=0.5, repetition_penalty=1.2), [3, 4, 5], [6]),
    1: (SamplingParams(seed=2, temperature=0.0, min_tokens=3, stop_token_ids=(7,), bad_words_token_ids=[[8, 9]],
                       logit_bias={5: 2.0}), [9, 8], []),
    3: (SamplingParams(seed=3, top_k=5, frequency_penalty=1.0, allowed_token_ids=list(range(20))), [], [1, 1, 2]),
}


def admitted_sampler() -> Sampler:
    sampler = Sampler(V, max_slots=SLOTS, padded_vocab_size=VP, eos_token_ids=[2], max_logprobs=5)
    for slot, (params, prompt, outputs) in ADMITTED.items():
        sampler.add_request(slot, params, prompt, output_token_ids=outputs)
    return sampler


def logprobs_lists(logprobs: LogprobsOutput | None) -> list | None:
    if logprobs is None:
        return None
    return [getattr(logprobs, name).tolist() for name in ("token_logprobs", "token_ranks", "top_token_ids",
                                                          "top_logprobs")]


def sampler_records(sampler: Sampler) -> list:
    """Per slot: (params, seed, position), or None when empty; then two steps of every occupied slot."""
    records = []
    for slot in range(sampler.max_slots):
        try:
            records.append((sampler.params_of(slot), sampler.seed_of(slot), sampler.position_of(slot)))
        except TokenSamplerError:
            records.append(None)
    occupied = [slot for slot, record in enumerate(records) if record is not None]
    gen = torch.Generator().manual_seed(99)
    for _ in range(2):
        out = sampler.sample(torch.randn(len(occupied), sampler.padded_vocab_size, generator=gen), occupied)
        records.append((out.token_ids.tolist(), out.valid.tolist(),
                        logprobs_lists(out.logprobs)))
    return records


def _sampler_calls() -> dict:
    def spec_logits():
        return torch.randn(3, 3, VP, generator=torch.Generator().manual_seed(5))

    return {
        "add_request": dict(slot=2, params=SamplingParams(seed=9, top_k=3), prompt_token_ids=[1, 2],
                            output_token_ids=(), position=None, stream=0),
        "set_params": dict(slots=[0, 3], params=[SamplingParams(seed=1, temperature=0.5), SamplingParams(top_k=2)]),
        "set_noise": dict(slots=[0, 3], seeds=[5, 6], positions=[10, 11], streams=[0, 1]),
        "reset_history": dict(slots=[0], prompt_token_ids=torch.tensor([[1, 2, -1]]), output_token_ids=None),
        "remove_request": dict(slot=1),
        "seed_of": dict(slot=0), "position_of": dict(slot=3), "params_of": dict(slot=1),
        "sample": dict(logits=lambda: torch.randn(3, VP), slots=[0, 1, 3], record=None, token_bitmask=None),
        "sample_speculative": dict(target_logits=spec_logits, draft_token_ids=torch.tensor([[1, 2], [3, -1], [4, 5]]),
                                   draft_probs=None, slots=[0, 1, 3], mode=None, record=None),
    }


SAMPLER_CALLS = _sampler_calls()


def _fresh(kwargs: dict) -> dict:
    return {k: (v() if callable(v) and not isinstance(v, type) else v) for k, v in kwargs.items()}


def check_sampler_result(method: str, result, sampler: Sampler) -> None:
    if method == "sample":
        assert_tokens(result, result.token_ids.shape[0], V)
    elif method == "sample_speculative":
        assert_speculative(result, V)
    elif method in ("add_request", "seed_of", "position_of"):
        assert isinstance(result, int) and not isinstance(result, bool)
    elif method == "params_of":
        assert isinstance(result, SamplingParams)
    else:
        assert result is None
    sampler_records(sampler)  # the state is still usable


@settings(max_examples=examples(300), **SETTINGS)
@given(st.sampled_from(sorted(SAMPLER_CALLS)).flatmap(
    lambda method: st.tuples(st.just(method), overrides(list(SAMPLER_CALLS[method])))))
@example(("add_request", {"prompt_token_ids": None}))
@example(("add_request", {"output_token_ids": None}))
@example(("set_noise", {"slots": None}))
@example(("reset_history", {"slots": 5}))
@example(("sample_speculative", {"slots": [[], [], []]}))
@example(("sample", {"token_bitmask": False, "logits": torch.randn(2, VP + 1)}))
def test_sampler_methods_keep_the_state_on_error(call):
    method, bad = call
    sampler = admitted_sampler()
    twin = copy.deepcopy(sampler)
    kwargs = {**_fresh(SAMPLER_CALLS[method]), **bad}
    result, error = attempt(lambda: getattr(sampler, method)(**kwargs))
    if error is None:
        check_sampler_result(method, result, sampler)
    else:
        assert sampler_records(sampler) == sampler_records(twin), (method, error)


# ------------------------------------------------------------------ tokensampler.sample
SAMPLE_KWARGS = dict(logits=lambda: torch.randn(3, VP), params=SamplingParams(seed=4, top_p=0.9, logprobs=1),
                     prompt_token_ids=[[1, 2], [3], []], output_token_ids=None, positions=None, vocab_size=V,
                     logprobs_mode="raw_logprobs", eos_token_ids=(2,), token_bitmask=None)


@settings(max_examples=examples(250), **SETTINGS)
@given(overrides(list(SAMPLE_KWARGS), sizes=("vocab_size",)))
@example({"params": None})
@example({"params": [1, 2, 3]})
@example({"prompt_token_ids": [None, None, None]})
def test_stateless_sample(bad):
    kwargs = {**_fresh(SAMPLE_KWARGS), **bad}
    out, _ = attempt(lambda: sample(**kwargs))
    if out is not None:
        logits = kwargs["logits"]
        assert_tokens(out, logits.shape[0], kwargs["vocab_size"] or logits.shape[1])


@settings(max_examples=examples(120), **SETTINGS)
@given(st.one_of(TENSORS, WRONG), st.booleans())
def test_token_bitmask(mask, stateless):
    """The bitmask of `Sampler.sample` and `tokensampler.sample`: an int32 [B, >= ceil(V / 32)] or an error."""
    logits = torch.randn(3, VP)
    if stateless:
        out, _ = attempt(lambda: sample(logits, SamplingParams(seed=1), vocab_size=V, token_bitmask=mask))
    else:
        sampler = admitted_sampler()
        twin = copy.deepcopy(sampler)
        out, error = attempt(lambda: sampler.sample(logits, [0, 1, 3], token_bitmask=mask))
        if error is not None:
            assert error.field.startswith("token_bitmask"), error
            assert sampler_records(sampler) == sampler_records(twin)
    if out is not None:
        assert_tokens(out, 3, V)


# ------------------------------------------------------------------ SamplingGenerator
GENERATOR_KWARGS = dict(vocab_size=V, max_batch_size=2, sampling_dp=1, padded_vocab_size=VP, device="cpu",
                        group=None, logprobs_mode="raw_logprobs", max_logprobs=20, eos_token_ids=(2,),
                        seed_source=None, warmup=False)


@settings(max_examples=examples(120), **SETTINGS)
@given(overrides(list(GENERATOR_KWARGS), sizes=("vocab_size", "max_batch_size", "sampling_dp", "padded_vocab_size")))
@example({"seed_source": 5})
@example({"warmup": "yes"})
def test_generator_constructor(bad):
    kwargs = {**GENERATOR_KWARGS, **bad}
    generator, _ = attempt(lambda: SamplingGenerator(**kwargs))
    if generator is not None:
        generator.apply_prefill_state(sampling_params=SamplingParams(), prompt_tokens=[[0]], empty_slots=[0])
        tokens, _ = generator.sample(torch.randn(1, generator.sampler.padded_vocab_size))
        assert 0 <= int(tokens[0]) < generator.vocab_size


def admitted_generator() -> SamplingGenerator:
    generator = SamplingGenerator(V, max_batch_size=4, padded_vocab_size=VP, device="cpu", eos_token_ids=[2],
                                  max_logprobs=5, warmup=False)
    generator.apply_prefill_state(
        sampling_params=BatchSamplingParams(seed=[1, 2], top_p=[0.9, 1.0], presence_penalty=[0.5, 0.0],
                                            logprobs=[2, None], stop_token_ids=[(7,), None]),
        prompt_tokens=[[3, 4, 5], [6, -1, -1]], empty_slots=[0, 2], output_tokens=[[1], [-1]])
    return generator


def generator_records(generator: SamplingGenerator) -> list:
    """Occupancy, staleness, per occupied slot (seed, position, stream, params); then two steps."""
    occupied = generator.occupied_slots()
    records = [occupied, generator.stale_slots(), generator.trace_captures,
               [(generator.seed_of(s), generator.position_of(s), generator.stream_of(s), generator.params_of(s))
                for s in occupied]]
    if not generator.stale_slots():
        gen = torch.Generator().manual_seed(7)
        for _ in range(2):
            tokens, logprobs = generator.sample(torch.randn(generator.num_lanes, VP, generator=gen))
            records.append((tokens.tolist(), logprobs_lists(logprobs)))
    return records


GENERATOR_CALLS = {
    "apply_prefill_state": dict(sampling_params=SamplingParams(seed=9, top_k=3), prompt_tokens=[[1, 2]],
                                empty_slots=[1], streams=None, output_tokens=None),
    "release_slots": dict(slots=[2]),
    "apply_decode_state": dict(chunks=[BatchSamplingParams(temperature=0.5)], reload_sampling_params=True,
                               reset_sampling_state=False, prompt_tokens=None, output_tokens=None, positions=None,
                               slot_remap=None, sampling_mode="device"),
    "sample": dict(logits=lambda: torch.randn(4, VP), active_slots=None, enable_trace=False),
    "sample_speculative": dict(target_logits=lambda: torch.randn(4, 3, VP),
                               draft_token_ids=torch.tensor([[1, 2], [3, 4], [5, 6], [7, -1]]), draft_probs=None,
                               mode=None, active_slots=None),
    "seed_of": dict(slot=0), "position_of": dict(slot=2), "stream_of": dict(slot=0), "params_of": dict(slot=2),
}


@settings(max_examples=examples(300), **SETTINGS)
@given(st.sampled_from(sorted(GENERATOR_CALLS)).flatmap(
    lambda method: st.tuples(st.just(method), overrides(list(GENERATOR_CALLS[method])))))
@example(("apply_prefill_state", {"prompt_tokens": None}))
@example(("apply_prefill_state", {"streams": 5}))
@example(("apply_decode_state", {"chunks": 5}))
@example(("sample", {"enable_trace": "yes"}))
def test_generator_methods_keep_the_state_on_error(call):
    method, bad = call
    generator = admitted_generator()
    twin = copy.deepcopy(generator)
    kwargs = {**_fresh(GENERATOR_CALLS[method]), **bad}
    result, error = attempt(lambda: getattr(generator, method)(**kwargs))
    if error is None:
        if method == "sample":
            assert all(0 <= t < V for t in result[0].tolist())
        elif method == "sample_speculative":
            assert_speculative(result, V)
        generator_records(generator)  # still usable
    else:
        assert generator_records(generator) == generator_records(twin), (method, error)


@settings(max_examples=examples(150), **SETTINGS)
@given(st.one_of(BATCH, PARAMS, WRONG), st.sampled_from(["prefill", "decode", "decode_list"]))
@example(BatchSamplingParams(stop_token_ids=5), "prefill")
@example(BatchSamplingParams(logit_bias=[5]), "decode")
def test_generator_parameters_keep_the_state_on_error(params, how):
    """The parameters an engine hands over (a BatchSamplingParams whose fields may be wrong,
    scalars or per-lane lists), at admission and at a decode reload."""
    generator = admitted_generator()
    twin = copy.deepcopy(generator)
    if how == "prefill":
        call = lambda: generator.apply_prefill_state(sampling_params=params, prompt_tokens=[[1, 2]],  # noqa: E731
                                                     empty_slots=[1])
    else:
        call = lambda: generator.apply_decode_state([params] if how == "decode_list" else params,  # noqa: E731
                                                    reload_sampling_params=True, reset_sampling_state=True)
    _, error = attempt(call)
    if error is None:
        generator_records(generator)
    else:
        assert generator_records(generator) == generator_records(twin), error


# ------------------------------------------------------------------ resolve_request
REQUEST_KEYS = sorted(ACCEPTED_FIELDS | {"temprature", "beam_width"})
GOOD_VALUES = st.one_of(st.integers(-1, 50), st.floats(0.0, 2.0), st.booleans(), st.none(),
                        st.lists(st.integers(0, 50), max_size=3), st.sampled_from(["stop", "hi", ""]),
                        st.dictionaries(st.sampled_from(["1", "7", "x"]), st.floats(-5, 5), max_size=2))
REQUESTS = st.one_of(
    st.dictionaries(st.sampled_from(REQUEST_KEYS), st.one_of(GOOD_VALUES, WRONG), max_size=4),
    st.dictionaries(st.sampled_from(REQUEST_KEYS), GOOD_VALUES, max_size=4).map(lambda d: {**d, "messages": []}),
    WRONG,
)
DEFAULTS = st.one_of(st.none(), st.just(GenerationDefaults(temperature=0.6, top_k=20, max_tokens=12)), WRONG)


@settings(max_examples=examples(300), **SETTINGS)
@given(REQUESTS, DEFAULTS, st.one_of(st.none(), st.integers(-1, 100), WRONG),
       st.one_of(st.none(), st.integers(-1, 100), WRONG))
@example({"": None}, None, None, None)
@example({"stop_token_ids": torch.tensor([1, 2])}, None, None, None)
@example({"use_beam_search": torch.tensor([1, 2])}, None, None, None)
@example({"prompt": "x"}, 5, None, None)
def test_resolve_request(request, defaults, max_model_len, prompt_len):
    params, _ = attempt(lambda: resolve_request(request, defaults, max_model_len=max_model_len,
                                                prompt_len=prompt_len))
    if params is not None:
        assert_normal_params(params)
        if max_model_len is not None:
            assert 1 <= params.max_tokens <= max_model_len - prompt_len


# ------------------------------------------------------------------ load_generation_defaults
CHECKPOINT_FILES = {
    "good": {"generation_config.json": {"temperature": 0.6, "top_k": 20, "eos_token_id": [2, 3]},
             "config.json": {"eos_token_id": 2}},
    "config_only": {"config.json": {"top_p": 0.5, "eos_token_id": 1}},
    "bad_json": {"generation_config.json": "{not json"},
    "binary": {"generation_config.json": b"\xff\xfe\x00"},
    "array": {"generation_config.json": [1, 2]},
    "bad_value": {"generation_config.json": {"temperature": -1}},
    "bad_eos": {"config.json": {"eos_token_id": "x"}},
    "empty": {},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    paths = {}
    for name, files in CHECKPOINT_FILES.items():
        directory = root / name
        directory.mkdir()
        for file, content in files.items():
            data = content if isinstance(content, bytes) else (
                content if isinstance(content, str) else json.dumps(content)).encode()
            (directory / file).write_bytes(data)
        paths[name] = directory
    (root / "a_file").write_text("{}")
    paths["a_file"] = root / "a_file"
    paths["missing"] = root / "missing"
    return paths


FILE_KEYS = ["temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "max_new_tokens", "do_sample", "typical_p", "epsilon_cutoff", "eta_cutoff"]


@settings(max_examples=examples(250), **SETTINGS)
@given(st.data())
def test_load_generation_defaults(checkpoints, data):
    names = sorted(checkpoints)
    place = st.sampled_from(names).map(lambda n: checkpoints[n])
    model_dir = data.draw(st.one_of(place, place.map(str), WRONG), "model_dir")
    mode = data.draw(st.one_of(st.sampled_from(["auto", "vllm", "none"]), place.map(str), place, WRONG), "mode")
    override = data.draw(st.one_of(
        st.none(), st.dictionaries(st.sampled_from(FILE_KEYS), st.one_of(GOOD_VALUES, WRONG), max_size=3),
        st.dictionaries(st.sampled_from(FILE_KEYS), st.floats(0.1, 1.0), max_size=2).map(json.dumps),
        st.text(max_size=5), WRONG), "override")
    defaults, _ = attempt(lambda: load_generation_defaults(model_dir, mode, override))
    if defaults is not None:
        assert isinstance(defaults, GenerationDefaults)
        assert_normal_params(SamplingParams(**defaults.sampling()))


def test_an_override_key_that_is_not_a_string_is_named_as_text(checkpoints):
    """Found by the property test above: a mapping override with key 0 raised with field 0 (an int)."""
    _, error = attempt(lambda: load_generation_defaults(checkpoints["good"], "auto", {0: None}))
    assert error is not None and error.field == "0"


@pytest.mark.parametrize("model_dir, mode", [(None, "auto"), (5, "auto"), (b"x", "auto"), ("", "auto"),
                                             ("binary", "auto"), ("good", "binary"), ("good", None)])
def test_load_generation_defaults_examples(checkpoints, model_dir, mode):
    """The failures found before (a path that is not a path, a file that is not UTF-8), kept as regressions."""
    model_dir = checkpoints.get(model_dir, model_dir) if isinstance(model_dir, str) else model_dir
    mode = str(checkpoints[mode]) if mode in checkpoints else mode
    _, error = attempt(lambda: load_generation_defaults(model_dir, mode))
    assert error is not None
