"""Shared by tests/split/test_distributed.py: random split-vocabulary cases, the two ways to run them
(split over a group, unsplit `Sampler`), the comparison, and an in-process thread `Exchange`.

Kept out of the test module so spawned gloo workers import it without pytest.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tokensampler import Sampler, SamplingParams
from tokensampler.parallel import Exchange, ThreadExchange, ThreadHub
from tokensampler.reference import ReferenceRequest, bitmask_allowed_ids, reference_sample

MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
EOS = (1,)
MAX_SLOTS = 10
# world -> (V, Vp) configurations: V never a multiple of 32; padding within one rank, padding
# spanning two ranks (150 of 256 over 4: ranks 2 and 3; 100 of 192 over 3: ranks 1 and 2),
# a rank holding only padding, and slices whose width is not a multiple of 32.
CONFIGS = {
    1: [(203, 203), (97, 128)],
    2: [(203, 208), (61, 64)],
    3: [(100, 192), (203, 204)],
    4: [(150, 256), (203, 204)],
}
# the full-row samplers (steps 7, 10.1-10.6), each alone, and all of them with every other field
FULL_ROW_KINDS = ("dynatemp", "top_n_sigma", "typical_p", "epsilon", "eta", "xtc", "mirostat", "full_mixed")
KINDS = ("greedy", "temperature", "top_k", "top_p", "min_p", "filters", "penalties", "bias", "allowed",
         "min_tokens", "unseeded", "cold", "top_k_large", "bad_words") + FULL_ROW_KINDS


# ------------------------------------------------------------------ thread exchange


def run_ranks(hub: ThreadHub, fn: Callable[[int], Any]) -> list[Any]:
    """fn(rank) on one thread per rank of `hub`; returns each rank's result, re-raises the first error
    (after resetting the hub's barrier, so that its group can go on)."""
    results: list[Any] = [None] * hub.world
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors.append(exc)
            hub.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(hub.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        hub.barrier.reset()
        raise errors[0]
    return results


def run_threads(world: int, fn: Callable[[Exchange], Any]) -> list[Any]:
    """fn(exchange) on `world` threads; returns each rank's result, re-raises the first error."""
    hub = ThreadHub(world)
    return run_ranks(hub, lambda rank: fn(ThreadExchange(hub, rank)))


# ------------------------------------------------------------------ cases
@dataclass
class Request:
    slot: int
    params: SamplingParams
    prompt: list[int]
    outputs: list[int]
    stream: int = 0


@dataclass
class Case:
    vocab: int
    padded: int
    mode: str
    requests: list[Request]
    steps: list[tuple[list[int], torch.Tensor]]  # (slots, logits [len(slots), Vp]) per step
    masks: list[torch.Tensor | None] = field(default_factory=list)  # per step: a token bitmask or None
    replace_after: dict[int, Request] = field(default_factory=dict)  # step -> request re-admitted


def random_params(r: random.Random, vocab: int, kind: str) -> SamplingParams:
    seed = r.randrange(2**64) if r.random() < 0.5 else r.randrange(-(2**63), 2**63)
    logprobs = r.choice([None, None, 0, 1, 3, 20, -1])
    ids = r.sample(range(vocab), 6)
    base: dict[str, Any] = {"seed": seed, "logprobs": logprobs, "temperature": r.choice([0.5, 1.0, 1.7])}
    extra: dict[str, Any] = {
        "greedy": {"temperature": 0.0, "top_k": r.choice([0, 3]), "min_p": 0.2},
        "temperature": {},
        "top_k": {"top_k": r.choice([1, 2, 5, 17])},
        "top_k_large": {"top_k": r.choice([vocab - 1, vocab, vocab + 5])},
        "top_p": {"top_p": r.choice([0.05, 0.3, 0.7, 0.95])},
        "min_p": {"min_p": r.choice([0.01, 0.1, 0.5])},
        "filters": {"top_k": r.choice([4, 30]), "top_p": r.uniform(0.2, 0.99), "min_p": r.choice([0.0, 0.05])},
        "penalties": {"repetition_penalty": r.choice([0.8, 1.3, 2.0]), "frequency_penalty": r.uniform(-2, 2),
                      "presence_penalty": r.uniform(-2, 2), "top_p": r.choice([1.0, 0.8])},
        "bias": {"logit_bias": {ids[0]: 5.0, ids[1]: -100.0, vocab - 1: r.uniform(-3, 3)}},
        "allowed": {"allowed_token_ids": (ids[2], ids[3], vocab - 1, *EOS), "top_k": r.choice([0, 2])},
        "min_tokens": {"min_tokens": r.choice([2, 5]), "stop_token_ids": (ids[4], vocab - 1)},
        "unseeded": {"seed": None, "top_p": 0.9},
        "cold": {"temperature": r.choice([1e-3, 0.05]), "top_p": 0.5},
        # one-token words always; longer ones on the output's last tokens (`make_case` adds those)
        "bad_words": {"bad_words_token_ids": [(ids[5],), (vocab - 1,)], "temperature": r.choice([0.0, 1.0])},
        **full_row_fields(r, vocab, ids),
    }[kind]
    return SamplingParams(**{**base, **extra})


def full_row_fields(r: random.Random, vocab: int, ids: list[int]) -> dict[str, dict[str, Any]]:
    """The fields of each of `FULL_ROW_KINDS`: one full-row sampler alone (sometimes with min-p,
    top-k or top-p before it), or every one of them with the other fields (penalties, DRY, bias,
    allowed ids, min_tokens, bad words; sometimes greedy, which ignores them)."""
    def before() -> dict[str, Any]:
        return r.choice([{}, {}, {"top_k": r.choice([3, 30])}, {"top_p": r.choice([0.5, 0.9])}, {"min_p": 0.05}])

    mirostat = {"mirostat_tau": r.choice([0.0, 0.5, 2.0, 5.0]), "mirostat_eta": r.choice([0.1, 1.0])}
    return {
        "dynatemp": {"dynatemp_range": r.choice([0.3, 1.0, 2.0]), "dynatemp_exponent": r.choice([0.0, 0.5, 1.0, 2.0]),
                     "temperature": r.choice([0.2, 1.0, 1.5]), **before()},
        "top_n_sigma": {"top_n_sigma": r.choice([0.0, 0.5, 1.0, 2.5]), **before()},
        "typical_p": {"typical_p": r.choice([0.2, 0.6, 0.95]), **before()},
        "epsilon": {"epsilon_cutoff": r.choice([0.001, 0.02, 0.2]), **before()},
        "eta": {"eta_cutoff": r.choice([0.001, 0.02, 0.2]), **before()},
        "xtc": {"xtc_probability": r.choice([0.5, 1.0]), "xtc_threshold": r.choice([0.01, 0.1, 0.3]), **before()},
        "mirostat": {**mirostat, **before()},
        "full_mixed": {
            "temperature": r.choice([0.0, 0.7, 1.0, 1.3]), "dynatemp_range": r.choice([0.0, 0.5]),
            "top_n_sigma": r.choice([None, 1.5]), "typical_p": r.choice([1.0, 0.8]),
            "epsilon_cutoff": r.choice([0.0, 0.01]), "eta_cutoff": r.choice([0.0, 0.01]),
            "xtc_probability": r.choice([0.0, 1.0]), "xtc_threshold": 0.05,
            **r.choice([{}, mirostat]), "top_k": r.choice([0, 20]), "top_p": r.choice([1.0, 0.95]),
            "min_p": r.choice([0.0, 0.02]), "repetition_penalty": r.choice([1.0, 1.3]),
            "frequency_penalty": r.uniform(-1, 1), "presence_penalty": r.uniform(-1, 1),
            "logit_bias": {ids[0]: 5.0, vocab - 1: r.uniform(-3, 3)},
            "allowed_token_ids": r.choice([None, (ids[2], ids[3], ids[4], vocab - 1, *EOS)]),
            "min_tokens": r.choice([0, 3]), "stop_token_ids": (ids[4],), "bad_words_token_ids": [(ids[5],)],
            "dry_multiplier": r.choice([0.0, 1.5]), "dry_allowed_length": 1},
    }


def random_logits(r: random.Random, gen: torch.Generator, rows: int, vocab: int, padded: int) -> torch.Tensor:
    """Random logits with ties, NaN, -inf, +inf, huge values and bad rows; padding holds large
    values that must be ignored."""
    scale = r.choice([1.0, 3.0, 8.0])
    z = torch.randn(rows, padded, generator=gen) * scale
    z[:, vocab:] = 50.0
    for b in range(rows):
        what = r.choice(["plain", "plain", "ties", "nan", "neginf", "posinf", "bad", "huge", "few"])
        if what == "ties":
            z[b, :vocab] = torch.round(z[b, :vocab])
        elif what == "nan":
            z[b, torch.randint(0, vocab, (vocab // 3,), generator=gen)] = float("nan")
        elif what == "neginf":
            z[b, torch.randint(0, vocab, (vocab // 2,), generator=gen)] = float("-inf")
        elif what == "posinf":
            z[b, torch.randint(0, vocab, (r.choice([1, 2]),), generator=gen)] = float("inf")
        elif what == "bad":
            z[b, :vocab] = r.choice([float("nan"), float("-inf")])
        elif what == "huge":
            z[b, : vocab // 2] = 3e38
        elif what == "few":
            keep = torch.randint(0, vocab, (2,), generator=gen)
            row = torch.full((vocab,), float("-inf"))
            row[keep] = z[b, keep]
            z[b, :vocab] = row
    return z


def make_case(seed: int, vocab: int, padded: int, mode: str, steps: int = 3, rows: int = 7,
              kinds: tuple[str, ...] = KINDS) -> Case:
    """A random case; row i's parameters are of kind `kinds[(i + seed) % len(kinds)]`."""
    r = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    slots = r.sample(range(MAX_SLOTS), rows)
    requests = []
    for i, slot in enumerate(slots):
        kind = kinds[(i + seed) % len(kinds)]
        prompt = [r.randrange(vocab) for _ in range(r.randrange(0, 8))] + [vocab - 1]
        outputs = [r.randrange(vocab) for _ in range(r.randrange(0, 4))]
        params = random_params(r, vocab, kind)
        if kind == "bad_words" and outputs:  # words whose prefix the output ends with (or soon may)
            words = params.bad_words_token_ids + ((outputs[-1], r.randrange(vocab)), (*outputs[-2:], 0),
                                                  (r.randrange(vocab), outputs[-1], vocab - 2))
            params = dataclasses.replace(params, bad_words_token_ids=words)
        requests.append(Request(slot, params, prompt, outputs, r.choice([0, 0, 1, 3])))
    dtype = r.choice([torch.float32, torch.float32, torch.float16, torch.bfloat16])
    plan = []
    for _ in range(steps):
        step_slots = r.sample(slots, r.randrange(max(1, rows - 2), rows + 1))
        plan.append((step_slots, random_logits(r, gen, len(step_slots), vocab, padded).to(dtype)))
    fresh = Request(slots[0], random_params(r, vocab, r.choice(kinds)), [2, vocab - 1], [], 0)
    masks = [random_bitmask(r, len(step_slots), vocab) if r.random() < 0.5 else None for step_slots, _ in plan]
    return Case(vocab, padded, mode, requests, plan, replace_after={1: fresh}, masks=masks)


def random_bitmask(r: random.Random, rows: int, vocab: int) -> torch.Tensor:
    """A token bitmask (int32, xgrammar's layout) per row: a few ids, most ids, every id or none;
    the bits of ids >= vocab are set (they must be ignored)."""
    words = -(-vocab // 32) + r.choice([0, 1])
    bits = torch.zeros(rows, 32 * words, dtype=torch.bool)
    bits[:, vocab:] = True
    for b in range(rows):
        kind = r.choice(["few", "most", "all", "none"])
        if kind == "few":
            bits[b, r.sample(range(vocab), 5)] = True
        elif kind == "most":
            bits[b, :vocab] = torch.rand(vocab, generator=torch.Generator().manual_seed(r.randrange(2**31))) < 0.7
        elif kind == "all":
            bits[b, :vocab] = True
    weights = torch.tensor([1 << j for j in range(31)] + [-(1 << 31)], dtype=torch.int64)
    return (bits.view(rows, words, 32).to(torch.int64) * weights).sum(-1).to(torch.int32)


# ------------------------------------------------------------------ runs
def _admit(sampler: Sampler, req: Request, seeds: dict[int, int] | None) -> int:
    params = req.params
    if seeds is not None and params.seed is None:
        params = dataclasses.replace(params, seed=seeds[req.slot])
    return sampler.add_request(req.slot, params, req.prompt, output_token_ids=req.outputs, stream=req.stream)


def run_case(case: Case, group: Any = None, seeds: list[dict[int, int]] | None = None):
    """Run the case split over `group` (each rank passes its slice) or unsplit (group None, with
    the seeds the split run reported). Returns (outputs per step, seeds per admission round, Mirostat's
    mu of every occupied slot after each step: {slot: mu or None})."""
    world = 1 if group is None else (group.world_size if isinstance(group, Exchange) else
                                     torch.distributed.get_world_size(group))
    rank = 0 if group is None else (group.rank if isinstance(group, Exchange) else
                                    torch.distributed.get_rank(group))
    width = case.padded // world if group is not None else case.padded
    sampler = Sampler(case.vocab, max_slots=MAX_SLOTS, padded_vocab_size=case.padded, logprobs_mode=case.mode,
                      eos_token_ids=EOS, group=group)
    used: list[dict[int, int]] = [{}]
    for req in case.requests:
        used[0][req.slot] = _admit(sampler, req, None if seeds is None else seeds[0])
    outputs, mus = [], []
    for t, (slots, logits) in enumerate(case.steps):
        if group is None:
            # Sampler.sample may use its logits as scratch during the call (penalised values are
            # written at the seen ids and restored before it returns); this unsplit run shares the
            # case with the ranks' threads, which read the same tensor at the same time
            logits = logits.clone()
        mask = case.masks[t] if case.masks else None  # every rank gets the whole mask
        outputs.append(sampler.sample(logits[:, rank * width:(rank + 1) * width], slots, token_bitmask=mask))
        occupied = sorted({req.slot for req in case.requests})
        mus.append(dict(zip(occupied, sampler.mus_of(occupied))))
        if t in case.replace_after:
            req = case.replace_after[t]
            sampler.remove_request(req.slot)
            used.append({req.slot: _admit(sampler, req, None if seeds is None else seeds[len(used)])})
    return outputs, used, mus


def reference_tokens(case: Case, seeds: dict[int, int], step: int = 0) -> torch.Tensor:
    """reference.py's tokens for the first step (before any history update)."""
    slots, logits = case.steps[step]
    by_slot = {req.slot: req for req in case.requests}
    requests = []
    for slot in slots:
        req = by_slot[slot]
        requests.append(ReferenceRequest(req.params, seeds[slot], len(req.prompt) + len(req.outputs),
                                         req.prompt, req.outputs, req.stream, EOS))
    mask = case.masks[step] if case.masks else None
    allowed = None if mask is None else bitmask_allowed_ids(mask, case.vocab)
    return reference_sample(logits, requests, vocab_size=case.vocab, logprobs_mode=case.mode,
                            allowed=allowed).token_ids


def _short(values: Any, limit: int = 300) -> str:
    text = str(values)
    return text if len(text) <= limit else text[:limit] + "..."


def compare(label: str, got, want, exact: bool = False) -> list[str]:
    """Differences between two `SamplerOutput`s: tokens and ranks exact, logprobs to 1e-5 (`exact`:
    to the bit, as the *_logits modes give: no normaliser)."""
    bad = []
    if not torch.equal(got.token_ids.cpu(), want.token_ids.cpu()):
        bad.append(f"{label}: tokens {got.token_ids.tolist()} != {want.token_ids.tolist()}")
    if not torch.equal(got.valid.cpu(), want.valid.cpu()):
        bad.append(f"{label}: valid {got.valid.tolist()} != {want.valid.tolist()}")
    if (got.logprobs is None) != (want.logprobs is None):
        return bad + [f"{label}: logprobs presence differs"]
    if got.logprobs is None:
        return bad
    for name in ("token_logprobs", "token_ranks", "top_token_ids", "top_logprobs"):
        a, b = getattr(got.logprobs, name).cpu(), getattr(want.logprobs, name).cpu()
        if a.shape != b.shape:
            bad.append(f"{label}: {name} shape {tuple(a.shape)} != {tuple(b.shape)}")
        elif not a.dtype.is_floating_point:
            if not torch.equal(a, b):
                bad.append(f"{label}: {name} {_short(a.tolist())} != {_short(b.tolist())}")
        elif not (torch.equal(torch.isinf(a), torch.isinf(b)) and torch.equal(a[torch.isinf(a)], b[torch.isinf(b)])
                  and torch.allclose(a[~torch.isinf(a)], b[~torch.isinf(b)], atol=0 if exact else 1e-5, rtol=0)):
            bad.append(f"{label}: {name} {_short(a.tolist())} != {_short(b.tolist())}")
    return bad


def check_case(case: Case, group: Any, label: str, with_reference: bool = False) -> list[str]:
    """Run `case` split over `group` and unsplit here; every difference, as text."""
    split_out, seeds, split_mus = run_case(case, group)
    want, _, want_mus = run_case(case, None, seeds)
    bad = []
    for t, (got, expected) in enumerate(zip(split_out, want, strict=True)):
        bad += compare(f"{label} step {t}", got, expected, exact=case.mode.endswith("logits"))
    for t, (got_mu, want_mu) in enumerate(zip(split_mus, want_mus, strict=True)):
        if got_mu != want_mu:  # Mirostat's mu, to the bit (None where off)
            bad.append(f"{label} step {t}: mu {got_mu} != unsplit {want_mu}")
    if with_reference:
        ref = reference_tokens(case, seeds[0])
        if not torch.equal(split_out[0].token_ids.cpu(), ref):
            bad.append(f"{label}: step 0 tokens {split_out[0].token_ids.tolist()} != reference {ref.tolist()}")
    return bad


# ------------------------------------------------------------------ error behaviour
def _expect(label: str, fn: Callable[[], Any], error: type, field_name: str | None) -> list[str]:
    try:
        fn()
    except error as exc:
        if field_name is not None and getattr(exc, "field", None) != field_name:
            return [f"{label}: raised {type(exc).__name__} on field {exc.field!r}, expected {field_name!r}"]
        return []
    except Exception as exc:  # noqa: BLE001 - reported as a failure
        return [f"{label}: raised {type(exc).__name__}: {exc}, expected {error.__name__}"]
    return [f"{label}: no error, expected {error.__name__}"]


def error_checks(group: Any) -> list[str]:
    """Every rank must raise (the same kind of error) and keep its state; then a good step works."""
    from tokensampler import InvalidSamplingParams, SplitMismatch

    ex = group if isinstance(group, Exchange) else None
    world = ex.world_size if ex else torch.distributed.get_world_size(group)
    rank = ex.rank if ex else torch.distributed.get_rank(group)
    last = rank == world - 1
    vocab, padded = 61, 64 * world
    width = padded // world
    bad: list[str] = []
    if world > 1:
        bad += _expect("padded not a multiple of world",
                       lambda: Sampler(vocab, max_slots=2, padded_vocab_size=padded + 1, group=group),
                       InvalidSamplingParams, "padded_vocab_size")
    sampler = Sampler(vocab, max_slots=4, padded_vocab_size=padded, group=group, logprobs_mode="raw_logprobs")
    unsplit = Sampler(vocab, max_slots=4, padded_vocab_size=padded)
    good = [SamplingParams(seed=5, top_p=0.8, logprobs=2), SamplingParams(seed=6, top_k=3, presence_penalty=1.0)]
    for slot, params in enumerate(good):
        sampler.add_request(slot, params, [1, 2])
        unsplit.add_request(slot, params, [1, 2])
    # a request the ranks disagree on: rejected everywhere, the slot stays empty
    differing = SamplingParams(seed=7, top_k=5 if rank == 0 else 6)
    bad += _expect("admission params differ", lambda: sampler.add_request(2, differing, [1]), SplitMismatch, "params")
    bad += _expect("slot left empty", lambda: sampler.params_of(2), InvalidSamplingParams, "slot")
    # one rank rejects its own request: it raises its own error, the others name it
    local_bad = SamplingParams(seed=8, logit_bias={vocab + 3 if last else 3: 1.0})
    bad += _expect("one rank's request invalid", lambda: sampler.add_request(2, local_bad, [1]),
                   InvalidSamplingParams, "logit_bias" if last else "group")
    # a prompt that is not a sequence: the library's error on that rank, and every other rank names it
    bad += _expect("one rank's prompt is not a list",
                   lambda: sampler.add_request(2, SamplingParams(seed=9), None if last else [1]),
                   InvalidSamplingParams if last else SplitMismatch, "prompt_token_ids" if last else "group")
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(2, padded, generator=gen)
    mine = logits[:, rank * width:(rank + 1) * width]
    wide = torch.randn(2, width + 1) if last else mine
    bad += _expect("slice widths differ", lambda: sampler.sample(wide), SplitMismatch, "logits.shape[1]")
    fewer = mine[:1] if rank == 0 and world > 1 else mine
    if world > 1:
        bad += _expect("batch differs", lambda: sampler.sample(fewer, [0] if rank == 0 else [0, 1]),
                       SplitMismatch, "batch")
        bad += _expect("slot order differs", lambda: sampler.sample(mine, [1, 0] if last else [0, 1]),
                       SplitMismatch, "params")
        bad += _expect("one rank's dtype invalid", lambda: sampler.sample(mine.to(torch.int32) if last else mine),
                       InvalidSamplingParams, "logits.dtype" if last else "group")
    # nothing above changed any state: the next step equals a fresh unsplit sampler's first step
    for step in range(2):
        got = sampler.sample(mine)
        bad += compare(f"after errors step {step}", got, unsplit.sample(logits))
        logits = torch.randn(2, padded, generator=gen)
        mine = logits[:, rank * width:(rank + 1) * width]
    return bad


# ------------------------------------------------------------------ data-parallel sampling groups
def dp_checks(tp: int, dp: int, vocab: int = 203, padded: int = 208) -> list[str]:
    """World = tp * dp gloo ranks: each sampling group samples its own rows (round-robin slots)."""
    from tokensampler.parallel import sampling_dp

    layout = sampling_dp(tp, dp)
    rank = torch.distributed.get_rank()
    group_index = layout.group_of_rank(rank)
    groups = layout.new_groups()
    member_rank = layout.ranks_of(group_index).index(rank)
    width = padded // tp
    r = random.Random(5)
    all_params = [random_params(r, vocab, KINDS[i % len(KINDS)]) for i in range(2 * dp + 1)]
    all_params = [dataclasses.replace(p, seed=1000 + i) for i, p in enumerate(all_params)]
    logits = random_logits(r, torch.Generator().manual_seed(5), len(all_params), vocab, padded)
    unsplit = Sampler(vocab, max_slots=len(all_params), padded_vocab_size=padded, eos_token_ids=EOS)
    sampler = Sampler(vocab, max_slots=len(all_params), padded_vocab_size=padded, eos_token_ids=EOS,
                      group=groups[group_index])
    rows, local_slots = [], []
    for s, params in enumerate(all_params):
        unsplit.add_request(s, params, [3])
        g, local = layout.locate(s)
        if layout.global_slot(g, local) != s:
            return [f"dp: global_slot(locate({s})) != {s}"]
        if g == group_index:
            sampler.add_request(local, params, [3])
            rows.append(s)
            local_slots.append(local)
    want = unsplit.sample(logits)
    got = sampler.sample(logits[rows][:, member_rank * width:(member_rank + 1) * width], local_slots)
    bad = []
    if got.token_ids.tolist() != want.token_ids[rows].tolist():
        bad.append(f"dp group {group_index}: {got.token_ids.tolist()} != {want.token_ids[rows].tolist()}")
    return bad


# ------------------------------------------------------------------ a spawned gloo rank
def gloo_worker(rank: int, world: int, init_file: str, out_dir: str, jobs: list[tuple]) -> None:
    """One rank of a spawned gloo world. Sub-groups of ranks [0, n) for every n <= world are real
    process groups of size n; each job ("case" | "errors" | "dp", n, ...) runs on the ranks of its
    group, in list order. Writes {failures, checks, crash} as JSON, then leaves at once."""
    import datetime
    import json
    import os
    import traceback

    torch.set_num_threads(1)
    dist = torch.distributed
    report: dict[str, Any] = {"failures": [], "checks": 0, "crash": None}
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        groups = {n: dist.new_group(list(range(n))) for n in range(1, world + 1)}
        for job in jobs:
            kind, size = job[0], job[1]
            if rank >= size:
                continue
            if kind == "case":
                _, _, seed, vocab, padded, mode = job
                label = f"gloo world {size} V{vocab}/{padded} {mode} seed {seed}"
                report["failures"] += check_case(make_case(seed, vocab, padded, mode), groups[size], label)
            elif kind == "errors":
                report["failures"] += error_checks(groups[size])
            elif kind == "dp":
                report["failures"] += dp_checks(*job[2:])
            report["checks"] += 1
    except Exception:  # noqa: BLE001 - reported to the parent
        report["crash"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(report, handle)
    os._exit(0)  # skip interpreter teardown (tens of seconds on a busy 2-core machine)
