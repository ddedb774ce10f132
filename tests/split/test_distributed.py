"""Vocabulary split over a group (backends/split, parallel/agreement): token-for-token equal to the unsplit Sampler.

Two transports run the same random cases (tests/support/split_cases.py): threads of this process
(fast, many shapes) and real gloo process groups started with torch.multiprocessing (one world of
4 ranks whose sub-groups of ranks [0, n) give process groups of sizes 1-4, many checks per start).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

import tests.support.split_cases as dc
from tokensampler import InvalidSamplingParams, Sampler, SamplingParams, SplitMismatch
from tokensampler.backends.split import merge as sel
from tokensampler.core.order import KEY_NEG_INF, order_key, saturate_posinf
from tokensampler.parallel import SamplingDP, sampling_dp


# ------------------------------------------------------------------ the merge math
def test_every_filter_of_the_definition_has_a_split_merge():
    """A filter added to the plan (`core.plan.FILTER_STAGES`) without its exact merge fails here; the
    full-row stages, which have none, run on the rows gathered whole (`backends/split/full_rows.py`)."""
    from tokensampler.backends.split.step import SPLIT_FILTERS, SPLIT_WHOLE_ROWS
    from tokensampler.core.plan import FILTER_STAGES, FULL_ROW_STAGES

    assert tuple(SPLIT_FILTERS) == tuple(name for name in FILTER_STAGES if name not in SPLIT_WHOLE_ROWS)
    assert SPLIT_WHOLE_ROWS == FULL_ROW_STAGES


def test_bisection_rounds_reach_a_single_key():
    assert sel.bisection_rounds(255) == 4
    assert sel.bisection_rounds(15) == 8
    lo = torch.tensor([KEY_NEG_INF])
    hi = order_key(torch.tensor([3e38]))
    target = int(order_key(torch.tensor([-1.2345])))  # mass above drops below the bound here
    for _ in range(sel.bisection_rounds(255)):
        pivots = sel.bisection_pivots(lo, hi, 255)
        lo, hi = sel.bisection_step(lo, hi, pivots, pivots >= target)
    assert int(hi) == target and int(hi - lo) == 1


def test_merge_max_takes_the_lowest_id_on_ties():
    values = torch.tensor([[1.0, 5.0, float("-inf")], [2.0, 5.0, float("-inf")], [2.0, 4.0, float("-inf")]],
                          dtype=torch.float64)
    ids = torch.tensor([[0, 7, 0], [10, 13, 10], [24, 20, 20]])
    best, chosen = sel.merge_max_lowest_id(values, ids)
    assert best.tolist() == [2.0, 5.0, float("-inf")]
    assert chosen.tolist() == [10, 7, 0]
    assert sel.owner_of(ids, chosen).tolist() == [1, 0, 0]


def test_merge_kth_largest_counts_ties_and_short_rows():
    candidates = torch.tensor([[[5.0, 3.0, 3.0]], [[4.0, 3.0, float("-inf")]]])
    for k, want in [(1, 5.0), (2, 4.0), (3, 3.0), (5, 3.0), (6, float("-inf")), (7, float("-inf")), (0, float("-inf"))]:
        assert sel.merge_kth_largest(candidates, torch.tensor([k])).item() == want, k


def test_merge_logsumexp_matches_log_softmax_including_huge_and_posinf_rows():
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(4, 12, generator=gen) * 10
    rows[1, :5] = 3e38
    rows[2, 3] = float("inf")
    rows[2, 7] = float("inf")
    rows[3] = float("-inf")
    parts = rows.reshape(4, 3, 4).permute(1, 0, 2)  # 3 ranks of 4 columns
    shift, log_total = sel.merge_logsumexp(torch.stack([sel.local_sumexp(p) for p in parts]))
    got = sel.log_softmax_from(saturate_posinf(rows, rows.amax(-1) == float("inf")), shift, log_total)
    want = torch.log_softmax(saturate_posinf(rows, rows.amax(-1) == float("inf"))[:3], dim=-1)
    assert torch.allclose(got[:3], want, atol=1e-5)
    assert torch.isneginf(got[3]).all()


def test_merge_top_n_orders_by_value_then_id():
    keys = torch.tensor([[[3.0, 1.0, float("-inf")]], [[3.0, 2.0, float("-inf")]]])
    ids = torch.tensor([[[4, 0, 2]], [[1, 5, sel.SENTINEL_ID]]])
    top_keys, top_ids = sel.merge_top_n(keys, ids, 5)
    assert top_ids.tolist() == [[1, 4, 5, 0, 2]]
    assert top_keys.tolist() == [[3.0, 3.0, 2.0, 1.0, float("-inf")]]


# ------------------------------------------------------------------ threads: many shapes
def check_cases_on_threads(world: int, cases: list[tuple[str, dc.Case]]) -> None:
    """Each (label, case) on `world` threads, against the reference; every failure reported."""
    failures = []
    for label, case in cases:
        for rank_failures in dc.run_threads(world, lambda ex, case=case, label=label: dc.check_case(
                case, ex, label, with_reference=True)):
            failures += rank_failures
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_split_equals_unsplit_sampler_threads(world):
    check_cases_on_threads(world, [
        (f"threads w{world} V{vocab}/{padded} {mode} seed {seed}", dc.make_case(seed, vocab, padded, mode))
        for vocab, padded in dc.CONFIGS[world] for m, mode in enumerate(dc.MODES)
        for seed in (100 * world + 10 * m + vocab, 7919 * world + m + vocab)])


@pytest.mark.parametrize("world", [2, 3])
def test_full_row_samplers_equal_the_unsplit_sampler_threads(world):
    """Every row turns on a full-row sampler (dynamic temperature, top-n-sigma, typical-p, epsilon, eta,
    XTC, Mirostat; each alone, or all of them with every other field), four steps in every logprobs
    mode, vocabularies padded in the last rank and across ranks: tokens, validity and log-probs
    equal to the unsplit sampler's (step 0 also to the reference), Mirostat's mu to the bit on
    every rank after every step."""
    check_cases_on_threads(world, [
        (f"full rows w{world} V{vocab}/{padded} {mode} seed {seed}",
         dc.make_case(seed, vocab, padded, mode, steps=4, kinds=dc.FULL_ROW_KINDS))
        for vocab, padded in dc.CONFIGS[world] for m, mode in enumerate(dc.MODES) for seed in (50 * world + m,)])


def test_mirostat_mu_on_a_split_moves_as_unsplit_on_every_rank():
    """Mirostat rows alone (with other full-row samplers and plain rows beside them) over eight steps
    on 3 ranks: mu moves, and is the unsplit sampler's on every rank after every step."""
    vocab, padded, world = 100, 102, 3
    params = [SamplingParams(seed=1, mirostat_tau=2.0, mirostat_eta=0.5, logprobs=2),
              SamplingParams(seed=2, mirostat_tau=1.0, mirostat_eta=1.0, top_k=40, typical_p=0.9),
              SamplingParams(seed=3, top_p=0.9), SamplingParams(seed=4, mirostat_tau=3.0, temperature=0.0),
              SamplingParams(seed=5, mirostat_tau=4.0, mirostat_eta=0.2, dynatemp_range=0.5)]
    gen = torch.Generator().manual_seed(9)
    steps = [torch.randn(len(params), padded, generator=gen) * 2 for _ in range(8)]

    def drive(sampler, rank, width):
        for b, p in enumerate(params):
            sampler.add_request(b, p, [3, 4])
        mus = []
        for logits in steps:
            sampler.sample(logits[:, rank * width:(rank + 1) * width])
            mus.append(sampler.mus_of(range(len(params))))
        return mus

    want = drive(Sampler(vocab, max_slots=len(params), padded_vocab_size=padded), 0, padded)
    assert want[-1][0] != 4.0 and want[-1][1] != 2.0 and want[-1][4] != 8.0  # mu moved
    assert all(m[3] == 6.0 and m[2] is None for m in want)  # greedy: no update; no Mirostat: None
    got = dc.run_threads(world, lambda ex: drive(Sampler(vocab, max_slots=len(params), padded_vocab_size=padded,
                                                         group=ex), ex.rank, padded // world))
    assert got == [want] * world


def test_full_row_rows_move_their_slices_and_nothing_more():
    """A full-row row added to a batch moves, beyond its share of the summaries and the log-probs
    (float64 [1, 5 (+3)] and [1, 1 + 2 N]), one all-gather of its slice (float32 [1, Vp / W]), plus
    one of float64 [1] in the raw modes (the raw value at the token); a batch of full-row rows
    only runs none of the plain rows' top-k, top-p and winner collectives."""
    vocab, padded, world = 203, 208, 2
    width = padded // world
    plain = [SamplingParams(seed=1, top_k=5, top_p=0.9, logprobs=2), SamplingParams(seed=2, temperature=0.0)]
    full = [SamplingParams(seed=3, typical_p=0.7, top_p=0.9, logprobs=2), SamplingParams(seed=4, mirostat_tau=2.0)]
    logits = torch.randn(3, padded, generator=torch.Generator().manual_seed(2))

    def measure(params, mode):
        def run(ex):
            sampler = Sampler(vocab, max_slots=3, padded_vocab_size=padded, group=ex, logprobs_mode=mode)
            for b, p in enumerate(params):
                sampler.add_request(b, p, [0])
            ex.reset_counters()
            sampler.sample(logits[:len(params), ex.rank * width:(ex.rank + 1) * width])
            return ex.calls, ex.bytes_sent, ex.bytes_received
        return dc.run_threads(world, run)[0]

    for mode in dc.MODES:
        raw = mode.startswith("raw")
        summary = 5 + 3 * (mode in ("raw_logprobs", "processed_logprobs"))
        calls, sent, received = measure(plain, mode)
        more_calls, more_sent, more_received = measure(plain + full[:1], mode)
        assert more_calls - calls == 1 + raw, mode
        assert more_sent - sent == 8 * summary + 8 * (1 + 2 * 2) + 4 * width + 8 * raw, mode
        assert more_received - received == more_sent - sent  # world 2
        # check, summaries, the rows, (raw values), log-probs: no top-k, top-p or winner all-gather
        assert measure(full, mode)[0] == 4 + raw, mode


@pytest.mark.parametrize("world", [2, 3])
def test_split_equals_the_reference_on_slices_wider_than_the_top_p_candidates(world):
    """Slices of 1,000+ columns: top-p bisects on each rank's 256 largest values, and sorts the
    slice in the steps whose candidates fall short of the bound (flat rows): both token for token."""
    check_cases_on_threads(world, [
        (f"threads w{world} V3001 {mode}", dc.make_case(31 * world + m, 3001, 3003 if world == 3 else 3002, mode,
                                                       steps=2, rows=6))
        for m, mode in enumerate(dc.MODES)])


@pytest.mark.parametrize("world", [2, 3])
def test_top_p_on_wide_slices_flat_and_peaked_rows_equals_the_unsplit_sampler(world):
    """Flat rows (the candidates hold less than the bound: the slice is sorted), peaked rows (the
    candidates decide), ties, with top-p alone and with top-k / min-p: the unsplit sampler's tokens."""
    vocab, padded = 3001, 3003 if world == 3 else 3002
    gen = torch.Generator().manual_seed(world)
    scales = [0.3, 1.0, 3.0, 8.0, 1.0, 0.3, 8.0, 3.0]
    logits = torch.stack([torch.randn(padded, generator=gen) * s for s in scales])
    logits[4] = torch.round(logits[4] * 2) / 2  # ties
    params = [SamplingParams(seed=10 + b, top_p=tp, temperature=t, top_k=k, min_p=mp)
              for b, (tp, t, k, mp) in enumerate([(0.9, 1.0, 0, 0.0), (0.5, 0.7, 0, 0.0), (0.99, 1.0, 0, 0.0),
                                                  (0.9, 0.8, 0, 0.0), (0.7, 1.0, 0, 0.0), (0.95, 1.3, 500, 0.0),
                                                  (0.3, 1.0, 0, 0.001), (0.8, 1.0, 40, 0.0)])]
    whole = Sampler(vocab, max_slots=len(params), padded_vocab_size=padded)
    for b, p in enumerate(params):
        whole.add_request(b, p, [0, 1])
    want = whole.sample(logits).token_ids.tolist()
    width = padded // world

    def run(ex):
        sampler = Sampler(vocab, max_slots=len(params), padded_vocab_size=padded, group=ex)
        for b, p in enumerate(params):
            sampler.add_request(b, p, [0, 1])
        return sampler.sample(logits[:, ex.rank * width:(ex.rank + 1) * width]).token_ids.tolist()

    assert dc.run_threads(world, run) == [want] * world


def test_candidate_mass_is_exact_at_and_above_its_floor_and_a_lower_bound_below():
    gen = torch.Generator().manual_seed(5)
    z = torch.round(torch.randn(4, 500, generator=gen) * 3) / 2  # ties, also at the floor
    p = torch.exp(z - z.amax(-1, keepdim=True))
    full, cand = sel.MassAbove(z, p), sel.CandidateMass(z, p, 40)
    pivots = torch.sort(torch.cat([z[:, :60], z[:, :60] - 0.25], dim=-1), dim=-1).values
    exact, bounded = full.at(pivots), cand.at(pivots)
    above = pivots >= cand.floor[:, None]
    assert above.any() and (~above).any()
    assert torch.allclose(bounded[above], exact[above], rtol=1e-12, atol=0)
    assert (bounded[~above] <= exact[~above] + 1e-12).all()
    assert torch.allclose(cand.total(), full.total(), rtol=1e-12)


def test_top_p_threshold_is_exact_on_adjacent_floats_and_ties():
    """Values one ulp apart and tie groups: the bisection must end on exactly the reference's set."""
    vocab = padded = 64
    base = torch.full((vocab,), 2.0)
    for i in range(1, vocab):
        base[i] = torch.nextafter(base[i - 1], torch.tensor(-10.0))  # 64 adjacent floats below 2.0
    rows = torch.stack([base, torch.round(base * 4) / 4, torch.flip(base, [0]), base - 100.0])
    params = [SamplingParams(seed=s, top_p=tp, logprobs=5, temperature=t)
              for s, (tp, t) in enumerate([(0.5, 1.0), (0.3, 1.0), (0.9, 1.0), (0.02, 1.0)])]
    tops = [p for p in (0.015625, 0.5, 0.515625, 0.99)]

    def run(ex):
        bad = []
        for top_p in tops:
            rows_params = [SamplingParams(seed=p.seed, top_p=top_p, logprobs=5, temperature=p.temperature)
                           for p in params]
            split = Sampler(vocab, max_slots=4, padded_vocab_size=padded, group=ex,
                            logprobs_mode="processed_logprobs")
            whole = Sampler(vocab, max_slots=4, padded_vocab_size=padded, logprobs_mode="processed_logprobs")
            for b, p in enumerate(rows_params):
                split.add_request(b, p, [])
                whole.add_request(b, p, [])
            width = padded // ex.world_size
            bad += dc.compare(f"top_p {top_p}", split.sample(rows[:, ex.rank * width:(ex.rank + 1) * width]),
                              whole.sample(rows))
        return bad

    failures = sum(dc.run_threads(4, run), [])
    assert not failures, "\n".join(failures[:10])


def test_top_p_mass_exactly_at_the_bound_is_removed():
    """p = [1, 0.5, 0.5] (exact in float32): with top_p 0.5 the mass above the 0.5s is 1.0, equal to
    0.5 * total, which is not < the bound, so only the top id stays (ids spread over both ranks)."""
    half = float(torch.tensor(0.5).log())  # float32 log(0.5): exp of it is exactly 0.5
    assert torch.exp(torch.tensor(half)).item() == 0.5
    row = torch.full((1, 8), float("-inf"))
    row[0, 1], row[0, 4], row[0, 6] = half, 0.0, half

    def run(ex):
        split = Sampler(8, max_slots=1, group=ex, logprobs_mode="processed_logprobs")
        split.add_request(0, SamplingParams(seed=3, top_p=0.5, logprobs=3), [])
        return split.sample(row[:, 4 * ex.rank:4 * ex.rank + 4])

    whole = Sampler(8, max_slots=1, logprobs_mode="processed_logprobs")
    whole.add_request(0, SamplingParams(seed=3, top_p=0.5, logprobs=3), [])
    want = whole.sample(row)
    for got in dc.run_threads(2, run):
        assert not dc.compare("boundary", got, want)
        assert got.token_ids.tolist() == [4]
        assert got.logprobs.top_token_ids.tolist() == [[4, 0, 1]]  # 1 and 6 removed: -inf, ordered by id
        assert got.logprobs.top_logprobs[0, 0] == 0.0 and torch.isneginf(got.logprobs.top_logprobs[0, 1:]).all()


def test_bytes_and_collectives_per_step_do_not_grow_with_the_vocabulary():
    params = [SamplingParams(seed=1, top_k=5, top_p=0.9, min_p=0.01, logprobs=3, repetition_penalty=1.2),
              SamplingParams(seed=2, temperature=0.0, logprobs=0), SamplingParams(seed=3, top_p=0.5)]

    def measure(vocab, scale):
        def run(ex):
            sampler = Sampler(vocab, max_slots=3, padded_vocab_size=vocab + 2, group=ex)
            for b, p in enumerate(params):
                sampler.add_request(b, p, [0, 1])
            width = (vocab + 2) // 2
            logits = scale * torch.randn(3, vocab + 2, generator=torch.Generator().manual_seed(vocab))
            ex.reset_counters()
            sampler.sample(logits[:, ex.rank * width:(ex.rank + 1) * width])
            return ex.calls, ex.bytes_sent, ex.bytes_received
        return dc.run_threads(2, run)

    # check, summaries, top-k, top-p, winner, logprobs
    base = 1 + 1 + 1 + sel.bisection_rounds(255) + 1 + 1
    # peaked rows: each rank's 256 top-p candidates hold the bound, whatever the width (or the
    # whole slice is sorted when narrower than that: one column less in the first round)
    small, large = measure(2000, 8.0), measure(20000, 8.0)
    assert small == large
    calls, sent, received = small[0]
    assert calls == base
    assert received == sent  # world 2
    assert sent < 3 * (4 * 256 * 8 + 64)  # a few KiB per row, nothing of width V
    # flat rows: the candidates fall short of the bound and the round is redone on sorted slices,
    # one extra all-gather of the same size, whatever the width
    flat_small, flat_large = measure(2000 * 5, 1.0), measure(20000, 1.0)
    assert flat_small == flat_large and flat_small[0][0] == base + 1
    assert flat_small[0][1] < sent + 3 * 256 * 8


def test_errors_threads():
    failures = sum(dc.run_threads(3, dc.error_checks), [])
    assert not failures, "\n".join(failures)


def test_split_sampler_reports_shared_seed_and_state_accessors():
    def run(ex):
        sampler = Sampler(50, max_slots=2, padded_vocab_size=52, group=ex)
        seed = sampler.add_request(1, SamplingParams(top_k=3), [4, 5], output_token_ids=[6])
        sampler.sample(torch.zeros(1, 26), [1])
        counts = sampler.state.output_counts[1].sum().item()
        return seed, sampler.seed_of(1), sampler.position_of(1), sampler.params_of(1).top_k, counts

    results = dc.run_threads(2, run)
    seeds = {r[0] for r in results}
    assert len(seeds) == 1 and results[0][1] == results[0][0]  # one seed, drawn on rank 0, everywhere
    assert all(r[2] == 4 and r[3] == 3 for r in results)  # position = prompt + outputs + 1 step
    assert sum(r[4] for r in results) == 2  # the old output and the new token, each counted once


def test_state_move_carries_the_slice_state():
    """`sampler.state.move` (continuous batching) moves the slice's columns, dense masks and host
    mirror: the split sampler keeps matching the unsplit one after slots are relocated."""
    vocab, padded = 61, 64
    params = [SamplingParams(seed=1, logit_bias={3: 4.0, 40: 6.0}, repetition_penalty=1.5, logprobs=2),
              SamplingParams(seed=2, allowed_token_ids=(1, 35, 50), top_k=2),
              SamplingParams(seed=3, min_tokens=3, stop_token_ids=(33,), frequency_penalty=1.0, top_p=0.8)]
    gen = torch.Generator().manual_seed(4)
    steps = [torch.randn(3, padded, generator=gen) * 3 for _ in range(3)]
    for logits in steps:
        logits[:, 33] = 30.0  # the stop id would win if min_tokens were lost in the move

    def drive(sampler, rank, world):
        width = padded // world
        for b, p in enumerate(params):
            sampler.add_request(b, p, [3, 40, 50], output_token_ids=[35])
        outs = [sampler.sample(steps[0][:, rank * width:(rank + 1) * width])]
        sampler.state.move(torch.tensor([3, 0, 4]), torch.tensor([0, 2, 1]))
        for logits in steps[1:]:
            outs.append(sampler.sample(logits[:, rank * width:(rank + 1) * width], [3, 0, 4]))
        return outs

    want = drive(Sampler(vocab, max_slots=5, padded_vocab_size=padded, eos_token_ids=(60,)), 0, 1)
    results = dc.run_threads(2, lambda ex: drive(Sampler(vocab, max_slots=5, padded_vocab_size=padded,
                                                         eos_token_ids=(60,), group=ex), ex.rank, 2))
    assert want[0].token_ids[2] != 33 and want[1].token_ids[1] != 33  # request 2 (in slot 0 after the move)
    assert want[0].token_ids[0] == 33 and want[2].token_ids[1] == 33  # no min_tokens / min_tokens reached
    for outs in results:
        for t, (got, expected) in enumerate(zip(outs, want, strict=True)):
            assert not dc.compare(f"step {t}", got, expected)


def test_bench_world_bytes_do_not_grow_with_the_vocabulary():
    from tokensampler.tools.bench_distributed import format_world_table, run_world_bench

    results = run_world_bench(2, cases=["k20_p0.95"], rounds=1, vocabs=(1000, 8000), batch=2)
    small, large = results
    assert small["split_bytes_received_per_step"] == large["split_bytes_received_per_step"] > 0
    assert large["gather_bytes_received_per_step"] > 7 * small["gather_bytes_received_per_step"]
    assert small["split_collectives_per_step"] == 1 + 1 + 1 + sel.bisection_rounds(255) + 1
    assert all(r["steps_tokens_equal"] == r["steps"] == 2 for r in results)
    assert "| k20_p0.95 | 2 | 8000 |" in format_world_table(results)


def test_sampling_dp_layout():
    layout = sampling_dp(tp=2, dp=3)
    assert layout.world_size == 6
    assert layout.ranks_of(1) == [2, 3]
    assert [layout.group_of_rank(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [layout.locate(s) for s in range(7)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 2)]
    assert all(layout.global_slot(*layout.locate(s)) == s for s in range(50))
    for bad in [dict(tp=0, dp=1), dict(tp=2, dp=True)]:
        with pytest.raises(InvalidSamplingParams):
            SamplingDP(**bad)
    with pytest.raises(InvalidSamplingParams) as err:
        layout.locate(-1)
    assert err.value.field == "global_slot"
    assert issubclass(SplitMismatch, InvalidSamplingParams)


# ------------------------------------------------------------------ real gloo process groups
def _gloo_jobs(world):
    """Jobs for the spawned world: random cases on groups of 1..world ranks, errors, sampling_dp."""
    jobs = []
    for size in range(1, world + 1):
        for i, (vocab, padded) in enumerate(dc.CONFIGS[size]):
            for m, mode in enumerate(dc.MODES):
                jobs.append(("case", size, 1000 + 100 * size + 10 * i + m, vocab, padded, mode))
        if size >= 2:
            jobs.append(("errors", size))
    jobs.append(("dp", world, 2, world // 2))
    return jobs


def test_gloo_process_groups_of_1_to_4_ranks(tmp_path):
    """One spawn of 4 gloo ranks (starting processes is the slow part); the groups of ranks [0, n)
    are real process groups of sizes 1, 2, 3 and 4, with a vocabulary padded across two ranks and
    vocabularies not divisible by 32 (dc.CONFIGS), then two sampling_dp groups of 2 ranks."""
    world = 4
    jobs = _gloo_jobs(world)
    # fork: the ranks start in milliseconds instead of importing torch again (30-50 s on 2 busy cores);
    # the worker sets one intra-op thread first, as DataLoader workers do, so OpenMP is safe after fork.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(dc.gloo_worker, args=(world, str(tmp_path / "store"), str(tmp_path), jobs), nprocs=world,
                       join=True, start_method=method)
    for rank in range(world):
        with open(tmp_path / f"rank{rank}.json") as handle:
            report = json.load(handle)
        assert report["crash"] is None, report["crash"]
        assert report["checks"] == sum(1 for job in jobs if rank < job[1])
        assert not report["failures"], "\n".join(report["failures"][:10])
