"""The CPU fast path (backends/torch_step: select, gumbel, candidates, the torch step) against reference.py.

Token for token (and every logprobs field) on randomised batches: shapes, dtypes, padded
vocabularies, parameter mixes within one batch, ties, -inf/NaN/+inf rows, histories, both the
candidate-list route and the dense route, tiny histograms (so the in-bin scan does the work).
Plus the building blocks: the int32 hash, the noise approximation bound over all 2^24 u, the
winnable floor, and which rows each stage touches in a mixed batch.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.runs import MODES, assert_same_output, run_reference, run_sampler
from tokensampler import Sampler, SamplingParams
from tokensampler.backends.torch_step import candidates, gumbel, select
from tokensampler.backends.torch_step.config import TorchStepConfig
from tokensampler.backends.torch_step.routes import Values
from tokensampler.core import rng

NEG_INF = float("-inf")
# ------------------------------------------------------------------ building blocks
def test_int32_hash_is_rng_hash():
    gen = torch.Generator().manual_seed(3)
    keys = torch.cat([torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1]),
                      torch.randint(0, 2**32, (200,), generator=gen)])
    ids = torch.cat([torch.arange(70), torch.tensor([2**17 - 1, 151935, 248319])])
    want = rng.random_bits(keys[:, None], ids[None, :])
    got = rng.hash32_words(rng.to_int32_words(keys)[:, None] ^ ids.to(torch.int32)[None, :], in_place=True)
    assert torch.equal(got.to(torch.int64) & rng.MASK32, want)


def test_noise_approximation_bound_over_every_u():
    """u has 24 random bits: check |g~ - g| < NOISE_ERROR for all 2^24 values (the low 8 bits of the
    hash do not enter u; they are set to ones here to check they are ignored)."""
    k = torch.arange(2**24, dtype=torch.int64)
    bits = (k << 8) | 0xFF
    exact = rng.gumbel_from_bits(bits).to(torch.float64)
    approx = gumbel.approx_gumbel(rng.to_int32_words(bits)).to(torch.float64)
    error = (approx - exact).abs().max().item()
    assert error < gumbel.NOISE_ERROR / 10, error


def test_win_floor_is_below_the_winnable_boundary():
    gen = torch.Generator().manual_seed(5)
    z_max = torch.cat([torch.tensor([0.0, -0.0, 1e-30, 3e38, -3e38, 17.3, -17.3, 1e7, NEG_INF]),
                       torch.randn(500, generator=gen) * 50]).to(torch.float32)
    floor = select.win_floor(z_max)
    target = z_max + torch.tensor(rng.GUMBEL_MIN, dtype=torch.float32)
    finite = torch.isfinite(z_max)
    assert bool(((floor + torch.tensor(rng.GUMBEL_MAX))[finite] < target[finite]).all())
    # and it is useful: within a few units of the true boundary for ordinary values
    ordinary = z_max.abs() < 1e4
    gap = (z_max + rng.GUMBEL_MIN - rng.GUMBEL_MAX) - floor
    assert bool((gap[ordinary & finite] < 0.01).all())


def test_candidate_gumbel_equals_reference_noise_argmax():
    gen = torch.Generator().manual_seed(11)
    z = torch.randn(6, 300, generator=gen) * 4
    z[2, :] = 1.0  # every id tied: the noise alone decides
    z[3, 10:] = NEG_INF
    keys = rng.row_key(torch.arange(6) * 7919, torch.arange(6) + 3, 0)
    ids = torch.arange(300)
    exact = z + rng.gumbel_from_bits(rng.random_bits(keys[:, None], ids[None, :]))
    want = exact.masked_fill(torch.isneginf(z), NEG_INF).argmax(dim=-1)
    values, order = torch.sort(z, dim=-1, descending=True)
    assert torch.equal(gumbel.gumbel_argmax_candidates(values, order, keys), want)
    threshold = torch.full((6,), NEG_INF)
    assert torch.equal(gumbel.gumbel_argmax_dense(z, threshold, keys, block=64), want)


def test_exact_tie_of_scores_goes_to_lowest_id():
    # the same id twice in a candidate list with the same value: equal exact scores
    keys = rng.row_key(torch.tensor([1]), torch.tensor([2]), 0)
    values = torch.tensor([[0.5, 0.5, 0.5]])
    ids = torch.tensor([[9, 4, 4]])
    scores = 0.5 + rng.gumbel_from_bits(rng.random_bits(keys, torch.tensor([9, 4])))
    want = 9 if scores[0] > scores[1] else 4
    assert int(gumbel.gumbel_argmax_candidates(values, ids, keys)[0]) == want


def test_histogram_threshold_equals_candidate_threshold():
    gen = torch.Generator().manual_seed(2)
    z = (torch.randn(4, 500, generator=gen) * 2).round()  # many ties
    z_max = z.amax(dim=-1)
    tau = torch.full((4,), NEG_INF)
    top_p = torch.tensor([0.3, 0.5, 0.9, 0.99], dtype=torch.float64)
    bound = top_p * select.kept_mass(z, z_max, tau)
    values = torch.sort(z, dim=-1, descending=True).values
    want, found = select.top_p_from_candidates(values, z_max, tau, bound)
    assert bool(found.all())
    for bins in (1, 2, 7, 4096):
        config = TorchStepConfig(histogram_bins=bins)
        assert torch.equal(select.top_p_by_histogram(z, z_max, tau, bound, config=config), want)
        assert torch.equal(select.top_p_by_histogram(z, z_max, tau, None, top_p, config=config), want)


# ------------------------------------------------------------------ end to end against the oracle
ROW_PARAMS = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.25, 0.8, 1.0, 2.5]),
    "top_k": st.sampled_from([0, 0, 1, 2, 3, 10]),
    "top_p": st.sampled_from([1.0, 1.0, 0.05, 0.3, 0.7, 0.95, 0.999]),
    "min_p": st.sampled_from([0.0, 0.0, 0.05, 0.5, 1.0]),
    "presence_penalty": st.sampled_from([0.0, 0.0, 0.5, -1.0]),
    "frequency_penalty": st.sampled_from([0.0, 0.0, 0.3, -0.7]),
    "repetition_penalty": st.sampled_from([1.0, 1.0, 1.3, 0.6]),
    "seed": st.integers(0, 2**64 - 1),
    "logprobs": st.sampled_from([None, None, 0, 1, 3]),
})


@st.composite
def batches(draw):
    batch = draw(st.integers(1, 5))
    vocab = draw(st.sampled_from([1, 2, 5, 17, 64, 300]))
    padded = vocab + draw(st.sampled_from([0, 0, 3]))
    style = draw(st.sampled_from(["normal", "wide", "ties", "flat", "peaked"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(batch, padded, generator=gen)
    if style == "wide":
        logits *= 30
    elif style == "ties":
        logits = (logits * 2).round()
    elif style == "flat":
        logits *= 0.01
    elif style == "peaked":
        logits = 18 - 2.2 * torch.log(torch.rand(batch, padded, generator=gen) * padded + 1)
    for row in range(batch):
        special = draw(st.sampled_from(["none", "none", "none", "neginf", "nan", "posinf", "all_removed"]))
        if special == "neginf":
            logits[row, : max(1, vocab // 2)] = NEG_INF
        elif special == "nan":
            logits[row, draw(st.integers(0, vocab - 1))] = float("nan")
        elif special == "posinf":
            logits[row, draw(st.integers(0, vocab - 1))] = float("inf")
            logits[row, draw(st.integers(0, vocab - 1))] = float("inf")
        elif special == "all_removed":
            logits[row, :vocab] = NEG_INF
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
    params, prompts, outputs = [], [], []
    for _ in range(batch):
        kw = draw(ROW_PARAMS)
        if kw["logprobs"] is not None:
            kw["logprobs"] = min(kw["logprobs"], vocab)
        if draw(st.booleans()) and vocab > 2:
            kw["logit_bias"] = {draw(st.integers(0, vocab - 1)): draw(st.sampled_from([-100.0, 2.5, 100.0]))}
        if draw(st.integers(0, 5)) == 0:
            kw["allowed_token_ids"] = sorted(set(draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4))))
        if draw(st.integers(0, 5)) == 0:
            kw["min_tokens"] = 3
            kw["stop_token_ids"] = [draw(st.integers(0, vocab - 1))]
        params.append(SamplingParams(**kw))
        prompts.append(draw(st.lists(st.integers(0, vocab - 1), max_size=6)))
        outputs.append(draw(st.lists(st.integers(0, vocab - 1), max_size=6)))
    mode = draw(st.sampled_from(MODES))
    return logits.to(dtype), params, prompts, outputs, vocab, mode


def _compare(case, eos=(), config=None):
    logits, params, prompts, outputs, vocab, mode = case
    kw = dict(prompts=prompts, outputs=outputs, vocab_size=vocab, logprobs_mode=mode, eos=eos)
    assert_same_output(run_reference(logits, params, **kw), run_sampler(logits, params, config=config, **kw))


FAST = settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DENSE = TorchStepConfig(candidate_cap=0, dense_block=40)  # every sampled row on the dense route, several blocks per row
# the list holds only when it is tiny; the crossing bin holds many ids; one row per block
TINY = TorchStepConfig(candidate_cap=3, histogram_bins=2, block_elements=1, flat_block_elements=1)


@FAST
@given(case=batches())
def test_matches_reference_candidate_route(case):
    _compare(case, eos=(0,))


@FAST
@given(case=batches())
def test_matches_reference_dense_route(case):
    _compare(case, config=DENSE)


@FAST
@given(case=batches())
def test_matches_reference_tiny_histogram_and_blocks(case):
    _compare(case, config=TINY)


@st.composite
def plain_batches(draw):
    """Batches the direct route takes: float32 logits, nothing to remove or add before T
    except penalties (written in place and restored)."""
    logits, params, prompts, outputs, vocab, mode = draw(batches())
    keep = ("temperature", "top_k", "top_p", "min_p", "seed", "logprobs", "presence_penalty",
            "frequency_penalty", "repetition_penalty")
    params = [SamplingParams(**{f: getattr(p, f) for f in keep}) for p in params]
    return logits.float(), params, prompts, outputs, vocab, draw(st.sampled_from(MODES[:2]))


@FAST
@given(case=plain_batches(), direct=st.booleans())
def test_matches_reference_direct_route(case, direct):
    _compare(case, config=TorchStepConfig(direct_route=direct))


def _record_routes(monkeypatch) -> list[bool]:
    """A list that gets, per `candidates.sample_rows` call, whether it ran in place (block route)."""
    seen = []
    real = candidates.sample_rows

    def spy(*args, **kw):
        seen.append(kw.get("values", Values.IN_PLACE) is Values.IN_PLACE)
        return real(*args, **kw)

    monkeypatch.setattr(candidates, "sample_rows", spy)
    return seen


def test_direct_route_is_taken_and_matches_the_block_route(monkeypatch):
    """Bench-shaped float32 rows without edits but penalties run on the caller's logits (no
    in-place division); the logits are as they were after the step (penalties restored) and the
    tokens and logprobs equal the reference's and the block route's."""
    from tokensampler.tools.workloads import make_logits
    seen = _record_routes(monkeypatch)
    logits = make_logits(4, 20000, seed=3)
    before = logits.clone()
    params = [SamplingParams(temperature=0.6, top_p=0.9, seed=1, repetition_penalty=1.3, logprobs=3),
              SamplingParams(temperature=0.6, seed=2),
              SamplingParams(temperature=0.7, top_k=20, top_p=0.95, seed=3, logprobs=5, frequency_penalty=0.5),
              SamplingParams(temperature=0.0, logprobs=2, presence_penalty=2.0)]
    top = logits.topk(3, dim=-1).indices.tolist()  # penalise ids that matter
    history = dict(prompts=[top[0][:2], [], [1, 2], top[3][:1]], outputs=[[5], [], top[2][:2] * 2, top[3][:1]])
    want = run_reference(logits, params, **history)
    direct = run_sampler(logits, params, **history)
    assert seen == [False] and torch.equal(logits, before)
    blocked = run_sampler(logits, params, config=TorchStepConfig(direct_route=False), **history)
    assert seen[1:] and all(seen[1:])
    assert_same_output(want, direct)
    assert_same_output(want, blocked)


def test_undivided_floor_is_below_every_value_that_divides_above_lower():
    gen = torch.Generator().manual_seed(7)
    z = torch.cat([torch.randn(200000, generator=gen) * 40, torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38])])
    for t in (0.05, 0.3, 0.7, 1.0, 1.3, 7.0):
        scale = torch.tensor([t])
        divided = z / t
        for lower in divided[torch.randint(0, z.numel(), (50,), generator=gen)].tolist() + [0.0, 1e-40]:
            floor = candidates.undivided_floor(torch.tensor([lower]), scale)
            assert bool((z[divided >= lower] >= floor).all()), (t, lower)


def test_bench_shaped_rows_match_reference():
    """LLM-shaped rows (the bench's generator) at a vocabulary where every route is exercised."""
    from tokensampler.tools.workloads import make_logits
    for flat in (False, True):
        logits = make_logits(4, 20000, flat=flat, seed=3)
        params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=1.0, seed=2),
                  SamplingParams(temperature=0.7, top_k=20, top_p=0.95, seed=3, logprobs=5),
                  SamplingParams(temperature=1.0, min_p=0.05, seed=4)]
        for mode in ("raw_logprobs", "processed_logprobs"):
            _compare((logits, params, [[1, 2, 3]] * 4, [[5, 5]] * 4, 20000, mode))


# ------------------------------------------------------------------ mixed batches do per-row work
def test_mixed_batch_routes_each_row_to_its_own_work(monkeypatch):
    """Greedy rows never reach the noise; only rows whose top-p needs the whole row's mass get the
    full-row pass (the tail below their list); the other rows work on their candidate lists."""
    from tokensampler.backends.torch_step import row_stats
    calls = {"noise_rows": 0, "kept_mass_rows": 0, "tail_rows": 0}
    real_noise, real_mass, real_tail = gumbel.gumbel_argmax_candidates, select.kept_mass, row_stats.tail_mass

    def noise(values, ids, keys):
        calls["noise_rows"] += values.shape[0]
        return real_noise(values, ids, keys)

    def mass(z, *args, **kw):
        calls["kept_mass_rows"] += z.shape[0]
        return real_mass(z, *args, **kw)

    def tail(z, *args):
        calls["tail_rows"] += z.shape[0]
        return real_tail(z, *args)

    monkeypatch.setattr(gumbel, "gumbel_argmax_candidates", noise)
    monkeypatch.setattr(select, "kept_mass", mass)
    monkeypatch.setattr(row_stats, "tail_mass", tail)
    from tokensampler.tools.workloads import make_logits
    logits = make_logits(6, 5000, seed=1)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.5, top_p=0.9, seed=1), SamplingParams(temperature=0.5, seed=2),
              SamplingParams(temperature=0.5, top_k=5, seed=3), SamplingParams(temperature=0.0)]
    sampler = Sampler(5000, max_slots=6)
    for b, p in enumerate(params):
        sampler.add_request(b, p, [])
    got = sampler.sample(logits)
    assert calls == {"noise_rows": 3, "kept_mass_rows": 0, "tail_rows": 1}
    assert_same_output(run_reference(logits, params), got)


def test_penalty_state_update_is_by_token():
    sampler = Sampler(50, max_slots=3)
    for slot in range(3):
        sampler.add_request(slot, SamplingParams(temperature=0.0, frequency_penalty=0.5), [1, 2],
                            output_token_ids=[7, 7])
    before = sampler.state.output_counts.clone()
    logits = torch.zeros(2, 50)
    logits[0, 9] = 5.0
    logits[1, 11] = 5.0
    out = sampler.sample(logits, slots=[2, 0])
    assert out.token_ids.tolist() == [9, 11]
    diff = sampler.state.output_counts - before
    assert diff.sum() == 2 and diff[2, 9] == 1 and diff[0, 11] == 1


@pytest.mark.parametrize("direct", [True, False])
def test_no_logits_sized_allocation_in_a_step(direct):
    """Direct route: temporaries only; block route: a block workspace plus block-sized
    temporaries. Either way the step's peak extra memory, the held workspace included, stays
    below one float32 buffer of the logits (the bench reports the same measure on the matrix)."""
    from tokensampler.tools.bench_memory import step_memory_report
    # the bench's proportions: blocks << logits
    config = TorchStepConfig(block_elements=1 << 13, flat_block_elements=1 << 13, direct_route=direct,
                             dense_block=1 << 12, column_chunk=1 << 11)
    batch, vocab = 32, 1 << 12  # 16 blocks of 2 rows
    from tokensampler.tools.workloads import make_logits
    logits = make_logits(batch, vocab, seed=2)
    sampler = Sampler(vocab, max_slots=batch, step_config=config)
    for b in range(batch):
        # T = 0.45: about 1.5% of the ids can win, as on the bench's rows (T = 0.8 at V = 151936)
        sampler.add_request(b, SamplingParams(temperature=0.45, top_p=0.9, seed=b, logprobs=3), [])
    report = step_memory_report(lambda: sampler.sample(logits), logits, vocab, lambda: sampler.workspace_bytes)
    assert report["peak_extra_bytes"] > 0 and (report["held_bytes"] > 0) == (not direct), report
    assert report["ratio"] <= 1.0, report  # at most one float32 logits buffer


def test_peak_memory_measure_sees_allocations():
    def step():
        a = torch.empty(1000, 1000)  # 4 MB
        b = torch.empty(500, 1000)  # 2 MB
        del a
        c = torch.empty(250, 1000)  # 1 MB
        return b.sum() + c.sum()
    from tokensampler.tools.bench_memory import peak_extra_bytes
    assert 6_000_000 <= peak_extra_bytes(step) < 6_100_000


def test_compiled_path_matches_reference_and_eager():
    """compile=True: the dense noise block runs through inductor. Its hash bits equal rng's, its
    noise is within the bound the exact recheck relies on, and the tokens equal the reference's and
    the eager path's."""
    from tokensampler.backends.torch_step import compile_cache
    scores_of = compile_cache.maybe_compiled("approx_scores", gumbel.approx_scores, True)
    assert scores_of is not gumbel.approx_scores
    keys = rng.row_key(torch.tensor([3, 99]), torch.tensor([5, 6]), 0)
    ids = torch.arange(1 << 18, dtype=torch.int32)
    z = torch.zeros(2, ids.numel())
    approx = scores_of(rng.to_int32_words(keys)[:, None], ids, z, torch.full((2, 1), NEG_INF))
    exact = rng.gumbel_from_bits(rng.random_bits(keys[:, None], ids.to(torch.int64)[None, :]))
    assert (approx.double() - exact.double()).abs().max().item() < gumbel.NOISE_ERROR / 10
    assert compile_cache.report()["functions"]["approx_scores"]["variants"] >= 1
    from tokensampler.tools.workloads import make_logits
    logits = make_logits(3, 3000, flat=True, seed=4)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=1), SamplingParams(temperature=0.9, seed=2),
              SamplingParams(temperature=1.0, min_p=0.001, seed=3, logprobs=2)]
    dense = TorchStepConfig(candidate_cap=0)
    want = run_reference(logits, params, logprobs_mode="processed_logprobs")
    compiled = run_sampler(logits, params, logprobs_mode="processed_logprobs", config=dense, compile=True)
    eager = run_sampler(logits, params, logprobs_mode="processed_logprobs", config=dense, compile=False)
    assert_same_output(want, compiled)
    assert_same_output(want, eager)


@pytest.mark.parametrize("cap,bins", [(0, 4096), (0, 1), (3, 4096), (8192, 4096)])
def test_top_p_bound_reached_exactly_is_the_border(cap, bins):
    """p = 1, 1/2, 1/4, 1/4 (exact in float32): with top_p = 0.75 the mass above the 1/4 ids is
    1.5 = 0.75 * 2 exactly, not < the bound: they go; the 1/2 id (mass above 1 < 1.5) stays."""
    logits = torch.tensor([[0.0, math.log(0.5), math.log(0.25), math.log(0.25), NEG_INF]])
    assert torch.exp(logits[0, :4]).tolist() == [1.0, 0.5, 0.25, 0.25]
    config = TorchStepConfig(candidate_cap=cap, histogram_bins=bins)  # 1 bin: the in-bin scan finds the border
    params = [SamplingParams(top_p=0.75, seed=9, logprobs=5)]
    want = run_reference(logits, params, logprobs_mode="processed_logits")
    got = run_sampler(logits, params, logprobs_mode="processed_logits", config=config)
    assert_same_output(want, got)
    kept = {int(i) for i, v in zip(got.logprobs.top_token_ids[0], got.logprobs.top_logprobs[0]) if v > NEG_INF}
    assert kept == {0, 1}


@pytest.mark.parametrize("mode", MODES)
def test_temperature_overflow_to_minus_inf_empties_the_row(mode):
    """z / T overflows to -inf for every id of row 1 (and for some ids of row 0): row 1 has no id
    left, is invalid and gets its raw greedy id; row 0 samples among the ids that stay finite."""
    logits = torch.tensor([[-3e38, -3.1e38, -2e38, 5.0], [-3e38, -3.2e38, -3.3e38, -3.05e38]])
    params = [SamplingParams(temperature=0.01, seed=1, logprobs=2),
              SamplingParams(temperature=0.01, seed=2, logprobs=4)]
    want = run_reference(logits, params, logprobs_mode=mode)
    got = run_sampler(logits, params, logprobs_mode=mode)
    assert_same_output(want, got)
    assert got.valid.tolist() == [True, False] and got.token_ids.tolist() == [3, 0]


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logits"])
def test_top_p_total_over_a_kept_set_longer_than_the_sorted_head(mode):
    """top-k = 200 or min-p keep more ids than the 64-value head the top-p search starts from: the
    total kept mass must come from the whole list (the kept set, seen through processed logits)."""
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(4, 400, generator=gen) * 0.3).float()
    params = [SamplingParams(top_k=200, top_p=0.6, seed=1, logprobs=400),
              SamplingParams(min_p=0.3, top_p=0.5, seed=2, logprobs=400),
              SamplingParams(top_k=150, top_p=0.95, temperature=0.7, seed=3, logprobs=400),
              SamplingParams(top_p=0.5, seed=4, logprobs=400)]
    want = run_reference(logits, params, logprobs_mode=mode)
    got = run_sampler(logits, params, logprobs_mode=mode)
    assert_same_output(want, got)
    if mode == "processed_logits":
        kept = (got.logprobs.top_logprobs > NEG_INF).sum(dim=-1)
        assert bool((kept[:3] > TorchStepConfig().top_p_head).all()), kept


def test_compiled_direct_route_matches_reference(monkeypatch):
    """compile=True through the direct route: the compiled count and tail (with its error bound),
    penalties written and restored, raw logprobs from the compiled statistics."""
    from tokensampler.tools.workloads import make_logits
    seen = _record_routes(monkeypatch)
    logits = make_logits(6, 30000, seed=8)
    before = logits.clone()
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=5),
              SamplingParams(temperature=0.7, top_p=0.95, seed=2, repetition_penalty=1.2, frequency_penalty=0.4),
              SamplingParams(temperature=0.8, top_k=50, seed=3, logprobs=2),
              SamplingParams(temperature=1.0, min_p=0.05, seed=4, presence_penalty=0.5),
              SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.6, top_k=20, top_p=0.9, seed=6)]
    top = logits.topk(4, dim=-1).indices.tolist()
    history = dict(prompts=[[], top[1][:2], [], top[3][:1], [], []], outputs=[[], top[1][2:3], [], [7], [], []])
    want = run_reference(logits, params, **history)
    got = run_sampler(logits, params, config=TorchStepConfig(fused_route=False), compile=True, **history)
    assert seen == [False] and torch.equal(logits, before)
    assert_same_output(want, got)
    assert_same_output(want, run_sampler(logits, params, compile=True, **history))  # the fused route
    assert seen == [False] and torch.equal(logits, before)
    assert_same_output(want, run_sampler(logits, params, config=TorchStepConfig(direct_route=False), compile=True,
                                         **history))


# ------------------------------------------------------------------ the head route of top-p
def gaussian_rows(rows: int, vocab: int, std: float, seed: int) -> torch.Tensor:
    """Logits like a small random LM's: N(0, std^2) per id. At std 4 / T 0.8 tens of thousands of ids
    can still win the Gumbel race, but top-p 0.9 keeps a few hundred at most."""
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * std


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_top_p_rows_with_many_winnable_ids_take_the_head_route(mode, monkeypatch):
    """Gaussian rows: too many winnable ids for a candidate list, so the ids at or above the 256th
    chunk maximum are listed; the top-p crossing lies there, the dense route is never run, and the
    tokens and logprobs are the reference's."""
    dense_calls = []
    real_dense = candidates._dense_route
    monkeypatch.setattr(candidates, "_dense_route", lambda *a: dense_calls.append(1) or real_dense(*a))
    logits = gaussian_rows(6, 60000, 4.0, seed=1)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, logprobs=3) for s in range(5)]
    params.append(SamplingParams(temperature=0.8, top_p=0.9, min_p=0.01, seed=9, logprobs=2))
    want = run_reference(logits, params, logprobs_mode=mode)
    got = run_sampler(logits, params, logprobs_mode=mode)
    assert_same_output(want, got)
    assert dense_calls == []


def test_head_route_falls_back_to_the_dense_route_when_the_crossing_is_deeper():
    """top-p 0.999 on the same rows: the crossing lies below the listed head, the dense route decides,
    and the tokens are still the reference's (a kept set cut at the head would differ)."""
    logits = gaussian_rows(4, 60000, 4.0, seed=2)
    params = [SamplingParams(temperature=0.8, top_p=0.999, seed=s) for s in range(4)]
    for config in (TorchStepConfig(), TorchStepConfig(top_p_head_chunks=2)):
        assert_same_output(run_reference(logits, params), run_sampler(logits, params, config=config))


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_head_route_sends_only_the_rows_whose_crossing_is_deeper_to_the_dense_route(mode, monkeypatch):
    """A block of gaussian rows, five at top-p 0.9 (the crossing in the head) and two at 0.999
    (below it): the dense route runs once, on those two rows alone, and every row's token, logprobs
    and processed values are the reference's."""
    dense_rows = []
    real_dense = candidates._dense_route
    monkeypatch.setattr(candidates, "_dense_route", lambda z, *a: dense_rows.append(z.shape[0]) or real_dense(z, *a))
    logits = gaussian_rows(7, 60000, 4.0, seed=3)
    params = [SamplingParams(temperature=0.8, top_p=0.999 if s in (1, 4) else 0.9, seed=s, logprobs=3)
              for s in range(7)]
    want = run_reference(logits, params, logprobs_mode=mode)
    got = run_sampler(logits, params, logprobs_mode=mode)
    assert_same_output(want, got)
    assert dense_rows == [2]


@pytest.mark.parametrize("special", ["none", "nan", "all_removed", "posinf", "padded"])
def test_plain_greedy_rows_of_a_long_vocabulary_match_the_reference(special):
    """Plain greedy batches of a long vocabulary (blocked argmax on the logits themselves, the row
    maxima from the block maxima); a NaN or an all -inf row sends the batch to the general path,
    which returns the reference's ids and validity."""
    from tokensampler.tools.workloads import make_logits
    logits = make_logits(3, 20000, seed=5)
    vocab = 20000
    if special == "nan":
        logits[1, 12345] = float("nan")
    elif special == "all_removed":
        logits[2] = NEG_INF
    elif special == "posinf":
        logits[0, 17] = logits[0, 19000] = float("inf")
    elif special == "padded":
        vocab = 19990  # logits[:, :V] is a view with a row stride of the padded width
        logits[:, vocab:] = 1e9
    params = [SamplingParams(temperature=0.0)] * 3
    want = run_reference(logits, params, vocab_size=vocab)
    got = run_sampler(logits, params, vocab_size=vocab)
    assert_same_output(want, got)
    assert got.valid.tolist() == [True, True, special != "all_removed"]
