"""The full-row samplers (docs/semantics.md steps 7 and 10.1-10.6): dynamic temperature, top-n-sigma,
typical-p, epsilon, eta, XTC and Mirostat (its mu compared to the bit), on every backend.

Random and adversarial batches (ties, -inf, +inf, one kept id, all equal, huge values) against the
reference token for token (logprobs included, raw and processed), on both torch routes and the
Triton step (which hands these rows to the torch step); the tie rules on hand-made rows; batch
invariance and seeded reproducibility; XTC's coin (its own coordinate, its frequency); speculative
verification (match mode, and rejection mode's target distribution); a vocabulary split admits
them and samples them as the unsplit sampler (tests/split/test_distributed.py for the random cases); the
argument checks.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

import tests.support.split_cases as dc
from tests.support.backends import make_sampler
from tokensampler import InvalidSamplingParams, Sampler, SamplingParams
from tokensampler.core import rng
from tokensampler.core.plan import FULL_ROW_STAGES, plan_step
from tokensampler.reference import ReferenceRequest, reference_sample, reference_step

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the Triton interpreter's discarded lanes
ROUTES = ("direct", "block", "kernels", "split2", "split3")  # the splits gather these rows whole
NEG_INF = float("-inf")


def random_params(r: random.Random, **fixed) -> SamplingParams:
    """A row that turns on some full-row samplers (and sometimes min-p, top-k, top-p, penalties)."""
    kw = dict(temperature=r.choice([0.0, 0.3, 1.0, 1.7]), seed=r.randrange(2**64), logprobs=r.choice([None, 0, 4]))
    if r.random() < 0.4:
        kw.update(dynatemp_range=r.choice([0.2, 1.0, 2.0]), dynatemp_exponent=r.choice([0.0, 0.5, 1.0, 3.0]))
    if r.random() < 0.4:
        kw["top_n_sigma"] = r.choice([0.0, 0.5, 1.0, 2.0])
    if r.random() < 0.4:
        kw["typical_p"] = r.choice([0.2, 0.5, 0.9, 0.999])
    if r.random() < 0.3:
        kw["epsilon_cutoff"] = r.choice([0.01, 0.05, 0.3])
    if r.random() < 0.3:
        kw["eta_cutoff"] = r.choice([0.001, 0.05, 0.3])
    if r.random() < 0.4:
        kw.update(xtc_probability=r.choice([0.5, 1.0]), xtc_threshold=r.choice([0.0, 0.05, 0.1, 0.3, 0.5]))
    if r.random() < 0.3:
        kw.update(mirostat_tau=r.choice([0.0, 0.5, 2.0, 5.0]), mirostat_eta=r.choice([0.0, 0.1, 1.0]))
    for name, values in (("top_k", [1, 5, 20]), ("top_p", [0.5, 0.9]), ("min_p", [0.05, 0.2]),
                         ("repetition_penalty", [1.3])):
        if r.random() < 0.25:
            kw[name] = r.choice(values)
    kw.update(fixed)
    return SamplingParams(**kw)


def adversarial_logits(r: random.Random, batch: int, vocab: int, padded: int) -> torch.Tensor:
    """Rows with ties, -inf, +inf, a single finite id, all equal, huge values, gaps past float64's exp."""
    rows = []
    for _ in range(batch):
        kind = r.choice(["randn", "rounded", "equal", "single", "inf", "huge", "gap", "two"])
        row = torch.randn(padded) * r.choice([0.3, 3.0, 10.0])
        if kind == "rounded":
            row = row.round()
        elif kind == "equal":
            row = torch.full((padded,), r.choice([0.0, -3.5]))
        elif kind == "single":
            row = torch.full((padded,), NEG_INF)
            row[r.randrange(vocab)] = 1.0
        elif kind == "inf":
            row[r.sample(range(vocab), 2)] = float("inf")
        elif kind == "huge":
            row = row * 3e37
        elif kind == "gap":
            row[r.randrange(vocab)] = 1000.0
        elif kind == "two":
            row = torch.full((padded,), NEG_INF)
            row[r.sample(range(vocab), 2)] = torch.tensor([0.0, r.choice([0.0, -1.0, -30.0])])
        if r.random() < 0.3:
            row[r.sample(range(vocab), vocab // 4)] = NEG_INF
        row[vocab:] = 1e4  # padding is never sampled
        rows.append(row)
    return torch.stack(rows)


def run_case(backend: str, case_seed: int, mode: str, steps: int = 3) -> None:
    r = random.Random(case_seed)
    vocab, padded = r.choice([(16, 16), (50, 64), (300, 320)])
    if backend == "split3":  # a multiple of the ranks (the padding spans ranks)
        padded = -(-padded // 3) * 3
    batch = r.randint(1, 6)
    sampler = make_sampler(backend, vocab, max_slots=batch, padded_vocab_size=padded, logprobs_mode=mode)
    requests = []
    for b in range(batch):
        params = random_params(r)
        prompt = [r.randrange(vocab) for _ in range(3)]
        seed = sampler.add_request(b, params, prompt)
        requests.append(ReferenceRequest(params, seed, len(prompt), prompt, []))
    for step in range(steps):
        logits = adversarial_logits(r, batch, vocab, padded)
        got = sampler.sample(logits)
        want, mus = reference_step(logits, requests, vocab_size=vocab, logprobs_mode=mode)
        assert not dc.compare(f"{backend} case {case_seed} step {step}", got, want)
        assert sampler.mus_of(range(batch)) == mus, (backend, case_seed, step)  # Mirostat's mu, to the bit
        for req, token, mu in zip(requests, want.token_ids.tolist(), mus):
            req.output_token_ids.append(token)
            req.position += 1
            req.mirostat_mu = mu


@pytest.mark.parametrize("backend", ROUTES)
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "processed_logits"])
@pytest.mark.parametrize("case_seed", range(6))
def test_random_and_adversarial_batches_match_the_reference(backend, mode, case_seed):
    if backend == "kernels":
        pytest.importorskip("triton")
    run_case(backend, 100 * case_seed + ROUTES.index(backend), mode)


@pytest.mark.parametrize("name", ["top_n_sigma", "typical_p", "epsilon_cutoff", "eta_cutoff", "xtc", "dynatemp"])
def test_each_sampler_alone_changes_the_distribution_and_matches_the_reference(name):
    """Each sampler on its own, on peaked and flat rows: the kept set (processed logprobs) differs
    from the plain row's on some rows, and equals the reference's on all."""
    fields = {"top_n_sigma": dict(top_n_sigma=1.0), "typical_p": dict(typical_p=0.6),
              "epsilon_cutoff": dict(epsilon_cutoff=0.03), "eta_cutoff": dict(eta_cutoff=0.03),
              "xtc": dict(xtc_probability=1.0, xtc_threshold=0.05),
              "dynatemp": dict(dynatemp_range=0.9, dynatemp_exponent=1.0)}[name]
    vocab, batch = 40, 12
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(batch, vocab, generator=gen) * torch.linspace(0.2, 6.0, batch)[:, None]
    changed = 0
    for params in (SamplingParams(temperature=1.0, seed=3, logprobs=-1, **fields),):
        s = Sampler(vocab, max_slots=batch, logprobs_mode="processed_logprobs", backend="torch")
        plain = Sampler(vocab, max_slots=batch, logprobs_mode="processed_logprobs", backend="torch")
        for b in range(batch):
            s.add_request(b, params, [0])
            plain.add_request(b, SamplingParams(temperature=1.0, seed=3, logprobs=-1), [0])
        got, base = s.sample(logits), plain.sample(logits)
        want = reference_sample(logits, [ReferenceRequest(params, 3, 1, [0])] * batch,
                                logprobs_mode="processed_logprobs")
        assert not dc.compare(name, got, want)
        changed = int((got.logprobs.top_logprobs != base.logprobs.top_logprobs).any(dim=-1).sum())
    assert changed >= 1


# ------------------------------------------------------------------ the tie rules, by hand
def kept_ids(params: SamplingParams, row: list[float], mode: str = "processed_logprobs") -> set[int]:
    """The ids the sampler keeps for one row (finite processed logprobs), checked against the reference."""
    logits = torch.tensor([row])
    s = Sampler(len(row), max_slots=1, logprobs_mode=mode, backend="torch")
    s.add_request(0, params, [])
    got = s.sample(logits)
    want = reference_sample(logits, [ReferenceRequest(params, params.seed, 0)], logprobs_mode=mode)
    assert not dc.compare("by hand", got, want)
    lp = got.logprobs
    return {int(i) for i, v in zip(lp.top_token_ids[0], lp.top_logprobs[0]) if v > NEG_INF}


def test_top_n_sigma_uses_the_population_deviation_and_keeps_ties_at_the_border():
    # values 0, 0, 2, 2 (T = 1): mean 1, population sigma 1 (the sample one is 1.155)
    p = SamplingParams(seed=1, logprobs=-1, top_n_sigma=2.0)
    assert kept_ids(p, [2.0, 0.0, 2.0, 0.0]) == {0, 1, 2, 3}  # 0 >= 2 - 2 * 1: on the border, kept
    assert kept_ids(SamplingParams(seed=1, logprobs=-1, top_n_sigma=1.9), [2.0, 0.0, 2.0, 0.0]) == {0, 2}
    assert kept_ids(SamplingParams(seed=1, logprobs=-1, top_n_sigma=0.0), [1.0, 3.0, 3.0, 0.0]) == {1, 2}
    # the kept set does not depend on T (values exact in binary: no rounding at the division)
    assert kept_ids(SamplingParams(seed=1, logprobs=-1, top_n_sigma=2.0, temperature=0.5),
                    [2.0, 0.0, 2.0, 0.0]) == {0, 1, 2, 3}


def test_typical_p_orders_by_distance_to_the_entropy_and_keeps_equal_scores_together():
    # q ~ (0.787, 0.106, 0.106): id 0 first (score 0.42), then ids 1 and 2 tied (score 1.58): the mass
    # before the tie is 0.787, so typical_p = 0.8 keeps both (not only id 1), 0.7 neither
    row = [2.0, 0.0, 0.0]
    assert kept_ids(SamplingParams(seed=2, logprobs=-1, typical_p=0.8), row) == {0, 1, 2}
    assert kept_ids(SamplingParams(seed=2, logprobs=-1, typical_p=0.7), row) == {0}
    # a peaked row: the most probable id is the most typical when H is small
    peaked = [8.0, 0.0, -1.0, -2.0]
    assert kept_ids(SamplingParams(seed=2, logprobs=-1, typical_p=0.5), peaked) == {0}
    # a row where the most probable id is *not* the most typical: q ~ (0.4, 0.2, 0.2, 0.2) minus a bit
    row = [math.log(4.0), math.log(2.2), math.log(2.0), math.log(1.8), math.log(0.1)]
    kept = kept_ids(SamplingParams(seed=2, logprobs=-1, typical_p=0.3), row)
    assert 1 in kept and 4 not in kept


def test_epsilon_and_eta_always_keep_the_maxima():
    flat = [0.0] * 8
    assert kept_ids(SamplingParams(seed=3, logprobs=-1, epsilon_cutoff=0.9), flat) == set(range(8))
    assert kept_ids(SamplingParams(seed=3, logprobs=-1, eta_cutoff=0.9), flat) == set(range(8))
    row = [3.0, 3.0, 0.0, -5.0]
    assert kept_ids(SamplingParams(seed=3, logprobs=-1, epsilon_cutoff=0.2), row) == {0, 1}
    # eta's bound min(eta, sqrt(eta) exp(-H)): with H large the second term is the smaller one
    wide = [0.0] * 60 + [-0.4] * 4
    assert kept_ids(SamplingParams(seed=3, logprobs=-1, eta_cutoff=0.02), wide) == set(range(64))
    assert kept_ids(SamplingParams(seed=3, logprobs=-1, epsilon_cutoff=0.02), wide) == set(range(60))


def test_xtc_removes_all_but_the_least_probable_above_the_threshold():
    p = SamplingParams(seed=4, logprobs=-1, xtc_probability=1.0, xtc_threshold=0.2)
    assert kept_ids(p, [3.0, 2.0, 1.0, -3.0, -3.0]) == {1, 2, 3, 4}  # q ~ .66, .24, .09: 0 goes, 1 stays
    # equal probabilities: one is kept, the highest id (the last in the canonical order)
    assert kept_ids(p, [0.0, 0.0, 0.0]) == {2}
    # only one id above the threshold: nothing removed
    assert kept_ids(p, [5.0, 0.0, 0.0, 0.0]) == {0, 1, 2, 3}
    # threshold 0.5 with two ids of exactly 0.5
    half = SamplingParams(seed=4, logprobs=-1, xtc_probability=1.0, xtc_threshold=0.5)
    assert kept_ids(half, [1.0, 1.0, NEG_INF]) == {1}


def test_dynamic_temperature_follows_the_entropy_and_turns_greedy_at_zero():
    vocab = 6
    flat = torch.zeros(1, vocab)
    flat[0, 0] = 1.0
    p = SamplingParams(temperature=1.0, dynatemp_range=0.5, seed=5, logprobs=-1)
    got = kept_ids(p, flat[0].tolist(), mode="processed_logits")
    assert got == set(range(vocab))
    # T_min = 0 and H = 0 (the other ids underflow float64's exp): greedy, whatever the seed
    for seed in range(20):
        p = SamplingParams(temperature=0.5, dynatemp_range=1.0, seed=seed)
        s = Sampler(4, max_slots=1, backend="torch")
        s.add_request(0, p, [])
        row = torch.tensor([[-1000.0, 0.0, -1000.0, -2000.0]])
        assert s.sample(row).token_ids.tolist() == [1]
    # the value of T_dyn: processed logits are z / T_dyn
    row = [0.0, 0.0, math.log(2.0)]
    p = SamplingParams(temperature=1.0, dynatemp_range=0.5, dynatemp_exponent=1.0, seed=1, logprobs=-1)
    s = Sampler(3, max_slots=1, logprobs_mode="processed_logits", backend="torch")
    s.add_request(0, p, [])
    out = s.sample(torch.tensor([row]))
    q = torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64) / 4
    h = float(-(q * q.log()).sum())
    t_dyn = 0.5 + 1.0 * h / math.log(3)
    value = dict(zip(out.logprobs.top_token_ids[0].tolist(), out.logprobs.top_logprobs[0].tolist()))[2]
    assert value == pytest.approx(math.log(2.0) / t_dyn, rel=1e-6)


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits", "raw_logprobs"])
def test_dynamic_temperature_rows_emptied_by_the_request_temperature(mode):
    """The emptiness test of step 7 uses the request's T: a row whose ids all underflow at z / T has
    no id left (raw greedy id, invalid, processed values all -inf) even with a dynamic temperature;
    a row that survives T but not T_dyn is greedy on z."""
    logits = torch.tensor([[-3e38, -3.2e38, -3.3e38, -3.05e38], [-3e38, -3.1e38, -2e38, 5.0],
                           [-1e36, -2e36, -1.5e36, -3e36]])
    params = [SamplingParams(temperature=0.01, dynatemp_range=0.005, seed=2, logprobs=4),
              SamplingParams(temperature=0.01, dynatemp_range=0.009, seed=1, logprobs=4, typical_p=0.9),
              SamplingParams(temperature=0.5, dynatemp_range=0.4999, dynatemp_exponent=20.0, seed=3, logprobs=4)]
    s = Sampler(4, max_slots=3, logprobs_mode=mode, backend="torch")
    for b, p in enumerate(params):
        s.add_request(b, p, [])
    got = s.sample(logits)
    want = reference_sample(logits, [ReferenceRequest(p, p.seed, 0) for p in params], logprobs_mode=mode)
    assert not dc.compare(mode, got, want)
    assert got.valid.tolist() == [False, True, True] and got.token_ids.tolist()[:2] == [0, 3]


# ------------------------------------------------------------------ invariance and reproducibility
def test_a_row_does_not_depend_on_its_batch():
    r = random.Random(11)
    vocab = 50
    params = [random_params(r, temperature=1.0) for _ in range(8)]
    logits = adversarial_logits(r, 8, vocab, vocab)
    together = Sampler(vocab, max_slots=8, backend="torch")
    for b, p in enumerate(params):
        together.add_request(b, p, [1])
    joint = together.sample(logits).token_ids
    for b, p in enumerate(params):
        alone = Sampler(vocab, max_slots=3, backend="torch")
        alone.add_request(2, p, [1])
        assert alone.sample(logits[b:b + 1], [2]).token_ids.item() == joint[b].item()


def test_the_same_seed_gives_the_same_tokens():
    r = random.Random(12)
    vocab = 50
    params = [random_params(r, temperature=1.2, xtc_probability=0.5) for _ in range(4)]
    runs = []
    for _ in range(2):
        s = Sampler(vocab, max_slots=4, backend="torch")
        for b, p in enumerate(params):
            s.add_request(b, p, [1])
        gen = torch.Generator().manual_seed(0)
        runs.append([s.sample(torch.randn(4, vocab, generator=gen) * 3).token_ids.tolist() for _ in range(5)])
    assert runs[0] == runs[1]


def test_the_xtc_coin_is_its_own_coordinate_not_a_token_noise(monkeypatch):
    """The coin is U at the token coordinate 2^32 - 1: never the noise of a token of its row, and
    replacing the tokens' noise changes the tokens but not where XTC acted."""
    seeds, positions = torch.arange(200) * 7919, torch.arange(200)
    coin = rng.xtc_coin(seeds, positions, 0)
    assert torch.equal(coin, rng.U(seeds, positions, rng.COIN_TOKEN, 0))
    noise = rng.U(seeds[:, None], positions[:, None], torch.arange(64)[None, :], 0)
    assert not bool((noise == coin[:, None]).any())
    vocab = 8
    params = SamplingParams(seed=9, logprobs=-1, xtc_probability=0.5, xtc_threshold=0.0)
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1))

    def acted_and_tokens():
        acted, tokens = [], []
        for position in range(40):
            out = reference_sample(logits, [ReferenceRequest(params, 9, position)], logprobs_mode="processed_logprobs")
            acted.append(int((out.logprobs.top_logprobs > NEG_INF).sum()) == 1)
            tokens.append(int(out.token_ids))
        return acted, tokens

    acted, tokens = acted_and_tokens()
    original = rng.gumbel
    monkeypatch.setattr(rng, "gumbel", lambda seed, position, token, stream=0: -original(seed, position, token, stream))
    acted_again, tokens_again = acted_and_tokens()
    assert acted == acted_again and tokens != tokens_again


def test_the_xtc_coin_acts_with_its_probability():
    """Over 4000 positions of a sampler run, XTC (threshold 0: it keeps only the least probable id
    when it acts) acts on a fraction within 4.5 standard deviations of p (fixed seeds: deterministic)."""
    vocab, slots, steps = 8, 500, 8
    for p in (0.3, 0.85):
        s = Sampler(vocab, max_slots=slots, logprobs_mode="processed_logprobs", backend="torch")
        for b in range(slots):
            s.add_request(b, SamplingParams(seed=1000 + b, logprobs=-1, xtc_probability=p, xtc_threshold=0.0), [0])
        gen = torch.Generator().manual_seed(2)
        acted = 0
        for _ in range(steps):
            out = s.sample(torch.randn(slots, vocab, generator=gen))
            acted += int(((out.logprobs.top_logprobs > NEG_INF).sum(dim=-1) == 1).sum())
        n = slots * steps
        assert abs(acted / n - p) < 4.5 * math.sqrt(p * (1 - p) / n)


# ------------------------------------------------------------------ the other steps
def test_the_triton_step_hands_these_rows_to_the_torch_step(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sampler = Sampler(10, max_slots=2, backend="triton")
    logits = torch.randn(2, 10)
    assert sampler.backends.choose(logits, plan_step([SamplingParams(top_k=3)], 10)) is sampler.backends.kernels
    for name, value in (("dynatemp_range", 0.5), ("top_n_sigma", 1.0), ("typical_p", 0.5),
                        ("epsilon_cutoff", 0.1), ("eta_cutoff", 0.1), ("xtc_probability", 0.5), ("mirostat_tau", 3.0)):
        plan = plan_step([SamplingParams(**{name: value})], 10)
        assert plan.full_row and sampler.backends.choose(logits, plan) is sampler.backends.torch_step
        greedy = plan_step([SamplingParams(temperature=0.0, **{name: value})], 10)
        assert not greedy.full_row and sampler.backends.choose(logits, greedy) is sampler.backends.kernels
    assert set(FULL_ROW_STAGES) == {"dynatemp", "top_n_sigma", "typical_p", "epsilon", "eta", "xtc", "mirostat"}


@pytest.mark.parametrize("field,value", [("dynatemp_range", 0.5), ("top_n_sigma", 1.0), ("typical_p", 0.5),
                                         ("epsilon_cutoff", 0.1), ("eta_cutoff", 0.1), ("xtc_probability", 0.5),
                                         ("mirostat_tau", 3.0)])
def test_a_split_admits_them_and_samples_as_unsplit(field, value):
    """Every rank admits the field (add_request, set_params; greedy rows too) and samples what the
    unsplit sampler samples on the concatenated logits (tokens, log-probs, Mirostat's mu)."""
    params = [SamplingParams(seed=4, logprobs=3, **{field: value}),
              SamplingParams(seed=5, temperature=0.0, **{field: value})]
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(1)) * 2
    later = SamplingParams(seed=6, top_k=5, **{field: value})

    def drive(sampler, part):
        for slot, p in enumerate(params):
            sampler.add_request(slot, p, [1])
        first = sampler.sample(part)
        sampler.set_params([1], [later])
        return first, sampler.sample(part), sampler.mus_of([0, 1])

    want = drive(Sampler(16, max_slots=2, logprobs_mode="processed_logprobs"), logits)
    for got in dc.run_threads(2, lambda ex: drive(Sampler(16, max_slots=2, group=ex,
                                                          logprobs_mode="processed_logprobs"),
                                                  logits[:, 8 * ex.rank:8 * ex.rank + 8])):
        assert not dc.compare("first", got[0], want[0]) and not dc.compare("second", got[1], want[1])
        assert got[2] == want[2]


def test_match_mode_is_the_step_by_step_sample():
    r = random.Random(21)
    vocab, batch, k = 40, 4, 3
    params = [random_params(r, temperature=1.0) for _ in range(batch)]
    target = torch.randn(batch, k + 1, vocab, generator=torch.Generator().manual_seed(3)) * 3
    a, b = Sampler(vocab, max_slots=batch, backend="torch"), Sampler(vocab, max_slots=batch, backend="torch")
    for slot, p in enumerate(params):
        a.add_request(slot, p, [1])
        b.add_request(slot, p, [1])
    stepwise = torch.stack([b.sample(target[:, j]).token_ids for j in range(k + 1)], dim=1)
    drafts = stepwise[:, :k].clone()
    drafts[0, 1] = (drafts[0, 1] + 1) % vocab  # a mismatch on row 0 at position 1
    out = a.sample_speculative(target, drafts, mode="match")
    assert torch.equal(out.token_ids[1:], stepwise[1:])
    assert out.token_ids[0, :2].tolist() == stepwise[0, :2].tolist() and out.num_emitted[0] == 2


def test_rejection_mode_targets_the_filtered_distribution():
    """`target_rows` keeps the definition's final z (the reference's processed logits) on rows with
    the full-row samplers, and a T_dyn = 0 row is a greedy target."""
    from tokensampler.speculative import target_rows

    r = random.Random(31)
    vocab, batch = 50, 6
    params = [random_params(r, temperature=r.choice([0.7, 1.3])) for _ in range(batch - 1)]
    params.append(SamplingParams(temperature=0.5, dynatemp_range=1.0, seed=1))
    s = Sampler(vocab, max_slots=batch, backend="torch")
    requests = []
    for b, p in enumerate(params):
        seed = s.add_request(b, p, [2])
        requests.append(ReferenceRequest(p, seed, 1, [2]))
    logits = adversarial_logits(r, batch, vocab, vocab)
    logits[-1] = torch.tensor([0.0] + [-1000.0] * (vocab - 1))
    plan = plan_step(params, vocab)
    rows = target_rows(s.state, logits, torch.arange(batch), plan)
    want = reference_sample(logits, requests, logprobs_mode="processed_logits")
    assert torch.equal(rows.tokens, want.token_ids)
    for b in range(batch - 1):
        if rows.sampled[b]:
            s_ = Sampler(vocab, max_slots=1, logprobs_mode="processed_logits", backend="torch")
            s_.add_request(0, dataclasses.replace(params[b], logprobs=-1), [2])
            final = s_.sample(logits[b:b + 1]).logprobs
            dense = torch.full((vocab,), NEG_INF)
            dense[final.top_token_ids[0]] = final.top_logprobs[0]
            assert torch.equal(rows.final[b], dense)
    assert not bool(rows.sampled[-1]) and int(rows.tokens[-1]) == 0
    # the whole rejection verification runs with these rows (one-hot drafts)
    drafts = rows.tokens[:, None].clone()
    out = s.sample_speculative(torch.stack([logits, logits], dim=1), drafts, mode="rejection")
    assert bool((out.num_emitted >= 1).all())


# ------------------------------------------------------------------ argument checks
@pytest.mark.parametrize("field,bad", [
    ("dynatemp_range", -0.1), ("dynatemp_range", math.inf), ("dynatemp_range", 3.5e38), ("dynatemp_range", "1"),
    ("dynatemp_exponent", -1.0), ("dynatemp_exponent", math.nan),
    ("top_n_sigma", -0.5), ("top_n_sigma", math.inf), ("top_n_sigma", True),
    ("typical_p", 0.0), ("typical_p", 1.5), ("typical_p", None),
    ("epsilon_cutoff", 1.0), ("epsilon_cutoff", -0.1), ("eta_cutoff", 1.0), ("eta_cutoff", math.nan),
    ("xtc_probability", 1.01), ("xtc_probability", -0.1), ("xtc_threshold", 2.0), ("xtc_threshold", None),
])
def test_bad_values_name_the_field(field, bad):
    with pytest.raises(InvalidSamplingParams) as raised:
        SamplingParams(**{field: bad})
    assert raised.value.field == field and "allowed" in str(raised.value)


def test_off_values_and_the_sentinel():
    assert SamplingParams(top_n_sigma=-1).top_n_sigma is None
    p = SamplingParams()
    assert p.full_row_fields == () and not plan_step([p], 8).full_row
    assert SamplingParams(temperature=0.0, typical_p=0.5).full_row_fields == ()
    assert SamplingParams(typical_p=0.5, xtc_probability=0.1).full_row_fields == (("typical_p", 0.5),
                                                                                  ("xtc_probability", 0.1))


# ------------------------------------------------------------------ serving: checkpoint defaults, the command line
def test_generation_config_supplies_typical_epsilon_eta(tmp_path):
    from tokensampler import InvalidCheckpoint, load_generation_defaults, resolve_request

    (tmp_path / "generation_config.json").write_text(
        '{"typical_p": 0.8, "epsilon_cutoff": 0.0003, "eta_cutoff": 0.001, "top_n_sigma": 2.0}')
    defaults = load_generation_defaults(tmp_path)
    assert (defaults.typical_p, defaults.epsilon_cutoff, defaults.eta_cutoff) == (0.8, 0.0003, 0.001)
    params = resolve_request({}, defaults)
    assert (params.typical_p, params.epsilon_cutoff, params.eta_cutoff, params.top_n_sigma) == (0.8, 0.0003, 0.001,
                                                                                               None)
    sent = resolve_request({"typical_p": 0.5, "top_n_sigma": 1.5, "xtc_probability": 0.2}, defaults)
    assert (sent.typical_p, sent.top_n_sigma, sent.xtc_probability, sent.eta_cutoff) == (0.5, 1.5, 0.2, 0.001)
    (tmp_path / "generation_config.json").write_text('{"typical_p": 0.0}')
    with pytest.raises(InvalidCheckpoint) as raised:
        load_generation_defaults(tmp_path)
    assert raised.value.field == "typical_p"


def test_generate_flags_reach_the_request():
    import argparse

    from tokensampler.tools.generate_command import add_generate_parser, request_from_args

    parser = argparse.ArgumentParser()
    add_generate_parser(parser.add_subparsers())
    args = parser.parse_args(["generate", "--model", "m", "--prompt", "p", "--typical-p", "0.7", "--eta-cutoff",
                              "0.01", "--epsilon-cutoff", "0.02", "--top-n-sigma", "1", "--dynatemp-range", "0.5",
                              "--dynatemp-exponent", "2", "--xtc-probability", "0.5", "--xtc-threshold", "0.2"])
    assert request_from_args(args) == dict(typical_p=0.7, eta_cutoff=0.01, epsilon_cutoff=0.02, top_n_sigma=1.0,
                                           dynatemp_range=0.5, dynatemp_exponent=2.0, xtc_probability=0.5,
                                           xtc_threshold=0.2)
