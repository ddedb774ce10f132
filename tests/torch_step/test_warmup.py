"""backends/torch_step/warmup.py and compile_cache.py: after `Sampler.warmup`, no step compiles anything.

With torch.compile on and a fresh inductor cache directory: warm-up prepares the compiled
functions; then batches of sizes 1, 3, 7, 13, 21, 29 and max_slots with mixed parameters (peaked
and flat rows, float32 and bfloat16 logits, a padded vocabulary) leave dynamo's counters and the
count of prepared functions unchanged, run every compiled function without an eager fallback, and
give the reference's tokens. A second process with the same cache directory loads every function
and compiles none, and the library sets no environment variable.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter

import pytest
import torch

from tests.support.runs import run_reference
from tokensampler import Sampler, SamplingParams
from tokensampler.backends.torch_step import compile_cache, warmup
from tokensampler.tools.workloads import make_logits

VOCAB, PADDED, SLOTS = 40000, 40064, 32
BATCHES = (1, 3, 7, 13, 21, 29, SLOTS)


def _mixed(r: random.Random, slot: int) -> SamplingParams:
    kinds = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=0.8, top_p=0.9),
             dict(temperature=0.7, top_k=40, top_p=0.95), dict(temperature=1.0, min_p=0.05),
             dict(temperature=0.8, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.2),
             dict(temperature=0.8, top_p=0.95, logprobs=5), dict(temperature=1.0, top_p=0.99999),
             dict(temperature=0.9, logit_bias={7: 2.0}), dict(temperature=1.0, logprobs=1)]
    return SamplingParams(seed=slot, **r.choice(kinds))


def _fallbacks() -> int:
    return sum(f["fallbacks"] for f in compile_cache.report()["functions"].values())


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """A fresh inductor cache directory for this module's compiled functions."""
    return str(tmp_path_factory.mktemp("inductor"))


@pytest.fixture
def compiled(monkeypatch, warm_cache):
    """Inductor's cache directory for this test (the samplers pass compile=True)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", warm_cache)
    return warm_cache


def test_after_warmup_no_batch_size_or_mix_compiles(compiled):
    from torch._dynamo.utils import counters
    sampler = Sampler(VOCAB, max_slots=SLOTS, padded_vocab_size=PADDED, max_logprobs=20, compile=True)
    report = sampler.warmup()
    assert report["prepared"] > 0  # the fixture's cache starts empty (or holds this module's)
    graphs, prepared, fallbacks = dict(counters["stats"]), compile_cache.prepared(), _fallbacks()
    r = random.Random(0)
    for batch in BATCHES:
        params = [_mixed(r, slot) for slot in range(batch)]
        histories = [[r.randrange(VOCAB) for _ in range(12)] for _ in range(batch)]
        for slot in range(batch):
            sampler.add_request(slot, params[slot], histories[slot])
        for flat, dtype in ((False, torch.float32), (True, torch.float32), (False, torch.bfloat16)):
            logits = make_logits(batch, PADDED, flat=flat, seed=batch).to(dtype)
            got = sampler.sample(logits)
            if dtype == torch.float32 and batch <= 7:  # the same tokens as the definition
                want = run_reference(logits, params, prompts=histories, outputs=[[] for _ in params],
                                     vocab_size=VOCAB, positions=[12] * batch)
                assert torch.equal(got.token_ids, want.token_ids)
            for slot in range(batch):  # the same state again for the next layout
                sampler.add_request(slot, params[slot], histories[slot])
    assert dict(counters["stats"]) == graphs, "dynamo traced something after warm-up"
    assert compile_cache.prepared() == prepared, compile_cache.layouts()
    assert _fallbacks() == fallbacks, compile_cache.report()["functions"]


def test_inference_mode_serves_without_fallback(compiled):
    """An engine that samples under torch.inference_mode (vLLM does) passes inference tensors: they
    run the loaded artefacts (no eager fallback, nothing compiled) and give the same tokens."""
    sampler = Sampler(VOCAB, max_slots=8, padded_vocab_size=PADDED, max_logprobs=20, compile=True)
    sampler.warmup()
    r = random.Random(1)
    params = [_mixed(r, slot) for slot in range(8)]
    logits = make_logits(8, PADDED, seed=3)
    want = []
    for mode in (False, True):
        for slot in range(8):
            sampler.add_request(slot, params[slot], [slot, 5, 9])
        prepared, fallbacks = compile_cache.prepared(), _fallbacks()
        with torch.inference_mode(mode):
            got = sampler.sample(logits.clone())
        assert compile_cache.prepared() == prepared and _fallbacks() == fallbacks, compile_cache.report()["functions"]
        want.append(got.token_ids)
    assert torch.equal(want[0], want[1])


def test_a_second_process_loads_what_warmup_compiled(compiled, tmp_path, monkeypatch):
    """Also when this process made its artefacts under another cache directory (the first test's):
    the warm-up's record must then be complete in the current one; and when this process compiled a
    function of its own (the record holds only what the warm-up's steps called: the next process
    loads the step's functions and calls each once)."""
    compiled = str(tmp_path / "moved")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", compiled)
    # and a function this process registered at run time (as a test does), which the next process lacks
    compile_cache.maybe_compiled("only_in_this_process", lambda t: t + 1, True)(torch.ones(2, 3))
    Sampler(VOCAB, max_slots=SLOTS, padded_vocab_size=PADDED, compile=True).warmup()  # (compiled above, or now)
    code = ("import json, os; from tokensampler import Sampler; "
            "from tokensampler.backends.torch_step import compile_cache as c; "
            f"r = Sampler({VOCAB}, max_slots={SLOTS}, padded_vocab_size={PADDED}, compile=True).warmup(); "
            "print(json.dumps({'warmup': r, 'functions': c.report()['functions'], 'uncalled': c.uncalled(), "
            "'env': 'TORCHINDUCTOR_CACHE_DIR' in os.environ}))")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": compiled}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    functions = result["functions"]
    # the manifest: loads, then one pass calls every loaded function (its costlier first call)
    assert result["warmup"]["steps"] == sum(len(case.layouts) for case in warmup.CASES)
    assert sum(f["compiled"] for f in functions.values()) == 0, functions
    assert result["uncalled"] == [], result["uncalled"]
    assert sum(f["loaded"] for f in functions.values()) == result["warmup"]["prepared"] > 0


def test_every_warmup_case_takes_its_route_and_every_route_is_warmed():
    """Warm-up enumerates the routes: with the default config each case takes the route it names on
    every one of its layouts (the step's record, `TorchStep.routes_taken`), every step route is
    some case's target, and so is every thresholds route in every values form it can be read in."""
    from tokensampler.backends.torch_step.routes import Route, Thresholds, Values
    vocab = warmup.EXERCISE_VOCAB
    taken = warmup.run_cases(vocab, vocab + 64, "raw_logprobs", None, torch.device("cpu"), compiled=False)
    for case, routes in zip(warmup.CASES, taken):
        if case.target is not Route.FUSED:  # an eager step never takes it (the next test)
            assert routes[case.target] >= len(case.layouts), (case, dict(routes))
    reachable = {*Route, *((route, Values.IN_PLACE) for route in Thresholds),
                 (Thresholds.LIST, Values.DIVIDED_WHERE_READ), (Thresholds.TOP_K_LIST, Values.DIVIDED_WHERE_READ)}
    assert {case.target for case in warmup.CASES} == reachable
    assert set(sum(taken, Counter())) == reachable - {Route.FUSED}  # no other route exists to be missed


def test_the_fused_case_takes_the_fused_route_in_a_compiling_step():
    """The fused route's case takes it on every layout where the step compiles (the C++ pass is loaded),
    and a case of the general routes run beside it does not (the warm-up runs those with it off)."""
    from tokensampler.backends.torch_step.routes import Route, Thresholds, Values
    fused_case = next(case for case in warmup.CASES if case.target is Route.FUSED)
    general_case = next(case for case in warmup.CASES if case.target == (Thresholds.LIST, Values.DIVIDED_WHERE_READ))
    vocab = warmup.EXERCISE_VOCAB  # peaked rows at T = 0.8 list about 1,400 ids: within the cap from V / 8
    fused_taken, general_taken = warmup.run_cases(vocab, vocab + 64, "raw_logprobs", None, torch.device("cpu"),
                                                  compiled=True, cases=(fused_case, general_case))
    assert fused_taken[Route.FUSED] == len(fused_case.layouts), dict(fused_taken)
    assert general_taken[Route.FUSED] == 0 and general_taken[general_case.target] >= len(general_case.layouts)


def test_the_library_sets_no_environment_variable(compiled, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    before = dict(os.environ)
    compile_cache.cache_dir()
    warmup.warm(300, 300, "raw_logprobs")  # a tiny scratch sampler: every route, default cache dir
    assert dict(os.environ) == before


def test_compiled_functions_serve_every_row_count_without_guards_failing(compiled):
    """One artefact per layout: row counts 0, 1, 2 and 64, padded rows and views of larger tensors
    (passed as plain aliases: no guard reads a view's base) run the compiled code (no eager
    fallback), with the eager function's results."""
    from tokensampler.backends.torch_step import row_stats
    count = compile_cache.maybe_compiled("winnable_count", row_stats._count, True)
    before = _fallbacks()
    for rows in (0, 1, 2, 64):
        views = [torch.randn(rows, 3000), torch.randn(rows, 3024)[:, :3000],  # whole rows, a padded caller
                 torch.randn(rows + 3, 3010)[3:, 5:3005],  # rows and columns of a larger tensor
                 torch.randn(2 * rows, 3000)[::2], torch.randn(3000, rows).t()[:, :]]  # strided rows
        for z in views:
            floor = torch.zeros(rows)
            assert torch.equal(count(z, floor), row_stats._count(z, floor))
    assert _fallbacks() == before


def test_a_function_first_called_on_a_row_view_serves_every_storage_offset(compiled):
    """A compiled function whose first call passes a row view (storage offset >= 2, as
    `logits[1:2]`) is compiled at offset 0: its one variant then serves tensors at offsets 0, 1 and
    more without a guard refusing them (no eager fallback), with the eager function's results."""
    from tokensampler.backends.torch_step import row_stats

    def count_rows(z: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
        return row_stats._count(z, floor)

    count = compile_cache.maybe_compiled("offset_count", count_rows, True)
    base = torch.randn(7, 3001)
    before = _fallbacks()
    for z in (base[3:4], base[:1], base.view(-1)[1:3001][None], base[2:6], base):
        floor = torch.zeros(z.shape[0])
        assert torch.equal(count(z, floor), row_stats._count(z, floor))
    assert _fallbacks() == before and len(count.variants) == 1, compile_cache.report()["functions"]["offset_count"]


def test_an_artefact_serves_only_the_thread_count_it_was_built_for(compiled, tmp_path, monkeypatch):
    """Inductor builds its CPU loops for torch's intra-op thread count, and a loaded artefact's guards
    refuse another one: after `torch.set_num_threads` changes it, a call compiles (or loads) the
    variant of the new count instead of falling back to eager, and a process started with the other
    count loads its own artefacts (the warm-up's record is per thread count): it falls back nowhere
    and compiles nothing after its warm-up."""
    from tokensampler.backends.torch_step import row_stats
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "threads"))
    threads = torch.get_num_threads()
    count = compile_cache.maybe_compiled("winnable_count", row_stats._count, True)
    z, floor = torch.randn(5, 3000), torch.zeros(5)
    before = _fallbacks()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(count(z, floor), row_stats._count(z, floor))
    finally:
        torch.set_num_threads(threads)
    assert _fallbacks() == before
    assert {key[0] for key in count.variants if key[1:] == compile_cache._layout((z, floor), (0, 1))[1:]} \
        >= {("threads", 1), ("threads", 2)}
    code = ("import json, sys, torch; from tokensampler import Sampler, SamplingParams; "
            "from tokensampler.backends.torch_step import compile_cache as c; torch.set_num_threads(int(sys.argv[1])); "
            f"s = Sampler({VOCAB}, max_slots=4, padded_vocab_size={PADDED}, compile=True); s.warmup(); "
            "p = c.prepared(); "
            "[s.add_request(i, SamplingParams(temperature=1.0, top_p=0.9, seed=i), []) for i in range(4)]; "
            f"s.sample(torch.randn(4, {PADDED}) * 4); "
            "print(json.dumps([sum(f['fallbacks'] for f in c.report()['functions'].values()), c.prepared() - p]))")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "threads")}
    for n in (1, 2):  # the first warms up cold with 1 thread; the second must not load its artefacts
        done = subprocess.run([sys.executable, "-c", code, str(n)], env=env, capture_output=True, text=True,
                              check=True)
        assert json.loads(done.stdout.strip().splitlines()[-1]) == [0, 0], done.stdout  # no fallback, no compile
