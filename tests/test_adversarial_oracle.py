"""The adversarial campaign's batched oracle (tests/support/adversarial/oracle.py) against reference.py:
a few hundred of the campaign's random cases (a fixed seed), a few steps each, and every row of the
oracle's output (token, validity, logprobs) equal to `reference_sample_row`'s for that row's request,
its history, noise coordinates and Mirostat mu tracked here apart from the oracle (the rows of a
full-row sampler are reference.py's in the oracle too: what is checked there is their state, mu above all).
"""

from __future__ import annotations

import random
from collections import Counter

import torch

from tests.support.adversarial import menus
from tests.support.adversarial.cases import PATHS, Case, make_case
from tests.support.adversarial.compare import differing, row_text
from tests.support.adversarial.oracle import Oracle
from tokensampler import SamplingParams, TokenSamplerError
from tokensampler.reference import ReferenceRequest, bitmask_allowed_ids, reference_step

SEED = 20261202
CASES = 300
MOST_ROWS = 12  # the rows of a case that are kept (the torch path's cases hold up to 16384)
MOST_STEPS = 3
FULL_ROW_CASES = 150  # the cases of the full-row test (the full-row samplers drawn in most rows)


def _requests(case: Case, r: random.Random) -> dict[int, ReferenceRequest]:
    """The case's valid requests, as reference.py sees them (an unseeded one gets a drawn seed); their
    histories and positions are kept here, apart from the oracle's."""
    requests = {}
    for i, spec in enumerate(case.rows):
        if spec.bad:
            continue
        try:
            params = SamplingParams(**spec.kwargs)
        except TokenSamplerError:
            continue  # a float32 edge the menus do not mark
        seed = params.seed if params.seed is not None else r.randrange(2**63)
        position = spec.position if spec.position is not None else len(spec.prompt) + len(spec.outputs)
        requests[i] = ReferenceRequest(params, seed, position, list(spec.prompt), list(spec.outputs), spec.stream,
                                       case.eos)
    return requests


def _reference(case: Case, requests: list[ReferenceRequest], logits: torch.Tensor, bitmask: torch.Tensor | None):
    """reference_step_row for each row, as one output, and each row's Mirostat mu after it (reference_step)."""
    allowed = None if bitmask is None else bitmask_allowed_ids(bitmask, case.vocab)
    return reference_step(logits, requests, vocab_size=case.vocab, logprobs_mode=case.mode, allowed=allowed)


FULL_ROW = {"dynatemp_range": "dynatemp", "top_n_sigma": "top_n_sigma", "typical_p": "typical_p",
            "epsilon_cutoff": "epsilon", "eta_cutoff": "eta", "xtc_probability": "xtc", "mirostat_tau": "mirostat"}
FEATURES = ("greedy", "top_k", "top_p", "min_p", "penalties", "repetition", "logit_bias", "allowed", "bad_words",
            "min_tokens", "logprobs", "bitmask", "history", "invalid", *FULL_ROW.values())


def _features(request: ReferenceRequest, bitmask: bool, valid: bool) -> list[str]:
    """What of the definition a compared row exercises."""
    p = request.params
    on = {"greedy": p.temperature == 0.0, "top_k": p.top_k > 0, "top_p": p.top_p < 1.0, "min_p": p.min_p > 0.0,
          "penalties": bool(p.presence_penalty or p.frequency_penalty), "repetition": p.repetition_penalty != 1.0,
          "logit_bias": bool(p.logit_bias), "allowed": p.allowed_token_ids is not None,
          "bad_words": bool(p.bad_words_token_ids), "min_tokens": p.min_tokens > len(request.output_token_ids),
          "logprobs": p.logprobs is not None, "bitmask": bitmask, "history": bool(request.output_token_ids),
          "invalid": not valid}
    on.update({FULL_ROW[name]: True for name, _ in p.full_row_fields})
    # a Mirostat row sampled with the mu its earlier tokens left (not 2 tau)
    on["mirostat_mu_moved"] = request.mirostat_mu is not None and request.mirostat_mu != 2.0 * p.mirostat_tau
    return [name for name, yes in on.items() if yes]


def _run(case: Case, r: random.Random, seen: Counter, most_steps: int) -> tuple[int, int, list[str]]:
    """The case's steps through the oracle and reference.py: (rows compared, rows the oracle computed
    batched only, differences); `seen` counts the features of the rows compared."""
    rows = _requests(case, r)
    if not rows:
        return 0, 0, []
    oracle = Oracle(case.vocab, case.mode, case.eos)
    for i, q in rows.items():
        oracle.admit(i, q.params, q.seed, q.position, q.stream, q.prompt_token_ids, q.output_token_ids)
    oracle.freeze(len(case.rows))
    compared = batched = 0
    bad: list[str] = []
    for t in range(min(case.steps, most_steps)):
        step = case.step(t)
        keep = [b for b, i in enumerate(step.rows) if i in rows]
        if not keep:
            continue
        idx = [step.rows[b] for b in keep]
        logits = step.logits[keep]
        bitmask = None if step.bitmask is None else step.bitmask[keep]
        record = None if step.record is None else [step.record[b] for b in keep]
        got, _, checked, disagree = oracle.step(logits, idx, bitmask, set())
        want, mus = _reference(case, [rows[i] for i in idx], logits, bitmask)
        differs, what = differing(got, want)
        for b in differs.nonzero().squeeze(1).tolist():
            bad.append(f"{case.path}:{case.index} step {t} row {idx[b]} ({what}): oracle {row_text(got, b)}; "
                       f"reference {row_text(want, b)}; params {rows[idx[b]].params}")
        bad += [f"{case.path}:{case.index} step {t} row {idx[b]}: the oracle's own check disagrees" for b in disagree]
        compared += len(idx)
        batched += len(idx) - len(checked)
        for b, i in enumerate(idx):
            seen.update(_features(rows[i], bitmask is not None, bool(want.valid[b])))
        oracle.record(idx, want.token_ids, record)
        bad += _recorded(case, t, rows, idx, want.token_ids.tolist(), mus, record, oracle)
    return compared, batched, bad


def _recorded(case: Case, t: int, rows: dict[int, ReferenceRequest], idx: list[int], tokens: list[int],
              mus: list, record: list[bool] | None, oracle: Oracle) -> list[str]:
    """Step 13 on the requests kept here (history, position, Mirostat's mu); the oracle's mu must be
    the same float (2 tau before the first update)."""
    bad = []
    for b, i in enumerate(idx):
        if record is None or record[b]:
            rows[i].output_token_ids.append(tokens[b])
            rows[i].position += 1
            rows[i].mirostat_mu = mus[b]
        if oracle.rows[i].mu != rows[i].mu:
            bad.append(f"{case.path}:{case.index} step {t} row {i}: the oracle's mu {oracle.rows[i].mu!r} != "
                       f"{rows[i].mu!r}; params {rows[i].params}")
    return bad


def _cases(seed: int, cases: int, most_steps: int) -> tuple[int, int, list[str], Counter]:
    """`cases` of the campaign of `seed` (the paths in turn) through `_run`: (rows compared, rows
    the oracle computed batched only, differences, the features of the rows compared)."""
    r = random.Random(seed)
    compared = batched = 0
    bad: list[str] = []
    seen: Counter = Counter()
    for n in range(cases):
        path = PATHS[n % len(PATHS)]
        case = make_case(seed, path, n // len(PATHS))
        case.rows = case.rows[:MOST_ROWS]
        c, b, differences = _run(case, r, seen, most_steps)
        compared, batched, bad = compared + c, batched + b, bad + differences
    return compared, batched, bad, seen


def test_batched_oracle_equals_reference_row_by_row():
    compared, batched, bad, seen = _cases(SEED, CASES, MOST_STEPS)
    assert not bad, f"{len(bad)} rows differ:\n" + "\n".join(bad[:10])
    assert compared > 2000, compared
    # most rows come from the batched transcription itself, not from reference.py through the oracle
    assert batched > 0.8 * compared, (batched, compared)
    # and every part of the definition is exercised by dozens of them (the full-row samplers at the
    # campaign's own rates: a few rows in a hundred)
    assert all(seen[name] >= 20 for name in FEATURES), seen


def test_full_row_rows_and_mirostat_mu_follow_the_reference(monkeypatch):
    """The full-row samplers in many rows (the menus' rates raised), more steps: the oracle's rows and
    each Mirostat row's mu (recorded or not, step after step) stay reference.py's."""
    monkeypatch.setattr(menus, "FULL_ROW_RATE", 0.6)
    monkeypatch.setattr(menus, "FULL_ROW_EDGE_RATE", 0.6)
    monkeypatch.setattr(menus, "FULL_ROW_ROWS", 64.0)
    compared, _, bad, seen = _cases(SEED + 1, FULL_ROW_CASES, 8)
    assert not bad, f"{len(bad)} rows differ:\n" + "\n".join(bad[:10])
    assert all(seen[name] >= 100 for name in FULL_ROW.values()), seen
    assert seen["mirostat_mu_moved"] >= 50, seen
