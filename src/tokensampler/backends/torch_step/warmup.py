"""`warm`: run the torch step once on every route, so that no later step compiles anything.

The step's compiled reductions (`compile_cache.maybe_compiled`) are prepared on their first call: one
artefact per input layout, generic in the batch size (0, 1 and 2 included) and the vocabulary
width, compiled once and then loaded from the on-disk cache. Which functions a step calls depends
on its rows: peaked rows take candidate lists, flat rows the dense route, rows with many winnable
ids but a small top-p set the head route, near-1 top-p the tail mass, logprobs of far-down tokens
the full rank count; the caller's float32 logits (the direct route) and the block workspace have
different layouts. `warm` runs a scratch state through each mix on each layout, so every function
a sampler can call is prepared before serving.
"""

from __future__ import annotations

import time

import torch

from ...core.params import SamplingParams
from ...core.plan import plan_step
from ...state import SamplerState, VocabLayout
from .config import TorchStepConfig
from .step import TorchStep

MIXES: dict[str, tuple[str, dict] | tuple[str, dict, dict]] = {  # name: (row shape, parameters[, second row's])
    "greedy": ("peaked", dict(temperature=0.0)),
    "greedy_penalties": ("peaked", dict(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.3)),
    "temperature": ("peaked", dict(temperature=0.8)),
    "top_p": ("peaked", dict(temperature=0.8, top_p=0.9)),
    "top_k_top_p": ("peaked", dict(temperature=0.7, top_k=20, top_p=0.95)),
    "min_p": ("peaked", dict(temperature=1.0, min_p=0.05)),
    "penalties_top_p": ("peaked", dict(temperature=0.8, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.3)),
    "logprobs_top_p": ("peaked", dict(temperature=0.8, top_p=0.9, logprobs=5)),
    "bias_top_p": ("peaked", dict(temperature=0.8, top_p=0.9, logit_bias={0: 1.0})),
    "wide_top_p": ("peaked", dict(temperature=1.0, top_p=0.99999)),
    "flat_top_p": ("flat", dict(temperature=1.0, top_p=0.9)),
    "flat_logprobs": ("flat", dict(temperature=1.0, logprobs=1)),
    "flat_temperature": ("flat", dict(temperature=1.0)),
    "flat_min_p": ("flat", dict(temperature=1.0, min_p=1e-4, top_p=0.99)),
    "gaussian_top_p": ("gaussian", dict(temperature=0.8, top_p=0.9)),
    "gaussian_logprobs": ("gaussian", dict(temperature=0.8, top_p=0.9, logprobs=2)),
    # batches whose rows differ take other passes (e.g. top-p's tail mass on its rows only)
    "mixed_top_p_temperature": ("peaked", dict(temperature=0.8, top_p=0.9), dict(temperature=0.8)),
    "mixed_top_p_top_k": ("peaked", dict(temperature=0.8, top_p=0.9), dict(temperature=0.7, top_k=40, top_p=0.95)),
    "mixed_greedy_penalties": ("peaked", dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, presence_penalty=0.5)),
    "mixed_min_p_logprobs": ("peaked", dict(temperature=1.0, min_p=0.05), dict(temperature=0.8, top_p=0.9, logprobs=5)),
    "mixed_flat": ("flat", dict(temperature=1.0, top_p=0.9), dict(temperature=1.0)),
    "mixed_flat_min_p": ("flat", dict(temperature=1.0, min_p=0.05), dict(temperature=0.9, top_p=0.95, logprobs=3)),
}


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


def _inputs(shape: str, vocab: int, padded: int, generator: torch.Generator) -> list[torch.Tensor]:
    """The input layouts a step meets, two rows each: float32 contiguous (the direct route on the
    caller's logits), float32 as a column slice of a wider tensor (a caller's view), bfloat16 (the
    block route's contiguous workspace)."""
    rows = _rows(shape, 2, vocab, padded, generator)
    wider = torch.nn.functional.pad(rows, (0, 16))[:, :padded]
    return [rows, wider, rows.to(torch.bfloat16)]


def _run_mixes(vocab: int, padded: int, logprobs_mode: str, config: TorchStepConfig | None,
               device: torch.device) -> int:
    """Every mix of `MIXES` on every input layout of `_inputs`, through a scratch two-slot torch
    step of this width. Returns the number of steps run."""
    state = SamplerState(2, VocabLayout(vocab, padded), device)
    step = TorchStep(state, logprobs_mode, config, compiled=True)
    generator = torch.Generator().manual_seed(0)
    history = list(range(min(vocab, 40)))
    steps = 0
    for shape, *params in MIXES.values():
        for slot in range(2):
            request = SamplingParams(seed=slot, **params[slot % len(params)])
            state.admit(slot, request, slot, len(history), 0, history, history[:8], ())
        plan = plan_step([state.params[0], state.params[1]], vocab, [0, 1])
        for logits in _inputs(shape, vocab, padded, generator):
            step.run(logits.to(device), plan, None)
            steps += 1
    return steps


def warm(vocab_size: int, padded_vocab_size: int, logprobs_mode: str, config: TorchStepConfig | None = None,
         device: torch.device | str = "cpu") -> dict:
    """Run every mix of `MIXES` through a scratch torch step with this sampler's logprobs mode and
    config, on each input layout of `_inputs`. The compiled functions are generic in the batch size
    and the vocabulary width (only their layout selects an artefact: `compile_cache`), so the scratch
    vocabulary is at most WARM_VOCAB wide, with the sampler's padding. A warm-up records what it
    used (`compile_cache.save_manifest`); the next one with the same signature loads that, then runs
    the mixes once at EXERCISE_VOCAB wide (a loaded function's first call does dynamo's first-run
    bookkeeping and touches its code for the first time: a few ms each, kept off serving steps).
    Returns {"seconds": wall time, "steps": count, "prepared": compiled functions compiled or loaded}."""
    from . import compile_cache
    start, prepared = time.perf_counter(), compile_cache.prepared()
    device = torch.device(device)
    vocab = min(vocab_size, WARM_VOCAB)
    padded = vocab + padded_vocab_size - vocab_size
    signature = repr((vocab, padded, logprobs_mode, config, device.type, torch.get_num_threads()))
    if compile_cache.preload_manifest(signature):
        small = min(vocab, EXERCISE_VOCAB)
        steps = _run_mixes(small, small + padded - vocab, logprobs_mode, config, device)
    else:
        since = compile_cache.call_counts()
        steps = _run_mixes(vocab, padded, logprobs_mode, config, device)
        compile_cache.save_manifest(signature, since)
    return {"seconds": time.perf_counter() - start, "steps": steps, "prepared": compile_cache.prepared() - prepared}
