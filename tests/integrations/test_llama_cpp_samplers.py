"""llama.cpp's own samplers (its C API through `llama_cpp`, tests/support/llama_cpp_samplers.py) on the
same logits and histories as tokensampler's definition, one sampler at a time, at temperature 1.

For tokensampler's samplers (top-k, top-p, min-p, temperature, the penalties, logit bias, and the
full-row ones: top-n-sigma, typical-p, dynamic temperature, XTC) the kept set (or the edited logits)
is compared with reference.py's, the full-row ones also with the issue's definitions transcribed in
tests/support/sampler_definitions.py; for those it does not define (Mirostat v2, DRY) with the
transcriptions alone. Where llama.cpp differs by definition (top-k and top-p ties,
min_keep, the penalties' window, unclamped bias, temperature last in its chain, dynamic temperature's
H_max) the test asserts the difference, as docs/llama-cpp.md states it.

llama.cpp is a peer, not a requirement: skipped when `llama_cpp` is not importable (its build is too
long for CI: docs/llama-cpp.md, "Build"). The recorded run is in docs/llama-cpp.md.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (a recorded validation run, not CI: "
                                        "docs/llama-cpp.md has its build command)")

from tests.support import llama_cpp_samplers as lc  # noqa: E402
from tests.support import sampler_definitions as defs  # noqa: E402
from tokensampler.core.params import SamplingParams  # noqa: E402
from tokensampler.tools.workloads import make_logits  # noqa: E402

V = 4096
SEEDS = range(6)


def llm_row(seed: int, vocab: int = V, flat: bool = False) -> np.ndarray:
    """The bench's LLM-shaped logits (no ties: continuous noise)."""
    return make_logits(1, vocab, flat=flat, seed=seed)[0].numpy()


def tied_row(seed: int, vocab: int = V) -> np.ndarray:
    """Logits rounded to steps of 0.5: most values are shared by several ids."""
    return (np.round(llm_row(seed, vocab) * 2) / 2).astype(np.float32)


def masked_row(seed: int, vocab: int = V, fraction: float = 0.3) -> np.ndarray:
    """An LLM row with a random `fraction` of the ids (never the top one) at -inf."""
    row = llm_row(seed, vocab)
    rng = np.random.default_rng(seed)
    removed = rng.random(vocab) < fraction
    removed[int(np.argmax(row))] = False
    return np.where(removed, -np.inf, row).astype(np.float32)


def rows() -> list[tuple[str, np.ndarray]]:
    return ([(f"llm{s}", llm_row(s)) for s in SEEDS] + [(f"flat{s}", llm_row(s, flat=True)) for s in SEEDS[:3]]
            + [(f"masked{s}", masked_row(s)) for s in SEEDS[:3]])


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, **kw})


def powers_of_two_row(exponents: list[int], vocab: int = 16) -> np.ndarray:
    """A row whose relative probabilities exp(z - max) are exactly 2^-e (float32), the rest -inf:
    masses that land exactly on a top-p or min-p border."""
    row = np.full(vocab, -np.inf, dtype=np.float32)
    row[:len(exponents)] = np.float32(np.log(2.0)) * -np.array(exponents, dtype=np.float32)
    p = np.exp(row[:len(exponents)] - row[0])
    assert p.tolist() == [2.0 ** -e for e in exponents], "exp(z) must round to the powers of two"
    return row


# --- top-k --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 5, 40, 1000, V, V + 10])
def test_top_k_keeps_the_same_ids_without_ties(k):
    for name, z in rows():
        got = lc.apply(lc.top_k(k), z)
        assert got.kept() == defs.reference_kept(z, params(top_k=k)), (name, k)


def test_top_k_ties_llama_cpp_keeps_exactly_k_tokensampler_every_tied_id():
    """Documented difference: llama.cpp truncates its partially sorted array to k entries, so ids
    tied with the k-th value are split by the sort; tokensampler keeps every id tied with it."""
    split = 0
    for seed in SEEDS:
        z = tied_row(seed)
        for k in (3, 10, 40):
            got = lc.apply(lc.top_k(k), z).kept()
            ours = defs.reference_kept(z, params(top_k=k))
            kth = np.sort(z)[::-1][k - 1]
            assert len(got) == k and got <= ours
            assert ours == set(np.flatnonzero(z >= kth).tolist())
            assert {i for i in got if z[i] > kth} == set(np.flatnonzero(z > kth).tolist())
            split += len(ours) > k
    assert split > 0, "the tied rows must put ties across the k-th value"


# --- top-p --------------------------------------------------------------------------------------------

def mass_above(z: np.ndarray, ids: set[int]) -> dict[int, float]:
    """Each id's float64 probability mass of the ids with a strictly larger logit."""
    q = defs.softmax64(z)
    order = np.argsort(-z.astype(np.float64), kind="stable")
    above = np.concatenate([[0.0], np.cumsum(q[order])[:-1]])
    return {int(i): float(above[np.flatnonzero(order == i)[0]]) for i in ids}


BORDER_ROWS = []  # (row, top_p, ids that differ, their distance to the border): reported by the test below


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.95, 0.99])
def test_top_p_keeps_the_same_ids_without_ties(top_p):
    """The same set, except where llama.cpp's float32 cumulative sum (over up to thousands of ids: flat
    rows) rounds across the border: then the ids that differ sit next to it, their strictly-larger
    mass within the float32 sum's error bound (n ulps of 2^-24) of p."""
    for name, z in rows():
        got = lc.apply(lc.top_p(top_p), z).kept()
        ours = defs.reference_kept(z, params(top_p=top_p))
        if got != ours:
            differ = got ^ ours
            assert got < ours or ours < got, (name, top_p)  # nested: both are prefixes of the same order
            distance = max(abs(m - top_p) for m in mass_above(z, differ).values())
            assert len(differ) <= 2 and distance < len(got | ours) * 2.0 ** -24, (name, top_p, differ, distance)
            BORDER_ROWS.append((name, top_p, sorted(differ), distance))
    assert len(BORDER_ROWS) <= 2, BORDER_ROWS


def test_top_p_at_an_exact_border_both_keep_the_id_that_reaches_p():
    """p = (1, 1/2, 1/4, 1/8, 1/8) / 2: the first two ids hold exactly 0.75. llama.cpp keeps the smallest
    prefix whose float32 cumulative mass is >= p; tokensampler keeps an id whose strictly-larger mass is
    < p: both keep two ids (`>` in llama.cpp, or `<=` in ours, would keep three)."""
    z = powers_of_two_row([0, 1, 2, 3, 3])
    assert lc.apply(lc.top_p(0.75), z).kept() == {0, 1}
    assert defs.reference_kept(z, params(top_p=0.75)) == {0, 1}


def test_top_p_ties_llama_cpp_splits_them_tokensampler_keeps_them_together():
    """Documented difference: llama.cpp's prefix ends inside a group of tied ids (its sort order decides
    which stay); tokensampler keeps or removes a tied group whole."""
    split = 0
    for seed in SEEDS:
        z = tied_row(seed)
        for top_p in (0.3, 0.6, 0.9):
            got = lc.apply(lc.top_p(top_p), z).kept()
            ours = defs.reference_kept(z, params(top_p=top_p))
            last = min(z[i] for i in got)  # llama.cpp's smallest kept value
            assert got <= ours
            assert ours == set(np.flatnonzero(z >= last).tolist())  # ours: that value's whole tie group
            split += len(ours) > len(got)
    assert split > 0, "the tied rows must put a tie group across the top-p border"


def test_top_p_min_keep_is_llama_cpps_tokensampler_has_none():
    """Documented difference: llama.cpp keeps at least min_keep ids (common's default is 0); tokensampler
    has no min_keep (top-p keeps at least the most probable id)."""
    z = llm_row(0)
    assert len(lc.apply(lc.top_p(1e-6, min_keep=0), z).kept()) == 1
    assert len(lc.apply(lc.top_p(1e-6, min_keep=5), z).kept()) == 5
    assert len(defs.reference_kept(z, params(top_p=1e-6))) == 1


# --- min-p --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("min_p", [0.01, 0.05, 0.1, 0.3, 0.9])
def test_min_p_keeps_the_same_ids(min_p):
    for name, z in rows() + [(f"tied{s}", tied_row(s)) for s in SEEDS[:3]]:
        got = lc.apply(lc.min_p(min_p), z)
        assert got.kept() == defs.reference_kept(z, params(min_p=min_p)), (name, min_p)


def test_min_p_at_an_exact_border_both_keep_the_id():
    """An id whose relative probability is exactly min_p stays in both: llama.cpp compares logits,
    z >= max + logf(min_p); tokensampler probabilities, exp(z - max) >= min_p."""
    z = powers_of_two_row([0, 1, 2])
    assert lc.apply(lc.min_p(0.5), z).kept() == {0, 1}
    assert defs.reference_kept(z, params(min_p=0.5)) == {0, 1}


def test_min_p_min_keep_is_llama_cpps_tokensampler_has_none():
    z = llm_row(1)
    assert len(lc.apply(lc.min_p(0.999, min_keep=7), z).kept()) == 7
    assert len(defs.reference_kept(z, params(min_p=0.999))) == 1


# --- temperature --------------------------------------------------------------------------------------

@pytest.mark.parametrize("t", [1.0, 0.7, 1.3, 0.05])
def test_temperature_divides_the_same_way(t):
    """Alone, llama.cpp's temp is tokensampler's step 7 to the bit: z / T in float32 (not z * (1/T))."""
    for name, z in rows():
        got = lc.apply(lc.temp(t), z).logits_by_id(V)
        np.testing.assert_array_equal(got, defs.reference_processed(z, params(temperature=t)), err_msg=name)


def test_temperature_zero_is_greedy_on_the_lowest_id_among_the_maxima():
    for name, z in rows() + [(f"tied{s}", tied_row(s)) for s in SEEDS[:3]]:
        got = lc.apply(lc.temp(0.0), z).kept()
        assert got == {defs.reference_token(z, params(temperature=0.0))}, name


def test_temperature_last_in_llama_cpps_chain_first_in_ours():
    """Documented difference: llama.cpp's default chain filters the temperature-1 logits (top-k, top-p,
    min-p) and divides by T last; tokensampler divides first (as vLLM). With temperature 1 the chain
    equals our filters applied in llama.cpp's order; at 0.8 its set is the temperature-1 set."""
    differ = fewer = 0
    for name, z in rows():
        chain = lc.chain(lc.top_k(40), lc.top_p(0.95), lc.min_p(0.05), lc.temp(0.8))
        got = lc.apply(chain, z)
        z1 = defs.reference_processed(z, params(top_k=40))  # our filters one at a time, llama.cpp's order
        z1 = defs.reference_processed(z1, params(top_p=0.95))
        z1 = defs.reference_processed(z1, params(min_p=0.05))
        assert got.kept() == set(np.flatnonzero(z1 > -np.inf).tolist()), name
        np.testing.assert_array_equal(got.logits_by_id(V), np.where(z1 > -np.inf, z / np.float32(0.8), -np.inf))
        differ += got.kept() != defs.reference_kept(z, params(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05))
        # the order alone (temperature 1): our top-p renormalises over what min-p left, so it keeps a subset
        ours = defs.reference_kept(z, params(top_k=40, top_p=0.95, min_p=0.05))
        assert ours <= got.kept(), name
        fewer += ours < got.kept()
    assert differ > 0, "at temperature 0.8 the two definitions must keep different sets on some row"
    assert fewer > 0, "min-p before top-p must keep fewer ids on some row"


def test_top_k_then_top_p_chain_equals_ours_at_temperature_1():
    """top-k 20 + top-p 0.95 (both renormalise over what is left): the same set in either order of definition."""
    for name, z in rows():
        got = lc.apply(lc.chain(lc.top_k(20), lc.top_p(0.95)), z)
        assert got.kept() == defs.reference_kept(z, params(top_k=20, top_p=0.95)), name


# --- penalties ----------------------------------------------------------------------------------------

def history(seed: int, length: int, vocab: int = V, distinct: int = 300) -> list[int]:
    """A history drawn from `distinct` ids, so that ids repeat."""
    rng = np.random.default_rng(100 + seed)
    return rng.choice(rng.choice(vocab, distinct, replace=False), length).tolist()


def rounding_units(got: np.ndarray, want: np.ndarray, z: np.ndarray, out: list[int], freq: float,
                   present: float) -> float:
    """The largest |got - want| in units of one float32 rounding (2^-24 relative) of the operands,
    |z| + count * |f| + |p|: a subtraction that cancels can lose many ulps of its result, not of its inputs."""
    assert np.array_equal(np.isfinite(got), np.isfinite(want))
    counts = np.bincount(np.asarray(out, dtype=np.int64), minlength=z.size).astype(np.float64)
    scale = np.abs(z.astype(np.float64)) + counts * abs(freq) + (counts > 0) * abs(present)
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return float((diff / np.maximum(scale, 1e-30) / 2.0 ** -24).max())


@pytest.mark.parametrize("repeat,freq,present", [(1.3, 0.0, 0.0), (1.0, 0.4, 0.0), (1.0, 0.0, 0.7),
                                                 (0.8, 0.0, 0.0), (1.0, -0.2, 0.0)])
def test_each_penalty_alone_edits_the_logits_to_the_bit(repeat, freq, present):
    """On an output history (no prompt) llama.cpp's penalties (window = the whole output) are ours."""
    for seed in SEEDS:
        z, out = llm_row(seed), history(seed, 200)
        got = lc.apply(lc.penalties(len(out), repeat, freq, present), z, out).logits_by_id(V)
        want = defs.reference_processed(z, params(repetition_penalty=repeat, frequency_penalty=freq,
                                                  presence_penalty=present), output=out)
        np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")


def test_frequency_and_presence_together_round_once_in_llama_cpp():
    """Documented difference: llama.cpp subtracts count * f + [count > 0] * p in one float32 operation,
    tokensampler subtracts the two terms in turn (step 5): they differ by a rounding or two of the operands
    (which, when the subtraction cancels, is several ulps of the result)."""
    worst = 0.0
    for seed in SEEDS:
        z, out = llm_row(seed), history(seed, 200)
        got = lc.apply(lc.penalties(len(out), 1.1, 0.3, 0.5), z, out).logits_by_id(V)
        want = defs.reference_processed(z, params(repetition_penalty=1.1, frequency_penalty=0.3,
                                                  presence_penalty=0.5), output=out)
        worst = max(worst, rounding_units(got, want, z, out, 0.3, 0.5))
    assert 0 < worst <= 3


def test_penalties_scopes_llama_cpp_has_one_window_tokensampler_prompt_and_output():
    """Documented difference: llama.cpp applies all three penalties to its last `penalty_last_n` accepted
    tokens (the prompt too, if it was accepted); tokensampler applies repetition to prompt + output and
    frequency / presence to the output only."""
    for seed in SEEDS[:3]:
        z, prompt, out = llm_row(seed), history(seed, 150), history(seed + 50, 100)
        seen = prompt + out
        # repetition alone: the same, with the prompt accepted into llama.cpp's window
        got = lc.apply(lc.penalties(len(seen), 1.3), z, seen).logits_by_id(V)
        np.testing.assert_array_equal(got, defs.reference_processed(z, params(repetition_penalty=1.3), prompt, out))
        # frequency: llama.cpp counts the prompt's tokens as if they were output
        got = lc.apply(lc.penalties(len(seen), 1.0, 0.4), z, seen).logits_by_id(V)
        np.testing.assert_array_equal(got, defs.reference_processed(z, params(frequency_penalty=0.4), (), seen))
        assert not np.array_equal(got, defs.reference_processed(z, params(frequency_penalty=0.4), prompt, out))
        # and ours, prompt given, is llama.cpp's with only the output accepted
        got = lc.apply(lc.penalties(len(out), 1.0, 0.4), z, out).logits_by_id(V)
        np.testing.assert_array_equal(got, defs.reference_processed(z, params(frequency_penalty=0.4), prompt, out))
        # a window shorter than the history: only its last n tokens count
        got = lc.apply(lc.penalties(64, 1.0, 0.4, 0.2), z, out).logits_by_id(V)
        want = defs.reference_processed(z, params(frequency_penalty=0.4, presence_penalty=0.2), (), out[-64:])
        assert rounding_units(got, want, z, out[-64:], 0.4, 0.2) <= 3


# --- logit bias ---------------------------------------------------------------------------------------

def test_logit_bias_adds_the_same_and_llama_cpp_does_not_clamp():
    z = llm_row(2)
    bias = {3: 5.0, 17: -2.5, 400: 100.0, 4095: -100.0}
    got = lc.apply(lc.logit_bias(bias), z).logits_by_id(V)
    np.testing.assert_array_equal(got, defs.reference_processed(z, params(logit_bias=bias)))
    # documented difference: tokensampler clamps each bias to [-100, 100], llama.cpp adds it as given
    got = lc.apply(lc.logit_bias({5: 250.0}), z).logits_by_id(V)
    ours = defs.reference_processed(z, params(logit_bias={5: 250.0}))
    assert got[5] == np.float32(z[5] + np.float32(250.0)) and ours[5] == np.float32(z[5] + np.float32(100.0))


# --- samplers tokensampler does not define yet: against the definitions --------------------

def reference_or_definition(z: np.ndarray, definition: np.ndarray, **kw) -> set[int]:
    """reference.py's kept set for the full-row sampler in `kw` (steps 10.1-10.5), checked equal to the
    issue's definition transcribed in sampler_definitions.py (`definition`, a keep mask)."""
    want = defs.reference_kept(z, params(**kw))
    assert want == set(np.flatnonzero(definition).tolist()), kw
    return want


@pytest.mark.parametrize("n", [0.5, 1.0, 2.0, 3.0])
def test_top_n_sigma(n):
    for name, z in rows():
        got = lc.apply(lc.top_n_sigma(n), z)
        assert got.ids.size == V, "top-n-sigma sets logits to -inf, it does not shrink the array"
        assert got.kept() == reference_or_definition(z, defs.top_n_sigma_keep(z, n), top_n_sigma=n), (name, n)
        assert 1 <= len(got.kept()) < np.isfinite(z).sum()


TYPICAL_SWAPS = []  # (row, p, ids that differ, their score's distance to the border score)


def test_top_n_sigma_at_an_exact_border():
    """Logits +-1 (mean 0, population std exactly 1) and removed ids (not counted): with n = 2 the -1 ids
    sit exactly at max - n sigma and stay (llama.cpp removes logit < max - n std; the definition keeps >=)."""
    z = np.full(64, -np.inf, dtype=np.float32)
    z[:8] = [1, -1, 1, -1, 1, -1, 1, -1]
    assert lc.apply(lc.top_n_sigma(2.0), z).kept() == set(range(8))
    assert reference_or_definition(z, defs.top_n_sigma_keep(z, 2.0), top_n_sigma=2.0) == set(range(8))
    assert lc.apply(lc.top_n_sigma(1.5), z).kept() == {0, 2, 4, 6}
    assert reference_or_definition(z, defs.top_n_sigma_keep(z, 1.5), top_n_sigma=1.5) == {0, 2, 4, 6}
    # the population std, not the sample std: n puts id 8 between max - n std and max - n std_sample
    z[8] = -0.5
    finite = z[z > -np.inf].astype(np.float64)
    n = 1.5 / ((finite.std() + finite.std(ddof=1)) / 2)
    assert lc.apply(lc.top_n_sigma(n), z).kept() == {0, 2, 4, 6}
    assert reference_or_definition(z, defs.top_n_sigma_keep(z, n), top_n_sigma=n) == {0, 2, 4, 6}


@pytest.mark.parametrize("p", [0.2, 0.5, 0.9, 0.95])
def test_typical_p(p):
    """llama.cpp stops at mass > p (strictly) where the definition says >= p: equal away from exact
    borders. Its scores |-log q - H| are float32: two ids whose scores are within that rounding of the
    border score may trade places (seen once, on a flat row)."""
    for name, z in rows():
        if name.startswith("masked"):
            continue  # -inf ids: test_typical_p_with_removed_ids_in_the_array
        got = lc.apply(lc.typical(p), z).kept()
        want = reference_or_definition(z, defs.typical_keep(z, p), typical_p=p)
        if got != want:
            q = defs.softmax64(z)
            score = np.abs(-np.log(q) - -(q * np.log(q)).sum())
            border = max(score[list(want)])
            distance = max(abs(score[i] - border) for i in got ^ want)
            assert len(got) == len(want) and len(got ^ want) == 2 and distance < 1e-4, (name, p, got ^ want, distance)
            TYPICAL_SWAPS.append((name, p, sorted(got ^ want), distance))
    assert len(TYPICAL_SWAPS) <= 2, TYPICAL_SWAPS


def test_typical_p_with_removed_ids_in_the_array():
    """Documented llama.cpp behaviour: typical's entropy sums -p logf(p), which is NaN (0 * inf) for an
    entry at -inf, so with removed ids still in the array (after top-n-sigma, a -inf bias, a grammar) its
    order is undefined and its kept set is not the definition's. With only the finite ids in the array
    it is the definition's."""
    z = masked_row(0)
    finite = np.flatnonzero(z > -np.inf)
    want = reference_or_definition(z, defs.typical_keep(z, 0.9), typical_p=0.9)
    assert lc.apply(lc.typical(0.9), z).kept() != want
    compact = lc.apply(lc.typical(0.9), z[finite]).kept()
    assert {int(finite[i]) for i in compact} == want


@pytest.mark.parametrize("t,delta,exponent", [(1.0, 0.5, 1.0), (0.8, 0.3, 2.0), (1.2, 1.5, 0.5)])
def test_dynamic_temperature(t, delta, exponent):
    for name, z in rows()[:9]:  # rows without -inf: llama.cpp's H_max counts every candidate in the array
        got = lc.apply(lc.temp_ext(t, delta, exponent), z)
        _, want = defs.dynamic_temperature(z, t, delta, exponent)
        ours = defs.reference_processed(z, params(temperature=t, dynatemp_range=delta, dynatemp_exponent=exponent))
        np.testing.assert_allclose(ours, want, rtol=1e-6, err_msg=name)  # reference.py's step 7 is the definition
        np.testing.assert_allclose(got.logits_by_id(V), ours, rtol=2e-5, err_msg=name)  # llama.cpp's float32 H


def test_dynamic_temperature_counts_removed_ids_in_h_max():
    """Documented difference: llama.cpp's H_max is log(array size), -inf ids included (they are still
    candidates there); the definition's is log(number of finite ids). Equal when nothing is removed."""
    z = masked_row(0)
    finite = int(np.isfinite(z).sum())
    got = lc.apply(lc.temp_ext(1.0, 0.5, 1.0), z).logits_by_id(V)
    q = defs.softmax64(z)
    entropy = -(q[q > 0] * np.log(q[q > 0])).sum()
    as_llama = 0.5 + 1.0 * entropy / np.log(V)
    top = int(np.argmax(z))
    assert math.isclose(float(z[top] / got[top]), as_llama, rel_tol=1e-5)
    assert not math.isclose(as_llama, 0.5 + entropy / np.log(finite), rel_tol=1e-3)
    ours = defs.reference_processed(z, params(temperature=1.0, dynatemp_range=0.5))
    assert math.isclose(float(z[top] / ours[top]), 0.5 + entropy / np.log(finite), rel_tol=1e-6)


@pytest.mark.parametrize("threshold", [0.05, 0.1, 0.2])
def test_xtc_with_probability_one(threshold):
    removed = 0
    for name, z in rows():
        got = lc.apply(lc.xtc(1.0, threshold), z)  # probability 1: both coins apply (u < 1, chance <= 1)
        want = reference_or_definition(z, defs.xtc_keep(z, threshold), xtc_probability=1.0, xtc_threshold=threshold)
        assert got.kept() == want, (name, threshold)
        removed += len(got.kept()) < int(np.isfinite(z).sum())
    assert removed > 0, "some rows must have two ids above the threshold"


def test_xtc_off_above_threshold_one_half_and_with_probability_zero():
    z = llm_row(3)
    assert lc.apply(lc.xtc(1.0, 0.6), z).kept() == set(range(V))  # llama.cpp: threshold > 0.5 disables XTC
    assert lc.apply(lc.xtc(0.0, 0.1), z).kept() == set(range(V))


def test_mirostat_v2_over_steps():
    """mu starts at 2 tau; each step keeps the ids with surprise <= mu (at least the top) and moves mu by
    eta times the chosen id's surprise (on the renormalised probabilities) minus tau."""
    tau, eta = 3.0, 0.5
    mu = 2 * tau
    sizes = set()
    with lc.Session(lc.mirostat_v2(seed=7, tau=tau, eta=eta), V) as session:
        for step in range(8):
            z = llm_row(step, flat=step % 2 == 1)
            got = session.apply(z)
            want = defs.mirostat_v2_keep(z, mu)
            assert got.kept() == set(np.flatnonzero(want).tolist()), step
            assert got.selected in got.kept()
            mu = defs.mirostat_v2_mu(z, mu, tau, eta, got.selected)
            sizes.add(len(got.kept()))
    assert len(sizes) > 2 and max(sizes) < V, sizes


def test_dry_penalises_what_extends_a_repetition():
    """DRY against the transcription, with SmolLM2's vocabulary (its default breakers \\n : \" * are
    single tokens there); histories repeat phrases, some cross a breaker."""
    vocab = len(lc.token_texts())
    breakers = lc.breaker_ids()
    assert 0 < len(breakers) < vocab
    rng = np.random.default_rng(5)
    plain = np.array(sorted(set(range(vocab)) - breakers))
    some_breaker = sorted(breakers)[:50]
    cases = 0
    for seed in range(8):
        phrase = rng.choice(plain, 6).tolist()
        filler = rng.choice(plain, 5).tolist()
        hist = filler + phrase + rng.choice(plain, 3).tolist() + phrase + filler[:2] + phrase[:4]
        if seed % 3 == 1:  # a breaker inside the last repetition limits how far back it reaches
            hist = hist[:-2] + [int(rng.choice(some_breaker))] + hist[-2:]
        if seed % 3 == 2:  # a breaker would extend the repetition: never penalised
            hist = hist + [int(rng.choice(some_breaker))] + hist[-6:]
        z = llm_row(seed, vocab)
        for multiplier, base, allowed, last_n in ((0.8, 1.75, 2, 64), (1.0, 2.0, 1, 16), (0.5, 1.1, 3, 1000)):
            got = lc.apply(lc.dry(multiplier, base, allowed, last_n), z, hist).logits_by_id(vocab)
            want = defs.dry_penalised(z, hist, multiplier, base, allowed, last_n, breakers)
            np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}, {multiplier, base, allowed, last_n}")
            cases += int((got != z).sum())
    assert cases > 0, "some histories must be penalised"


# --- the bench's arm -------------------------------------------------------------------------------------

def test_the_bench_arm_draws_from_its_chains_kept_set_and_copies_the_row_each_step():
    """`tokensampler bench --against llama.cpp`'s arm: llama.cpp's default chain in its order, each step
    a fresh copy of the row (the array it left is overwritten), the token from the kept set."""
    import torch

    from tokensampler.tools.bench_llama_cpp import ChainArm, chain_samplers

    z = llm_row(4)
    arm = ChainArm({"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}, torch.from_numpy(z))
    lib = lc.bindings()
    samplers = chain_samplers({"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}, V)
    assert [bytes(lib.llama_sampler_name(s)).decode() for s in samplers] == ["top-k", "top-p", "min-p", "temp-ext",
                                                                             "dist"]
    for sampler in samplers:
        lib.llama_sampler_free(sampler)
    kept = lc.apply(lc.chain(lc.top_k(40), lc.top_p(0.95), lc.min_p(0.05), lc.temp_ext(0.8, 0.0, 1.0)), z).kept()
    tokens = [arm.step() for _ in range(50)]
    assert set(tokens) <= kept and len(set(tokens)) > 1
    assert arm.array.struct.size == len(kept)  # what the chain left; the next step's copy restores every id
    arm.array.fill(arm.logits)
    assert arm.array.struct.size == V and arm.array.view()["id"].tolist() == list(range(V))
    with pytest.raises(ValueError, match="penalties"):
        chain_samplers({"temperature": 1.0, "presence_penalty": 0.5}, V)
