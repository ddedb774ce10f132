"""`warm`: run the torch step once on every route, so that no later step compiles anything.

The step's compiled reductions (`compile_cache.maybe_compiled`) are prepared on their first call: one
artefact per input layout, generic in the batch size (0, 1 and 2 included) and the vocabulary
width, compiled once and then loaded from the on-disk cache. Which functions a step calls is
decided by its routes (`routes.Route` for the step, `routes.Thresholds` x `routes.Values` for each
group of sampled rows), by the input layout a route reads (the caller's float32 logits, whole or as
a column slice, on the direct route; the block workspace otherwise), and within a route by the
filters its rows combine (top-p alone takes the tail mass from the list's count, top-p beside other
rows later; logprobs of far-down tokens the full rank count). `CASES` enumerates them: each case
names the route it provably takes (with the default config: a test reads the step's record,
`TorchStep.routes_taken`, and checks every case and that every route is some case's target), the
rows that take it and the layouts it can see. `warm` runs a scratch state through each case on
each of its layouts, so every function a sampler can call is prepared before serving. A layout
includes torch's thread count, and a small call runs on one thread
(`TorchStepConfig.single_thread_elements`): where that can happen the cases run on both counts
(`thread_settings`).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ...core.params import SamplingParams
from ...core.plan import plan_step
from ...core.threads import single_threaded, thread_count_owned
from ...state import SamplerState, VocabLayout
from .config import DEFAULT, TorchStepConfig
from .routes import Route, Thresholds, Values
from .step import TorchStep

Target = Route | tuple[Thresholds, Values]

CALLER = ("float32", "float32_view")  # the caller's float32 logits, as the direct route reads them
WORKSPACE = ("bfloat16",)  # another dtype: the block route's workspace (the plan would take the direct route)
ALL = CALLER + WORKSPACE


@dataclass(frozen=True)
class Case:
    """A warm-up step: two slots with `params` (the first, and the second's if given) on rows of
    `shape` (peaked, flat or gaussian), run on each of `layouts`; with the default config it takes
    `target` on every one. `masked`: the call passes a token bitmask (its first 32 ids removed).
    `fused`: the step may take the fused route (`TorchStepConfig.fused_route`); the other cases run
    with it off, on the general routes a fused call hands its rows to."""

    target: Target
    shape: str
    params: tuple[dict, ...]
    layouts: tuple[str, ...]
    masked: bool = False
    fused: bool = False  # run with the fused route on (every other case runs the general routes it hands off to)


LIST_MIXES: tuple[tuple[dict, ...], ...] = (  # peaked rows: each mix calls other passes of the candidate list
    (dict(temperature=0.8),),
    (dict(temperature=0.8, top_p=0.9),),  # the tail mass from the list's count (one pass)
    (dict(temperature=0.7, top_k=20, top_p=0.95),),
    (dict(temperature=1.0, min_p=0.05),),
    (dict(temperature=0.8, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.3),),
    (dict(temperature=0.8, top_p=0.9, logprobs=5),),
    (dict(temperature=0.8, top_p=0.99999),),  # the crossing below the list
    (dict(temperature=0.8, top_p=0.9), dict(temperature=0.8)),  # the tail mass of the top-p row alone
    (dict(temperature=0.8, top_p=0.9), dict(temperature=0.7, top_k=40, top_p=0.95)),
    (dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, presence_penalty=0.5)),  # a group copied out
    (dict(temperature=1.0, min_p=0.05), dict(temperature=0.8, top_p=0.9, logprobs=5)),
)
HEAD_MIXES: tuple[tuple[dict, ...], ...] = (  # gaussian rows: many winnable ids, a small top-p set
    (dict(temperature=0.8, top_p=0.9),),
    (dict(temperature=0.8, top_p=0.9, logprobs=2),),
)
DENSE_MIXES: tuple[tuple[dict, ...], ...] = (  # flat rows: too many winnable ids for a list
    (dict(temperature=1.0, top_p=0.9),),  # the head's crossing not found: on to the dense route
    (dict(temperature=1.0, logprobs=1),),
    (dict(temperature=1.0),),
    (dict(temperature=1.0, min_p=1e-4, top_p=0.99),),
    (dict(temperature=1.0, top_p=0.9), dict(temperature=1.0)),
    (dict(temperature=1.0, min_p=0.05), dict(temperature=0.9, top_p=0.95, logprobs=3)),
)
GREEDY = dict(temperature=0.0)
GREEDY_PENALTIES = dict(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.3)
FLAT_TOP_K = dict(temperature=1.0, top_k=50)  # flat rows with top-k: the list bounded by the k-th value
LIST_DIVIDED, LIST_IN_PLACE = (Thresholds.LIST, Values.DIVIDED_WHERE_READ), (Thresholds.LIST, Values.IN_PLACE)

CASES: tuple[Case, ...] = (
    Case(Route.PLAIN_GREEDY, "peaked", (GREEDY,), ALL),
    Case(Route.FUSED, "peaked", (dict(temperature=0.8, top_p=0.9, repetition_penalty=1.1, logprobs=2), GREEDY),
         CALLER, fused=True),  # compiling steps only (an eager step takes the direct route)
    Case(Route.DIRECT, "peaked", (GREEDY_PENALTIES,), CALLER),  # the cells written, greedy rows only
    Case(Route.BLOCK, "peaked", (GREEDY_PENALTIES,), WORKSPACE),
    *(Case(LIST_DIVIDED, "peaked", mix, CALLER) for mix in LIST_MIXES),  # the direct route's groups
    *(Case(LIST_IN_PLACE, "peaked", mix, WORKSPACE) for mix in LIST_MIXES),  # the block route's groups
    Case(LIST_IN_PLACE, "peaked", (dict(temperature=0.8, top_p=0.9, logit_bias={0: 1.0}),), ALL),  # no cell form
    Case(LIST_DIVIDED, "peaked", (dict(temperature=0.8, top_p=0.9),), CALLER, masked=True),  # a masked block
    Case((Thresholds.TOP_K_LIST, Values.DIVIDED_WHERE_READ), "flat", (FLAT_TOP_K,), CALLER),
    Case((Thresholds.TOP_K_LIST, Values.IN_PLACE), "flat", (FLAT_TOP_K,), WORKSPACE),
    *(Case((Thresholds.HEAD, Values.IN_PLACE), "gaussian", mix, ALL) for mix in HEAD_MIXES),
    *(Case((Thresholds.DENSE, Values.IN_PLACE), "flat", mix, ALL) for mix in DENSE_MIXES),
    Case((Thresholds.DENSE, Values.IN_PLACE), "peaked", (dict(temperature=1.0, top_p=0.99999),), ALL),  # via the head
    Case((Thresholds.FULL_ROW, Values.IN_PLACE), "peaked", (dict(temperature=0.8, top_p=0.9, typical_p=0.9),), ALL),
)


def _rows(shape: str, count: int, vocab: int, padded: int, generator: torch.Generator) -> torch.Tensor:
    """float32 [count, padded] logits of one shape (padding columns hold large values: never kept)."""
    if shape == "gaussian":
        rows = torch.randn(count, vocab, generator=generator) * 4.0
    else:
        slope = 2.2 if shape == "peaked" else 1.0
        profile = 18.0 - slope * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
        rows = torch.stack([(profile + 0.7 * torch.randn(vocab, generator=generator))[torch.randperm(vocab,
                            generator=generator)] for _ in range(count)])
    return torch.nn.functional.pad(rows, (0, padded - vocab), value=30.0)


WARM_VOCAB = 65536  # widest vocabulary warm-up runs at: the compiled code is generic in V above this
EXERCISE_VOCAB = 32768  # width of the pass that calls loaded functions once (flat rows still take the dense route)


def _input(shape: str, layout: str, vocab: int, padded: int, generator: torch.Generator) -> torch.Tensor:
    """Two rows of one shape in one layout: float32 contiguous, float32 as a column slice of a wider
    tensor (a caller's view), or bfloat16 (read through the block workspace)."""
    rows = _rows(shape, 2, vocab, padded, generator)
    if layout == "float32_view":
        return torch.nn.functional.pad(rows, (0, 16))[:, :padded]
    return rows.to(torch.bfloat16) if layout == "bfloat16" else rows


def run_cases(vocab: int, padded: int, logprobs_mode: str, config: TorchStepConfig | None,
              device: torch.device, compiled: bool = True, cases: tuple[Case, ...] = CASES) -> list[Counter]:
    """Every case of `cases` on each of its layouts, through a scratch two-slot torch step of this
    width. Returns, per case, the routes its steps took (`TorchStep.routes_taken`)."""
    state = SamplerState(2, VocabLayout(vocab, padded), device)
    # the thread count is the caller's (`thread_settings`), not the step's own small-call rule
    base = replace(config or DEFAULT, single_thread_elements=0)
    steps = {fused: TorchStep(state, logprobs_mode, replace(base, fused_route=fused and base.fused_route),
                              compiled=compiled) for fused in (False, True)}
    generator = torch.Generator().manual_seed(0)
    history = list(range(min(vocab, 40)))
    bitmask = torch.full((2, (vocab + 31) // 32), -1, dtype=torch.int32, device=device)
    bitmask[:, 0] = 0
    taken = []
    for case in cases:
        for slot in range(2):
            request = SamplingParams(seed=slot, **case.params[slot % len(case.params)])
            state.admit(slot, request, slot, len(history), 0, history, history[:8], ())
        plan = plan_step([state.params[0], state.params[1]], vocab, [0, 1])
        step = steps[case.fused]
        before = Counter(step.routes_taken)
        for layout in case.layouts:
            step.run(_input(case.shape, layout, vocab, padded, generator).to(device), plan, None,
                     bitmask if case.masked else None)
        taken.append(step.routes_taken - before)
    return taken


def warm(vocab_size: int, padded_vocab_size: int, logprobs_mode: str, config: TorchStepConfig | None = None,
         device: torch.device | str = "cpu") -> dict:
    """Run every case of `CASES` through a scratch torch step with this sampler's logprobs mode and
    config, on each of its layouts. The compiled functions are generic in the batch size
    and the vocabulary width (only their layout selects an artefact: `compile_cache`), so the scratch
    vocabulary is at most WARM_VOCAB wide, with the sampler's padding. A warm-up records what it
    used (`compile_cache.save_manifest`); the next one with the same signature loads that, then runs
    the cases once at EXERCISE_VOCAB wide (a loaded function's first call does dynamo's first-run
    bookkeeping and touches its code for the first time: a few ms each, kept off serving steps).
    Returns {"seconds": wall time, "steps": count, "prepared": compiled functions compiled or loaded,
    "routes": {route name: steps or groups that took it}}."""
    from . import compile_cache
    start, prepared = time.perf_counter(), compile_cache.prepared()
    device = torch.device(device)
    vocab = min(vocab_size, WARM_VOCAB)
    padded = vocab + padded_vocab_size - vocab_size
    signature = repr((vocab, padded, logprobs_mode, config, device.type, torch.get_num_threads()))
    if compile_cache.preload_manifest(signature):
        small = min(vocab, EXERCISE_VOCAB)
        taken = [t for threads in thread_settings(config)
                 for t in _under(threads, lambda: run_cases(small, small + padded - vocab, logprobs_mode, config,
                                                            device))]
    else:
        since = compile_cache.call_counts()
        taken = [t for threads in thread_settings(config)
                 for t in _under(threads, lambda: run_cases(vocab, padded, logprobs_mode, config, device))]
        compile_cache.save_manifest(signature, since)
    routes = sum(taken, Counter())
    return {"seconds": time.perf_counter() - start, "steps": sum(len(case.layouts) for case in CASES),
            "prepared": compile_cache.prepared() - prepared, "routes": {route_name(r): n for r, n in routes.items()}}


def thread_settings(config: TorchStepConfig | None) -> list[Callable[[], contextlib.AbstractContextManager]]:
    """The thread counts the sampler's steps run on: the caller's, and one thread too where small
    calls run single-threaded (`TorchStepConfig.single_thread_elements`; a compiled function's
    layout includes the thread count, so each count is warmed)."""
    settings: list[Callable[[], contextlib.AbstractContextManager]] = [contextlib.nullcontext]
    if (config or DEFAULT).single_thread_elements > 0 and thread_count_owned() and torch.get_num_threads() > 1:
        settings.append(single_threaded)
    return settings


def _under(threads: Callable[[], contextlib.AbstractContextManager], run: Callable[[], list]) -> list:
    with threads():
        return run()


def route_name(route: Target) -> str:
    """A route's name in the warm-up's report: "direct", or "list/divided_where_read"."""
    return route.value if isinstance(route, Route) else "/".join(member.value for member in route)
