"""Mirostat v2 (docs/semantics.md 10.6): llama.cpp's `llama_sampler_init_mirostat_v2(seed, tau, eta)`.

The oracle against the numpy transcription of llama.cpp (tests/support/sampler_definitions.py, itself
checked against llama.cpp) at temperature 1; every backend against the oracle over many steps, tokens
and mu to the bit (alone, eager and compiled; the mixed batches are tests/test_full_row_filters.py's);
the keep rule at its border and its tie rule by hand; the average observed surprise of a long
fixed-seed run on a Zipf distribution (the controller reaches tau); the slot state (admission,
`set_params`, `reset_history`, `move_slots`, `set_mu`); the parameter checks.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

import tests.support.sampler_definitions as defs
import tests.support.split_cases as dc
from tests.support.backends import make_sampler
from tokensampler import InvalidSamplingParams, Sampler, SamplingParams
from tokensampler.reference import ReferenceRequest, canonical_ids, reference_step

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the Triton interpreter's discarded lanes
NEG_INF = float("-inf")


def test_the_oracle_is_llama_cpps_mirostat_v2_at_temperature_one():
    """Kept set and mu after each token equal the transcription's (its float64 sums in another order:
    mu to 1e-12), over 40 steps of three requests, mu carried from step to step."""
    vocab = 200
    gen = torch.Generator().manual_seed(3)
    for tau, eta in ((1.0, 0.1), (3.0, 1.0), (6.0, 0.3)):
        params = SamplingParams(seed=11, mirostat_tau=tau, mirostat_eta=eta, logprobs=-1)
        request = ReferenceRequest(params, 11, 0)
        mu = 2.0 * tau
        truncated = 0
        for step in range(40):
            logits = torch.randn(1, vocab, generator=gen) * 3
            out, (new_mu,) = reference_step(logits, [request], logprobs_mode="processed_logits")
            kept = (out.logprobs.top_logprobs[0] > NEG_INF)
            kept_ids = set(out.logprobs.top_token_ids[0][kept].tolist())
            z = logits[0].numpy().astype(np.float32)
            want = set(np.nonzero(defs.mirostat_v2_keep(z, mu))[0].tolist())
            assert kept_ids == want, (tau, step)
            truncated += len(want) < vocab
            token = int(out.token_ids[0])
            assert new_mu == pytest.approx(defs.mirostat_v2_mu(z, mu, tau, eta, token), rel=1e-12, abs=1e-12)
            mu = new_mu
            request.mirostat_mu, request.position = mu, request.position + 1
        assert truncated >= 10  # the filter acted


@pytest.mark.parametrize("backend,compiled", [("direct", False), ("block", False), ("block", True),
                                              ("kernels", False), ("split2", False), ("split3", False)])
def test_every_backend_equals_the_oracle_tokens_and_mu_over_steps(backend, compiled):
    if backend == "kernels":
        pytest.importorskip("triton")
    r = random.Random(5)
    vocab, batch, steps = 64, 6, 12
    padded = 66 if backend == "split3" else vocab  # a multiple of the ranks
    sampler = make_sampler(backend, vocab, max_slots=batch, logprobs_mode="processed_logprobs", compile=compiled,
                           padded_vocab_size=padded)
    requests = []
    for b in range(batch):
        params = SamplingParams(seed=r.randrange(2**63), temperature=r.choice([0.0, 0.6, 1.0, 1.4]), logprobs=3,
                                mirostat_tau=r.choice([0.0, 1.0, 2.5, 4.0]), mirostat_eta=r.choice([0.1, 0.5, 2.0]))
        sampler.add_request(b, params, [1, 2])
        requests.append(ReferenceRequest(params, params.seed, 2, [1, 2], []))
    gen = torch.Generator().manual_seed(7)
    moved = 0
    for step in range(steps):
        logits = torch.randn(batch, vocab, generator=gen) * r.choice([0.5, 2.0, 6.0])
        got = sampler.sample(torch.nn.functional.pad(logits, (0, padded - vocab), value=1e4))  # padding: never drawn
        want, mus = reference_step(logits, requests, logprobs_mode="processed_logprobs")
        assert not dc.compare(f"{backend} step {step}", got, want)
        assert sampler.mus_of(range(batch)) == mus, step
        for req, token, mu in zip(requests, want.token_ids.tolist(), mus):
            moved += mu != req.mu
            req.output_token_ids.append(token)
            req.position += 1
            req.mirostat_mu = mu
    assert moved > steps  # mu moved on the sampled rows (and stayed on the greedy ones)


# ------------------------------------------------------------------ the keep rule, by hand
def kept_at(row: list[float], tau: float, mu: float | None = None) -> set[int]:
    """The ids the sampler keeps for one row at mu (None: 2 tau), checked against the oracle."""
    params = SamplingParams(seed=1, logprobs=-1, mirostat_tau=tau)
    logits = torch.tensor([row])
    s = Sampler(len(row), max_slots=1, logprobs_mode="processed_logprobs", backend="torch")
    s.add_request(0, params, [])
    s.set_mu([0], [mu])
    got = s.sample(logits)
    want = reference_step(logits, [ReferenceRequest(params, 1, 0, mirostat_mu=mu)], logprobs_mode="processed_logprobs")
    assert not dc.compare("by hand", got, want[0])
    lp = got.logprobs
    return {int(i) for i, v in zip(lp.top_token_ids[0], lp.top_logprobs[0]) if v > NEG_INF}


def surprise_of(row: list[float], i: int) -> float:
    """-log2 q_i of the row's softmax, computed as the definition does (float64, canonical order)."""
    z = torch.tensor(row)
    ids = canonical_ids(z, z > NEG_INF)
    x = z[ids].to(torch.float64)
    e = torch.exp(x - x[0])
    return float(-torch.log2(e / torch.cumsum(e, 0)[-1])[int((ids == i).nonzero())])


def test_an_id_whose_surprise_equals_mu_is_kept():
    row = [2.0, 1.0, 0.5, -1.0, -3.0]
    border = surprise_of(row, 2)
    assert kept_at(row, 1.0, border) == {0, 1, 2}  # surprise <= mu: the border id stays
    assert kept_at(row, 1.0, math.nextafter(border, -math.inf)) == {0, 1}
    assert kept_at(row, 1.0) == {0}  # mu = 2 tau at admission: 2 bits (id 1's surprise is 2.16)
    assert kept_at(row, 5.0) == {0, 1, 2, 3, 4}


def test_when_no_id_qualifies_the_ids_tied_at_the_maximum_stay():
    # tau = 0: mu = 0 keeps only an id of probability 1; three ids tied at the max (q = 0.3 each) stay
    assert kept_at([1.0, 1.0, 0.0, 1.0], 0.0) == {0, 1, 3}
    assert kept_at([3.0, 1.0, 0.0], 0.0) == {0}
    assert kept_at([0.0, NEG_INF, 0.0], 0.0) == {0, 2}


# ------------------------------------------------------------------ the controller
def zipf_surprises(tau: float, eta: float, flip: bool = False, slots: int = 8, steps: int = 500) -> torch.Tensor:
    """The observed surprise (bits, of each token among the kept ids: its processed logprob) of a
    fixed-seed run on Zipf rows (logits -1.1 log rank, V = 2000, each slot its own ranking)."""
    vocab = 2000
    sampler = Sampler(vocab, max_slots=slots, backend="torch", logprobs_mode="processed_logprobs")
    for b in range(slots):
        sampler.add_request(b, SamplingParams(seed=100 + b, mirostat_tau=tau, mirostat_eta=eta, logprobs=0), [])
    gen = torch.Generator().manual_seed(1)
    logits = -1.1 * torch.log(torch.stack([torch.randperm(vocab, generator=gen) for _ in range(slots)]).float() + 1)
    out = []
    for _ in range(steps):
        if flip:  # the control: the update with its sign flipped (mu moves away from tau)
            mus = sampler.mus_of(range(slots))
        got = sampler.sample(logits)
        out.append(-got.logprobs.token_logprobs.double() / math.log(2))
        if flip:
            sampler.set_mu(range(slots), [2 * m - n for m, n in zip(mus, sampler.mus_of(range(slots)))])
    return torch.stack(out)


@pytest.mark.parametrize("tau,eta", [(3.0, 0.1), (5.0, 1.0)])
def test_the_average_surprise_reaches_tau_on_a_zipf_stream(tau, eta):
    """Over the last half of 500 steps of 8 slots (2,000 tokens), the mean observed surprise is within
    0.05 bits of tau (measured: 2.989 and 4.999); the row's entropy is 7.3 bits, so without Mirostat
    it would sit near 7.3. The same run with the update's sign flipped misses by more than a bit."""
    surprises = zipf_surprises(tau, eta)
    assert abs(float(surprises[250:].mean()) - tau) < 0.05
    assert abs(float(zipf_surprises(tau, eta, flip=True, steps=120)[60:].mean()) - tau) > 1.0


# ------------------------------------------------------------------ the slot state
def test_mu_is_admitted_moved_reset_and_set():
    vocab = 30
    s = Sampler(vocab, max_slots=4, backend="torch")
    p = SamplingParams(seed=3, mirostat_tau=2.0, mirostat_eta=1.0)
    s.add_request(0, p, [1])
    s.add_request(1, SamplingParams(seed=4), [1])
    assert s.mus_of([0, 1]) == [4.0, None]
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)) * 3
    s.sample(logits, [0, 1])
    mu = s.mu_of(0)
    assert mu != 4.0
    s.sample(logits, [0, 1], record=torch.tensor([False, True]))  # not recorded: mu stays
    assert s.mu_of(0) == mu
    s.move_slots([2], [0])  # the slot's mu goes with it
    assert s.mu_of(2) == mu
    s.set_mu([2], [1.25])
    assert s.mu_of(2) == 1.25
    s.reset_history([2], torch.tensor([[1]]), None)
    assert s.mu_of(2) == 4.0
    s.set_mu([2], [None])  # None keeps it
    assert s.mu_of(2) == 4.0
    s.set_mu([2], [0.5])
    s.set_params([2], [SamplingParams(seed=3, mirostat_tau=1.5)])
    assert s.mu_of(2) == 3.0
    s.set_params([2], [SamplingParams(seed=3)])
    assert s.mu_of(2) is None
    for slots, mus, field in (([1], [1.0], "mus"), ([2], [1.0], "mus"), ([3], [1.0], "slot"),
                              ([0, 0], [None, None], "slots"), ([0], [1.0, 2.0], "mus")):
        with pytest.raises(InvalidSamplingParams) as info:
            s.set_mu(slots, mus)
        assert info.value.field == field, (slots, mus)
    s.set_params([2], [p])
    for bad in (math.inf, math.nan, "1"):
        with pytest.raises(InvalidSamplingParams, match="mu"):
            s.set_mu([2], [bad])


def test_greedy_and_emptied_rows_keep_their_mu():
    s = Sampler(4, max_slots=2, backend="torch")
    s.add_request(0, SamplingParams(temperature=0.0, mirostat_tau=1.0), [])
    s.add_request(1, SamplingParams(seed=2, mirostat_tau=1.0), [])
    s.sample(torch.tensor([[0.0, 1.0, 2.0, 3.0], [NEG_INF] * 4]))
    assert s.mus_of([0, 1]) == [2.0, 2.0]


@pytest.mark.parametrize("field,value", [("mirostat_tau", -0.5), ("mirostat_tau", math.inf),
                                         ("mirostat_tau", math.nan), ("mirostat_tau", "3"), ("mirostat_tau", 1e39),
                                         ("mirostat_eta", -1.0), ("mirostat_eta", math.inf), ("mirostat_eta", None)])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field and info.value.value is value
    assert SamplingParams(mirostat_tau=-1).mirostat_tau is None
    assert SamplingParams(mirostat_tau=0).mirostat_tau == 0.0
