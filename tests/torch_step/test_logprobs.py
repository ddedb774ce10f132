"""backends/torch_step/logprobs.py: the top-N ids, ranks and log_softmax values of the CPU fast path.

Ids, ranks and the top-N order exactly as reference.py (a stable descending sort of the scores),
ties at the N-th value and -inf rows included; values within 1e-6 + 1e-6 |value| of
`torch.log_softmax` (the normaliser's float32 rounding, docs/semantics.md). The compiled normaliser
and the eager path are both checked, and end to end through `Sampler` in all four modes with
vocabularies wide enough for the chunked top-N.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.runs import MODES, assert_close_logprobs, assert_same_output, run_reference, run_sampler
from tokensampler import SamplingParams
from tokensampler.backends.torch_step import logprobs
from tokensampler.core.order import value_id_keys

NEG_INF = float("-inf")


def stable_top(scores: torch.Tensor, n: int) -> torch.Tensor:
    return torch.sort(scores, descending=True, stable=True).indices[:n]


def tied_scores(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Few distinct values (many ties, +0.0 and -0.0 among them), some -inf, one all -inf row."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(-4, 3, (rows, vocab), generator=gen).to(torch.float32)
    scores[torch.rand(rows, vocab, generator=gen) < 0.3] = NEG_INF
    scores[scores == 0] = torch.where(torch.rand(int((scores == 0).sum()), generator=gen) < 0.5, -0.0, 0.0)
    scores[0] = NEG_INF
    if rows > 2:
        scores[2, :] = NEG_INF
        scores[2, vocab // 2] = 1.0  # one finite id: the rest of the top-N is -inf ties by id
    return scores


@pytest.mark.parametrize("vocab", [1, 7, 64, 100, 1500, 4099, 20000])
def test_top_n_ids_is_the_stable_sort_prefix(vocab):
    for seed in range(3):
        scores = tied_scores(5, vocab, seed)
        width = min(vocab, 9)
        num = torch.tensor([width, 0, min(vocab, 3), 1, width], dtype=torch.int64)
        got = logprobs.top_n_ids(scores, num, width)
        for r in range(scores.shape[0]):
            n = int(num[r])
            assert torch.equal(got[r, :n], stable_top(scores[r], n)), (vocab, seed, r)
            assert bool((got[r, n:] == -1).all())


def test_top_n_ids_chunked_on_peaked_rows_with_a_tie_at_the_nth_value():
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(4, 30000, generator=gen) * 3
    scores[:, [17, 9000, 29999, 12]] = 50.0  # four equal maxima in different chunks
    scores[1, 5000:5100] = 40.0  # ties at the N-th value in one chunk and the next
    scores[3, 29990:] = 60.0  # the short last chunk holds the top (30000 = 468 * 64 + 48)
    num = torch.tensor([20, 20, 4, 13])
    got = logprobs.top_n_ids(scores, num, 20)
    for r in range(4):
        assert torch.equal(got[r, :int(num[r])], stable_top(scores[r], int(num[r])))


def test_order_keys_sort_like_a_stable_descending_sort():
    values = torch.tensor([[-0.0, 0.0, 1.5, NEG_INF, -1e-30, 1e-30, -2.0, 1.5, NEG_INF, -0.0, 3e38, -3e38]])
    ids = torch.arange(values.shape[1])
    order = torch.argsort(value_id_keys(values, ids), dim=-1, descending=True)
    assert torch.equal(order[0], stable_top(values[0], values.shape[1]))


def check_values_and_ranks(scores: torch.Tensor, tokens: torch.Tensor, width: int, compiled: bool):
    num = torch.full((scores.shape[0],), width, dtype=torch.int64)
    raw = scores.clone()
    raw[:, 1::5][raw[:, 1::5] == NEG_INF] = float("nan")  # raw rows: NaN = removed, cleaned when gathered
    rows = logprobs.ScoreRows(raw, clean=False)
    for got in (logprobs.gather_logprobs(scores, tokens, num, width, normalise=True, compiled=compiled),
                logprobs.gather_logprobs(rows, tokens, num, width, True, logprobs.row_stats(scores, True, compiled),
                                         compiled=compiled)):
        check_against_reference(scores, tokens, width, got)


def check_against_reference(scores, tokens, width, got):
    want_values = torch.stack([torch.log_softmax(row, -1) if bool((row > NEG_INF).any()) else row.clone()
                               for row in scores])
    for r in range(scores.shape[0]):
        key = scores[r]
        assert int(got.token_ranks[r]) == int((key >= key[tokens[r]]).sum())
        ids = stable_top(key, width)
        assert torch.equal(got.top_token_ids[r], ids)
        assert_close_logprobs(want_values[r, ids], got.top_logprobs[r], "top")
    assert_close_logprobs(want_values.gather(-1, tokens[:, None]).squeeze(-1), got.token_logprobs, "token")


@pytest.mark.parametrize("compiled", [False, True])
def test_values_within_the_bound_of_torch_log_softmax(compiled):
    """Peaked LLM-like rows (where a float64 normaliser would miss ATen's float32 one by ~1e-5),
    flat rows, -inf ids, an all -inf row, widths that are not a multiple of the vector lanes."""
    from tokensampler.tools.workloads import make_logits
    for vocab, flat in ((151936, False), (32003, True), (1003, False), (9, False)):
        scores = make_logits(4, vocab, flat=flat, seed=vocab)
        scores[1, ::3] = NEG_INF
        scores[3] = NEG_INF
        tokens = torch.tensor([0, 1, vocab - 1, vocab // 2])
        tokens[0] = int(scores[0].argmax())
        check_values_and_ranks(scores, tokens, min(vocab, 20), compiled)


def test_the_compiled_normaliser_follows_atens_order():
    """On a peaked row a plain (cascade or float64) sum misses torch.log_softmax's normaliser by
    more than the bound; the lane-ordered one stays within a few ulps."""
    lanes = logprobs.aten_lanes()
    if not lanes:
        pytest.skip("ATen's vector width is not known on this CPU: the exact eager path is used")
    from tokensampler.tools.workloads import make_logits
    scores = make_logits(3, 151936, seed=0)
    row_max = scores.amax(-1)
    log_sum = logprobs.normaliser(scores, row_max, lanes)
    want = -torch.log_softmax(scores, -1).gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
    assert bool(((log_sum - want).abs() <= 4 * torch.finfo(torch.float32).eps * want.abs()).all())
    exact = torch.exp((scores - row_max[:, None]).double()).sum(-1).log()
    assert bool(((exact - want.double()).abs() > 1e-6).any())  # the reason for the lane order


@pytest.mark.parametrize("variant", ["plain", "nan", "posinf", "bf16", "padded"])
@pytest.mark.parametrize("mode", MODES)
def test_sampler_logprobs_wide_vocab_all_modes(mode, variant):
    """End to end on a vocabulary wide enough for the chunked top-N: ties at the N-th value, -inf
    ids and rows, rows asking different N (0 included) or nothing, greedy and sampled rows (compiled)."""
    gen = torch.Generator().manual_seed(11)
    vocab = 6000
    logits = torch.randn(6, vocab, generator=gen) * 2
    logits[0, :300] = torch.randint(0, 3, (300,), generator=gen).to(torch.float32) + 6  # ties on top
    logits[1, ::2] = NEG_INF
    logits[2] = NEG_INF  # no id left: invalid, raw greedy id
    logits[3] = torch.round(logits[3])  # ties everywhere
    vocab_size = None
    if variant == "nan":
        logits[0, 7::13] = float("nan")
        logits[5, 0] = float("nan")
    elif variant == "posinf":
        logits[3, [5, 900]] = float("inf")
    elif variant == "bf16":
        logits = logits.to(torch.bfloat16)
    elif variant == "padded":
        vocab_size = vocab - 37
        logits[:, vocab_size:] = 100.0
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=20),
              SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=1.0, seed=2, logprobs=3),
              SamplingParams(temperature=0.7, top_k=4, seed=3, logprobs=0),
              SamplingParams(temperature=1.0, min_p=0.2, seed=4),
              SamplingParams(temperature=1.2, top_p=0.5, seed=5, logprobs=7)]
    want = run_reference(logits, params, logprobs_mode=mode, vocab_size=vocab_size)
    got = run_sampler(logits, params, logprobs_mode=mode, vocab_size=vocab_size, compile=True)
    assert_same_output(want, got)
    assert got.logprobs.token_ranks[4] == 0 and got.logprobs.token_logprobs[4] == 0  # did not ask
