"""The fused route (`fused.sample_rows`, `native_sample.cpp`): token for token the reference's on every
row it finishes, the rows it cannot finish marked general (and then drawn by the general routes), the
noise bit for bit the definition's, the route taken by a compiling sampler and its logits left as they were."""

from __future__ import annotations

import pytest
import torch

from tokensampler import Sampler, SamplingParams
from tokensampler.backends.torch_step import fused, gumbel, native
from tokensampler.backends.torch_step.routes import Route
from tokensampler.core import rng
from tokensampler.state import SamplerState, VocabLayout
from tokensampler.tools.workloads import make_logits

from ..support.runs import assert_same_output, run_reference, run_sampler

pytestmark = pytest.mark.skipif(native.sample_op() is None, reason="the C++ pass cannot be built here")

NEG_INF = float("-inf")


def state_for(params: list[SamplingParams], vocab: int, positions: list[int] | None = None,
              streams: list[int] | None = None) -> SamplerState:
    state = SamplerState(len(params), VocabLayout(vocab, vocab), torch.device("cpu"))
    for slot, p in enumerate(params):
        position = 0 if positions is None else positions[slot]
        state.admit(slot, p, p.seed or 0, position, 0 if streams is None else streams[slot], [], [], ())
    return state


def fused_and_reference(logits: torch.Tensor, params: list[SamplingParams], positions: list[int] | None = None,
                        streams: list[int] | None = None):
    """(tokens, general, the reference's tokens) for the rows of `logits`."""
    vocab = logits.shape[1]
    positions = positions or [0] * len(params)
    state = state_for(params, vocab, positions, streams)
    tokens, general, _ = fused.sample_rows(logits, torch.arange(len(params)), state)
    want = run_reference(logits, params, positions=positions, streams=streams)
    return tokens, general, want.token_ids


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [B, V] -> int32 [B, ceil(V / 32)] in xgrammar's layout (bit j of word w allows id 32 w + j)."""
    rows, vocab = allowed.shape
    bits = torch.nn.functional.pad(allowed, (0, -vocab % 32)).reshape(rows, -1, 32).to(torch.int64)
    words = (bits << torch.arange(32)).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def random_params(count: int, seed: int) -> list[SamplingParams]:
    gen = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    return [SamplingParams(temperature=pick([0.0, 0.25, 0.7, 1.0, 1.6]), top_k=pick([0, 0, 1, 3, 40, 10**6]),
                           top_p=pick([1.0, 1.0, 0.3, 0.9, 0.95, 0.9999]), min_p=pick([0.0, 0.0, 0.02, 0.3]),
                           seed=pick([0, 7, 2**40 + 3, 2**63 + 11]) + row)
            for row in range(count)]


@pytest.mark.parametrize("shape", ["peaked", "flat", "gaussian", "ties"])
def test_every_finished_row_is_the_references(shape):
    """Random parameter mixes on four kinds of rows (LLM-shaped, flat, gaussian, and rows of a few repeated
    values: ties at every threshold); the finished rows are exactly the reference's, and on peaked rows
    (the common case) nearly every row is finished."""
    finished = total = 0
    for trial in range(6):
        batch, vocab = 16, [3000, 20000, 777][trial % 3]
        if shape in ("peaked", "flat"):
            logits = make_logits(batch, vocab, flat=shape == "flat", seed=trial)
        elif shape == "gaussian":
            logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(trial)) * (1.0 + trial)
        else:
            levels = torch.tensor([9.0, 8.5, 8.5, 7.0, 3.0, 0.0])
            logits = levels[torch.randint(6, (batch, vocab), generator=torch.Generator().manual_seed(trial))]
        params = random_params(batch, 100 * trial + len(shape))
        tokens, general, want = fused_and_reference(logits, params, positions=[trial * 3 + b for b in range(batch)])
        done = ~general
        assert torch.equal(tokens[done], want[done]), (trial, tokens[done], want[done])
        finished += int(done.sum())
        total += batch
    if shape == "peaked":
        assert finished >= 0.9 * total, (finished, total)
    assert finished > 0


def test_rows_it_cannot_finish_exactly_are_marked_general():
    """NaN, +inf, a row with no id left, z / T overflowing, and a flat min-p row longer than the cap:
    general; a peaked row beside them, and a flat row whose top-k bounds its list, are finished."""
    vocab = 20000  # the list's cap: 1,800
    logits = make_logits(7, vocab, seed=3)
    logits[0, 17] = float("nan")
    logits[1, 5] = float("inf")
    logits[2] = NEG_INF
    logits[3, 9] = 3e38  # / 0.5 overflows
    logits[4] = torch.randn(vocab) * 0.01  # flat: every id within the win floor
    logits[5] = torch.randn(vocab) * 0.01
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2),
              SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.5, seed=4),
              SamplingParams(temperature=1.0, min_p=0.001, seed=5),  # flat: every id above min-p's floor
              SamplingParams(temperature=1.0, top_k=30, top_p=0.9, seed=6),  # flat, but top-k lists 30 ids
              SamplingParams(temperature=0.5, top_p=0.9, seed=7)]
    state = state_for(params, vocab)
    tokens, general, count = fused.sample_rows(logits, torch.arange(7), state)
    assert general.tolist() == [True] * 5 + [False, False] and count == 5
    want = run_reference(logits[5:], params[5:])
    assert tokens[5:].tolist() == want.token_ids.tolist()


def test_a_row_of_tied_scores_is_decided_by_the_exact_noise():
    """Values chosen as c - g~ (the approximate noise) for 60 ids: every approximate score is within
    the error margin of the best, so the winner is decided by the definition's noise alone (and the
    lowest id on exact ties). The draw must be the reference's for many seeds."""
    vocab, count = 400, 60
    for seed in range(40):
        ids = torch.arange(count) * 5 + 3
        key = rng.row_key(seed, 11, 0)
        approx = gumbel.approx_gumbel(rng.to_int32_words(rng.random_bits(key, ids)))
        logits = torch.full((1, vocab), -50.0)
        logits[0, ids] = 20.0 - approx
        params = [SamplingParams(temperature=1.0, seed=seed)]
        tokens, general, want = fused_and_reference(logits, params, positions=[11])
        assert not bool(general[0]) and int(tokens[0]) == int(want[0]), seed


def test_the_noise_bits_are_the_definitions():
    """The pass's row key and hash equal `rng.random_bits(rng.row_key(...))` for seeds over the whole
    64-bit range (negative as int64), large positions and streams."""
    gen = torch.Generator().manual_seed(5)
    n = 4096
    seed = torch.randint(-2**63, 2**63 - 1, (n,), generator=gen, dtype=torch.int64)
    position = torch.randint(0, 2**40, (n,), generator=gen)
    stream = torch.randint(0, 2**33, (n,), generator=gen)
    token = torch.randint(0, 2**31 - 1, (n,), generator=gen)
    got = torch.ops.tokensampler_native.noise_bits(seed, position, stream, token)
    assert torch.equal(got, rng.random_bits(rng.row_key(seed, position, stream), token))


def test_the_approximate_noise_is_within_its_bound_for_every_u():
    """All 2^24 noise indices: |g~ - g| below `gumbel.NOISE_ERROR`, the margin the exact stage relies on."""
    bits = torch.arange(2**24, dtype=torch.int64) << 8
    approx = torch.ops.tokensampler_native.approx_noise(bits)
    exact = rng.gumbel_from_bits(bits)
    assert float((approx - exact).abs().max()) < gumbel.NOISE_ERROR


def test_top_p_at_a_crossing_the_tail_bound_cannot_decide_takes_the_exact_tail():
    """Two listed ids (p = 1 and 0.5) above 20,000 distinct ids 20.5-23 below the max (never listed):
    at top_p just above 1 / 1.5 the second id is kept only because of their mass, which the bands
    bound but cannot decide, so the pass sums it exactly. With top-k 1000 (its k-th value below the
    list) only the ids top-k keeps count: a top_p between the two totals keeps the second id with
    the whole tail but not with top-k's part. Every row the reference's, the second id drawn in some."""
    vocab = 20002
    row = torch.cat([torch.tensor([20.0, 20.0 + float(torch.log(torch.tensor(0.5)))]),
                     -0.5 - 2.5 * torch.rand(vocab - 2, generator=torch.Generator().manual_seed(1))])
    logits = row.repeat(16, 1)
    p_tail = torch.exp(row[2:] - 20.0).double()
    whole, top_k_part = float(p_tail.sum()), float(p_tail.topk(998).values.sum())
    assert whole > 3 * top_k_part
    params = [SamplingParams(temperature=1.0, top_p=1.0 / (1.5 + 0.5 * whole), seed=r) for r in range(8)]
    params += [SamplingParams(temperature=1.0, top_k=1000, top_p=1.0 / (1.5 + 0.5 * (whole + top_k_part)), seed=r)
               for r in range(8)]
    tokens, general, want = fused_and_reference(logits, params)
    assert not bool(general.any())
    assert torch.equal(tokens, want), (tokens, want)
    assert 1 in want[:8].tolist() and 1 not in want[8:].tolist(), want


def test_a_compiling_sampler_takes_the_fused_route_and_leaves_the_logits_as_they_were():
    """Penalties (cells written and restored), raw logprobs, a greedy row, padded columns, several
    steps (positions advancing): the fused route every step, the reference's tokens and logprobs."""
    vocab, padded = 30000, 30016
    logits = torch.nn.functional.pad(make_logits(5, vocab, seed=9), (0, padded - vocab), value=40.0)
    before = logits.clone()
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=3),
              SamplingParams(temperature=0.7, top_k=20, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.5,
                             seed=2),
              SamplingParams(temperature=0.0, frequency_penalty=0.7),
              SamplingParams(temperature=1.0, min_p=0.05, seed=4, logprobs=1),
              SamplingParams(temperature=0.9, seed=2**64 - 1)]
    top = logits[:, :vocab].topk(3, dim=-1).indices.tolist()
    prompts = [[], top[1][:2], top[2][:1], [], []]
    outputs = [[], [top[1][0]], [top[2][0], top[2][1]], [], [top[4][0]]]
    sampler = Sampler(vocab, max_slots=5, padded_vocab_size=padded, compile=True, max_logprobs=5)
    for b, p in enumerate(params):
        sampler.add_request(b, p, prompts[b], output_token_ids=outputs[b])
    step = sampler.backends.torch_step
    for round_ in range(3):
        got = sampler.sample(logits)
        want = run_reference(logits, params, prompts=prompts, outputs=outputs, vocab_size=vocab)
        assert_same_output(want, got)
        assert torch.equal(logits, before)
        for b in range(5):
            outputs[b] = [*outputs[b], int(got.token_ids[b])]
    assert step.routes_taken[Route.FUSED] == 3
    assert 0 < step.workspace_bytes <= 5 * 4 * (fused.list_cap(vocab) + 32) * torch.get_num_threads()


def test_a_group_whose_mass_above_equals_the_bound_exactly_is_removed():
    """p = 1 for the max and 0.5 for each of two tied ids (exact in float32 and float64), top-k 3 keeping
    just them (the total exactly 2): at top_p 0.5 the bound is exactly the mass above the tied pair,
    which is therefore removed (the definition's strict `<`): every seed draws the max, as the
    reference does."""
    vocab = 3000
    logits = torch.full((1, vocab), -30.0)
    logits[0, 10] = 5.0
    logits[0, [20, 30]] = 5.0 + float(torch.log(torch.tensor(0.5)))
    assert torch.exp(logits[0, [20, 30]] - 5.0).tolist() == [0.5, 0.5]
    for seed in range(20):
        params = [SamplingParams(temperature=1.0, top_k=3, top_p=0.5, seed=seed)]
        tokens, general, want = fused_and_reference(logits, params)
        assert not bool(general[0]) and int(tokens[0]) == int(want[0]) == 10, seed


def test_the_lists_are_counted_for_the_call_and_kept_for_the_next():
    """One 248k row at T = 1 (temperature alone: the list reaches the winnable floor) lists about
    15,500 ids: its lists are counted for the call (within 0.45 of the row's fp32 logits and the
    slack), and kept: a second call grows nothing; a batch of 32 such rows likewise."""
    vocab = 248320
    row = make_logits(1, vocab, seed=2)
    one = [SamplingParams(temperature=1.0, seed=1)]
    state = state_for(one, vocab)
    tokens, general, _ = fused.sample_rows(row, torch.arange(1), state)
    listed = fused.scratch_bytes()
    assert not bool(general[0]) and 0.25 * 4 * vocab < listed <= 0.5 * 4 * vocab
    fused.sample_rows(row, torch.arange(1), state)
    assert fused.scratch_bytes() == listed
    batch = make_logits(32, vocab, seed=3)
    many = [SamplingParams(temperature=1.0, seed=s) for s in range(32)]
    state = state_for(many, vocab)
    fused.sample_rows(batch, torch.arange(32), state)
    first = fused.scratch_bytes()
    fused.sample_rows(batch, torch.arange(32), state)
    assert fused.scratch_bytes() == first  # kept: nothing grew


@pytest.mark.parametrize("allowed", [40, 700, 30000])
def test_a_token_bitmask_is_read_where_each_value_is_read(allowed):
    """A grammar-like mask (the 32 likeliest ids and random others), with penalties, greedy and
    top-k/top-p/min-p rows and padded columns: the fused route takes the call, the reference's tokens;
    rows every id of which the mask removes are drawn by the general routes (their raw greedy id,
    invalid)."""
    from tokensampler.reference import ReferenceRequest, bitmask_allowed_ids, reference_sample
    from tokensampler.tools.workloads import make_bitmask
    vocab, padded = 40000, 40032
    logits = torch.nn.functional.pad(make_logits(6, vocab, seed=13), (0, padded - vocab), value=50.0)
    mask = make_bitmask(logits[:, :vocab], allowed)
    mask = torch.nn.functional.pad(mask, (0, padded // 32 - mask.shape[1]))  # padded ids: bit 0
    mask[5] = 0  # nothing allowed
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(temperature=0.0, presence_penalty=0.5),
              SamplingParams(temperature=1.0, top_k=20, top_p=0.95, repetition_penalty=1.2, seed=3),
              SamplingParams(temperature=1.0, min_p=0.05, seed=4),
              SamplingParams(temperature=0.7, seed=5),
              SamplingParams(temperature=0.9, top_p=0.9, seed=6)]
    top = logits[:, :vocab].topk(2, dim=-1).indices.tolist()
    prompts = [[], top[1], top[2], [], [], []]
    sampler = Sampler(vocab, max_slots=6, padded_vocab_size=padded, compile=True)
    for b, p in enumerate(params):
        sampler.add_request(b, p, prompts[b])
    got = sampler.sample(logits, token_bitmask=mask)
    requests = [ReferenceRequest(p, p.seed or 0, len(prompts[b]), prompts[b]) for b, p in enumerate(params)]
    want = reference_sample(logits, requests, vocab_size=vocab, allowed=bitmask_allowed_ids(mask, vocab))
    assert_same_output(want, got)
    assert got.valid.tolist() == [True] * 5 + [False]
    assert sampler.backends.torch_step.routes_taken[Route.FUSED] == 1


def test_only_the_rows_it_cannot_finish_take_the_general_routes(monkeypatch):
    """A NaN in one row of 6: that row alone runs on the general routes (a plan of its own), the
    others keep the fused pass's tokens; every row the reference's. A call with no row it can finish,
    or with more than a quarter of its rows general, runs on the general routes whole."""
    from tokensampler.backends.torch_step import step as step_module
    vocab = 40000  # T = 0.8 lists about 1,500 ids: within the cap (3,600)
    logits = make_logits(6, vocab, seed=12)
    logits[4, 100] = float("nan")
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, logprobs=2) for s in range(6)]
    sampler = Sampler(vocab, max_slots=6, compile=True)
    for b, p in enumerate(params):
        sampler.add_request(b, p, [])
    batches = []
    real = step_module.TorchStep._probe
    monkeypatch.setattr(step_module.TorchStep, "_probe",
                        lambda self, logits, *a, **k: batches.append(logits.shape[0]) or real(self, logits, *a, **k))
    got = sampler.sample(logits)
    assert_same_output(run_reference(logits, params), got)
    assert batches == [1] and sampler.backends.torch_step.routes_taken[Route.FUSED] == 1
    nan_rows = make_logits(2, vocab, seed=14)
    nan_rows[:, 7] = float("nan")
    batches.clear()
    assert_same_output(run_reference(nan_rows, params[:2]), run_sampler(nan_rows, params[:2], compile=True))
    assert batches == [2]
    logits[1, 5] = float("nan")  # two rows of six: their copy would pass a quarter of the logits
    batches.clear()
    assert_same_output(run_reference(logits, params, positions=[1] * 6), sampler.sample(logits))  # the 2nd token
    assert batches == [6]


def test_a_top_p_row_too_flat_for_a_list_lists_its_head():
    """Gaussian rows (std 4, as a small random LM's: tens of thousands of ids can win the race at
    T = 0.8, top-p 0.9 keeps a few dozen): the pass lists the head of each row, sums the rest exactly,
    and finishes every row, token for token the reference's; top-p 0.9999 (a crossing below the
    head) and a temperature-only row are finished too (the deep rows' reads)."""
    vocab = 151936
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(21)) * 4.0
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(4)]
    params += [SamplingParams(temperature=0.8, top_p=0.9999, seed=4), SamplingParams(temperature=0.8, seed=5)]
    tokens, general, want = fused_and_reference(logits, params)
    assert general.tolist() == [False] * 6
    assert torch.equal(tokens, want)


@pytest.mark.parametrize("vocab", [151936, 20000, 4099])
def test_rows_whose_kept_set_reaches_deep_are_the_references(vocab):
    """Flat LLM-shaped rows (`make_logits(flat=True)`: top-p 0.9 keeps about 30% of a 152k row) at
    several temperatures (T = 1 reads z undivided), top-p from 0.3 to 0.9999 and temperature alone,
    with and without a token bitmask allowing most ids: the histogram and race reads finish every row,
    token for token the reference's, over many seeds and positions."""
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(3):
        logits = make_logits(8, vocab, flat=True, seed=trial)
        temperature = [1.0, 0.7, 1.3][trial]
        params = [SamplingParams(temperature=temperature, top_p=top_p, seed=1000 * trial + row)
                  for row, top_p in enumerate([0.3, 0.6, 0.9, 0.9, 0.95, 0.99, 0.9999, 1.0])]
        positions = [trial * 8 + row for row in range(8)]
        tokens, general, want = fused_and_reference(logits, params, positions=positions)
        assert not bool(general.any()), (trial, general)
        assert torch.equal(tokens, want), (trial, tokens, want)
        allowed = torch.rand(8, vocab, generator=gen) < 0.8
        mask = pack_bitmask(allowed)
        state = state_for(params, vocab, positions)
        tokens, general, _ = fused.sample_rows(logits, torch.arange(8), state, mask)
        want = run_reference(logits.masked_fill(~allowed, NEG_INF), params, positions=positions).token_ids
        assert not bool(general.any()) and torch.equal(tokens, want), (trial, tokens, want)


def test_a_deep_crossing_whose_mass_above_equals_the_bound_exactly_keeps_only_the_groups_above():
    """A flat row of three levels with exact masses: 100 ids of p = 1, 198 of p = 0.5, 16,384 of p =
    2^-14 (total exactly 200). At top-p 0.5 the bound (100) is exactly the mass above the p = 0.5 group,
    which is removed with everything below (the definition's strict `<`): the crossing's bin is
    scanned, no group in it reaches the bound, and only the top group is kept. Its head (every id) is
    past the cap, so the row takes the deep reads at once. Every seed draws a top id, as the reference."""
    vocab = 100 + 198 + 16384
    values = torch.full((vocab,), float(torch.log(torch.tensor(2.0**-14))))
    values[:298] = float(torch.log(torch.tensor(0.5)))
    values[:100] = 0.0
    assert torch.exp(values[[0, 150, 500]]).tolist() == [1.0, 0.5, 2.0**-14]
    logits = values[torch.randperm(vocab, generator=torch.Generator().manual_seed(5))][None, :].contiguous()
    top = set(torch.nonzero(logits[0] == 0.0).squeeze(-1).tolist())
    for seed in range(24):
        params = [SamplingParams(temperature=1.0, top_p=0.5, seed=seed)]
        tokens, general, want = fused_and_reference(logits, params)
        assert not bool(general[0]) and int(tokens[0]) == int(want[0]) and int(tokens[0]) in top, seed


def flat_levels(levels: list[tuple[float, int]], order: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [1, V]: each (value, count) level repeated, then 16,384 ids at p = 2^-14 (the row flat:
    every id can win the race), in `order` (default: a fixed random permutation)."""
    values = [torch.full((count,), value) for value, count in levels]
    values.append(torch.full((16384,), float(torch.log(torch.tensor(2.0**-14)))))
    row = torch.cat(values)
    order = torch.randperm(row.numel(), generator=torch.Generator().manual_seed(5)) if order is None else order
    return row[order][None, :].contiguous()


def test_a_crossing_inside_its_bin_removes_the_groups_below_it_there():
    """Two groups of 100 ids 2^-10 apart (one value bin: 1/128 wide) at top-p 0.45: the bin holds the
    crossing, its exact scan keeps the upper group only (the mass above the lower one, 100, reaches
    0.45 x 200.9); keeping the whole bin would draw the lower group about half the time."""
    logits = flat_levels([(0.0, 100), (-2.0**-10, 100)])
    upper = set(torch.nonzero(logits[0] == 0.0).squeeze(-1).tolist())
    for seed in range(24):
        params = [SamplingParams(temperature=1.0, top_p=0.45, seed=seed)]
        tokens, general, want = fused_and_reference(logits, params)
        assert not bool(general[0]) and int(tokens[0]) == int(want[0]) and int(tokens[0]) in upper, seed


def test_the_crossing_bin_is_chosen_by_the_mass_of_every_id():
    """100 ids at 0 on odd positions, 100 at -1 on even ones (bins 0 and 128), the flat tail after them:
    at top-p 0.45 the top group alone reaches the bound (0.45 x 137.8), so the group at -1 is removed.
    Summing only some ids' masses (the even ones) would move the crossing into the lower group's bin
    and keep it (drawn about a quarter of the time)."""
    vocab = 200 + 16384
    order = torch.empty(vocab, dtype=torch.int64)
    order[1:200:2] = torch.arange(100)         # the top group: odd positions
    order[0:200:2] = torch.arange(100, 200)    # the group at -1: even positions
    order[200:] = torch.arange(200, vocab)
    logits = flat_levels([(0.0, 100), (-1.0, 100)], order=order)
    assert torch.equal(logits[0, 1:200:2], torch.zeros(100)) and bool((logits[0, 0:200:2] == -1.0).all())
    for seed in range(24):
        params = [SamplingParams(temperature=1.0, top_p=0.45, seed=seed)]
        tokens, general, want = fused_and_reference(logits, params)
        assert not bool(general[0]) and int(tokens[0]) == int(want[0]) and int(tokens[0]) % 2 == 1, seed


def test_a_floor_that_overflows_lists_minus_inf_ids_and_draws_the_references_token():
    """T = FLT_MAX: z / T is denormal, the undivided floor overflows to -inf and every id is listed, the
    removed ones (-inf) too; their distance to the best score is +inf, whose noise level must be
    clamped before it indexes the skip table (found by the compiled adversarial campaign)."""
    row = torch.tensor([[-1.0, -1.0, -1.0, -1.0, NEG_INF, -1.0, NEG_INF, NEG_INF, NEG_INF]])
    for seed in range(16):
        params = [SamplingParams(temperature=3.4028234663852886e38, seed=seed)]
        tokens, general, want = fused_and_reference(row, params, positions=[12])
        assert not bool(general[0]) and int(tokens[0]) == int(want[0]), seed


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_raw_logprobs_on_the_fused_route_come_from_the_pass_statistics(mode, monkeypatch):
    """A compiling sampler asking raw logprobs (0, 5 and 20, and rows not asking) on a vocabulary whose
    width is a multiple of neither 16 nor 64 (a tail in the lane sums and a short last chunk; rows whose
    max is in that tail or at the last id of a chunk), padded:
    the fused route takes the call and fills the chunk maxima and log S while each row is in cache (no
    other full-row statistics pass runs); ids, ranks and values are the reference's (values within
    the documented bound)."""
    from tokensampler.backends.torch_step import logprobs as logprobs_module
    vocab, padded = 30011, 30016
    logits = torch.nn.functional.pad(make_logits(6, vocab, seed=31), (0, padded - vocab), value=9.0)
    logits[1, 7] = NEG_INF
    logits[2, vocab - 1] = 30.0  # the row's max in the lane sums' tail
    logits[4, 127] = logits[5, 64 * 9 + 63] = 30.0  # the row's max at the last id of a chunk
    asks = [0, 5, 20, None, 20, 3]
    params = [SamplingParams(temperature=[0.0, 0.8, 1.0, 0.7, 1.2, 0.9][b], top_p=0.9, logprobs=asks[b], seed=b)
              for b in range(6)]
    passes = []
    real = logprobs_module.row_stats
    monkeypatch.setattr(logprobs_module, "row_stats", lambda *a, **k: passes.append(1) or real(*a, **k))
    sampler = Sampler(vocab, max_slots=6, padded_vocab_size=padded, logprobs_mode=mode, compile=True)
    for b, p in enumerate(params):
        sampler.add_request(b, p, [])
    got = sampler.sample(logits)
    assert_same_output(run_reference(logits, params, vocab_size=vocab, logprobs_mode=mode), got)
    assert sampler.backends.torch_step.routes_taken[Route.FUSED] == 1 and passes == []


def test_a_greedy_row_takes_the_first_allowed_maximum():
    """Greedy rows whose maximum is tied by a removed id before the allowed one (in the same 32-id
    word, and in an earlier word): the first allowed maximum, as the reference; all-greedy calls take
    the fused route."""
    vocab = 5000
    logits = make_logits(3, vocab, seed=41)
    logits[:, [5, 20, 37, 100]] = 40.0
    allowed = torch.ones(3, vocab, dtype=torch.bool)
    allowed[0, 5] = False  # 20: the same 32-id word
    allowed[1, [5, 20, 37]] = False  # 100: three words on
    params = [SamplingParams(temperature=0.0)] * 3
    state = state_for(params, vocab)
    tokens, general, _ = fused.sample_rows(logits, torch.arange(3), state, pack_bitmask(allowed))
    assert not bool(general.any()) and tokens.tolist() == [20, 100, 5]
    sampler = Sampler(vocab, max_slots=3, compile=True)
    for b, p in enumerate(params):
        sampler.add_request(b, p, [])
    assert sampler.sample(logits, token_bitmask=pack_bitmask(allowed)).token_ids.tolist() == [20, 100, 5]
    assert sampler.backends.torch_step.routes_taken[Route.FUSED] == 1


def test_a_top_p_row_keeping_ids_below_its_shallow_list_is_listed_again_from_the_winnable_floor():
    """A top-p row lists from 16 units below its max first. Here top-p (1 - 1e-8) keeps an id 16.1
    below the max, outside that list but above the winnable floor, and the seed gives that id the
    largest noise there is (g = 17.3): the reference draws it. The pass finds no crossing in the shallow
    list, lists the row again from the winnable floor, and draws it too."""
    vocab = 4099
    ops = torch.ops.tokensampler_native
    ids = torch.arange(1, vocab)
    for seed in range(20000):
        bits = ops.noise_bits(torch.full_like(ids, seed), torch.zeros_like(ids), torch.zeros_like(ids), ids)
        lucky = torch.nonzero((bits >> 8) >= 2**24 - 1).squeeze(-1)
        if lucky.numel() == 0:
            continue
        logits = torch.full((1, vocab), -40.0)
        logits[0, 0] = 0.0
        deep = int(ids[lucky[0]])
        logits[0, deep] = -16.1
        params = [SamplingParams(temperature=1.0, top_p=1.0 - 1e-8, seed=seed)]
        tokens, general, want = fused_and_reference(logits, params)
        if int(want[0]) != deep:
            continue  # the max's own noise was larger
        assert not bool(general[0]) and int(tokens[0]) == deep, seed
        return
    raise AssertionError("no seed gave an id below the shallow list the largest noise")


def test_a_top_p_row_whose_shallow_list_passes_the_cap_is_drawn_as_a_flat_row():
    """A gaussian row (std 4, T = 0.8) with 14,779 ids within 16 units of its max, where the strided
    estimate said fewer than the cap (13,674): the shallow list passes the cap, and the row is taken
    again from its winnable floor (a flat row: its head listed), finished, the reference's token."""
    logits = (torch.randn(32, 151936, generator=torch.Generator().manual_seed(0)) * 4.0)[24:25].contiguous()
    zt = logits[0] / 0.8
    assert int((zt >= zt.max() - 16).sum()) > fused.list_cap(151936)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=24)]
    tokens, general, want = fused_and_reference(logits, params)
    assert not bool(general[0]) and int(tokens[0]) == int(want[0])
