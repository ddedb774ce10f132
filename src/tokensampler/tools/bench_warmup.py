"""`tokensampler bench --warmup`: what `Sampler.warmup` costs and what it buys.

Child processes share one fresh compile cache (inductor's directory, given to the children
only): the first warms up with the cache empty (cold: everything is compiled), the next ones (three
by default) with the cache the first left (warm: everything is loaded). Each warm one then samples
batch sizes 1..max_slots with mixed parameters, each size three times, and records the first
call's time over the second's, whether dynamo's counters moved, how many compiled functions were
prepared after warm-up (must be 0) and how many loaded functions warm-up left uncalled (must be 0:
a first call costs more). The reported ratio of a batch size is the median over the warm children.
Each child's warm-up time includes importing the compiler on first use.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from ..core.params import SamplingParams
from ..sampler import Sampler
from .workloads import make_logits

VOCAB, PADDED, MAX_SLOTS = 151936, 151936, 64
QUICK_BATCHES = (1, 3, 7, 13, 21, 29)  # plus max_slots


def _mixed_params(r: random.Random, slot: int) -> SamplingParams:
    """A serving mix: greedy, temperature, top-k, top-p, min-p, penalties, logprobs, bias."""
    kind = r.choice(["greedy", "temperature", "top_p", "top_k_top_p", "min_p", "penalties", "logprobs", "bias"])
    params = {"greedy": dict(temperature=0.0), "temperature": dict(temperature=0.8),
              "top_p": dict(temperature=0.8, top_p=0.9), "top_k_top_p": dict(temperature=0.7, top_k=40, top_p=0.95),
              "min_p": dict(temperature=1.0, min_p=0.05),
              "penalties": dict(temperature=0.8, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.2),
              "logprobs": dict(temperature=0.8, top_p=0.95, logprobs=5), "bias": dict(temperature=0.8,
                                                                                        logit_bias={7: 2.0})}[kind]
    return SamplingParams(seed=slot, **params)


def measure(vocab: int, padded: int, max_slots: int, batches: Sequence[int], seed: int = 0) -> dict:
    """In this process: warm up a sampler, then sample each batch size three times. Returns the
    warm-up report and, per batch size, the three call times (ms) and first / second."""
    from torch._dynamo.utils import counters

    from ..backends.torch_step import compile_cache
    sampler = Sampler(vocab, max_slots=max_slots, padded_vocab_size=padded, max_logprobs=20, compile=True)
    start = time.perf_counter()
    report = sampler.warmup()
    warm_seconds = time.perf_counter() - start
    graphs, prepared = sum(counters["stats"].values()), compile_cache.prepared()
    before, uncalled = compile_cache.layouts(), compile_cache.uncalled()
    r = random.Random(seed)
    rows = []
    for batch in batches:
        for slot in range(batch):
            sampler.add_request(slot, _mixed_params(r, slot), [r.randrange(vocab) for _ in range(16)])
        logits = make_logits(batch, padded, flat=r.random() < 0.3, seed=batch)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            sampler.sample(logits)
            times.append((time.perf_counter() - start) * 1e3)
        rows.append({"batch": batch, "ms": times, "first_over_second": times[0] / times[1]})
    return {"warmup_seconds": warm_seconds, "warmup": report, "batches": rows,
            "dynamo_counters_changed": sum(counters["stats"].values()) != graphs,
            "prepared_after_warmup": compile_cache.prepared() - prepared,
            "layouts_after_warmup": sorted(set(compile_cache.layouts()) - set(before)),
            "uncalled_after_warmup": uncalled, "compile": compile_cache.report()}


def _child(cache: str, vocab: int, padded: int, max_slots: int, batches: Sequence[int]) -> dict:
    code = ("import json, sys; from tokensampler.tools.bench_warmup import measure; "
            f"print(json.dumps(measure({vocab}, {padded}, {max_slots}, {list(batches)!r})))")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"warm-up child failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_seconds"] = time.perf_counter() - start
    return result


def run_warmup_bench(vocab: int = VOCAB, padded: int = PADDED, max_slots: int = MAX_SLOTS,
                     quick: bool = False, repeats: int = 3, log=sys.stderr) -> dict:
    """Cold warm-up in one child process, then `repeats` warm-cache children, each sampling batch
    sizes 1..max_slots (or QUICK_BATCHES and max_slots with quick). A batch size's first/second
    ratio is the median over the warm children (one call on a shared 2-core machine can take twice
    its time for reasons of its own); the warm-up time is their median too."""
    batches = [*QUICK_BATCHES, max_slots] if quick else list(range(1, max_slots + 1))
    with tempfile.TemporaryDirectory(prefix="tokensampler-warmup-") as cache:
        print(f"warm-up, cold cache (V={vocab}) ...", file=log, flush=True)
        cold = _child(cache, vocab, padded, max_slots, [])
        print(f"    {cold['warmup_seconds']:.1f} s; {repeats} x (warm cache, then batch sizes "
              f"{batches[0]}..{batches[-1]}) ...", file=log, flush=True)
        warms = [_child(cache, vocab, padded, max_slots, batches) for _ in range(repeats)]
    runs = [[w["batches"][i]["first_over_second"] for w in warms] for i in range(len(batches))]
    per_batch = [{"batch": batch, "first_over_second": statistics.median(ratios), "runs": ratios}
                 for batch, ratios in zip(batches, runs)]
    worst = max(per_batch, key=lambda b: b["first_over_second"])
    return {"vocab": vocab, "padded_vocab": padded, "max_slots": max_slots, "batches": batches, "repeats": repeats,
            "cold_warmup_seconds": cold["warmup_seconds"],
            "warm_warmup_seconds": statistics.median(w["warmup_seconds"] for w in warms),
            "warm_warmup_runs": [w["warmup_seconds"] for w in warms],
            "cold_compiled": sum(f["compiled"] for f in cold["compile"]["functions"].values()),
            "warm_loaded": min(sum(f["loaded"] for f in w["compile"]["functions"].values()) for w in warms),
            "warm_compiled": max(sum(f["compiled"] for f in w["compile"]["functions"].values()) for w in warms),
            "worst_first_over_second": worst["first_over_second"], "worst_batch": worst["batch"],
            "worst_single_first_over_second": max(max(b["runs"]) for b in per_batch),
            "median_first_over_second": statistics.median(b["first_over_second"] for b in per_batch),
            "per_batch": per_batch,
            "prepared_after_warmup": max(w["prepared_after_warmup"] for w in warms),
            "uncalled_after_warmup": max(len(w["uncalled_after_warmup"]) for w in warms),
            "dynamo_counters_changed": any(w["dynamo_counters_changed"] for w in warms), "cold": cold, "warm": warms}


def write_json(result: dict, path: str) -> None:
    """The result with the date and machine, as the other benches write theirs."""
    from datetime import datetime, timezone

    import torch

    from .machine import machine_info
    payload = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "machine": machine_info(torch.device("cpu")), "warmup": result}
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=1)


def format_warmup_table(result: dict) -> str:
    rows = [("warm-up, cold cache (s)", f"{result['cold_warmup_seconds']:.1f}"),
            ("warm-up, warm cache (s, median)", f"{result['warm_warmup_seconds']:.2f}"),
            ("functions compiled cold / loaded warm", f"{result['cold_compiled']} / {result['warm_loaded']}"),
            (f"worst first / second call, B = {result['batches'][0]}..{result['batches'][-1]} "
             f"(median of {result['repeats']} processes)",
             f"{result['worst_first_over_second']:.2f} (B={result['worst_batch']})"),
            ("worst single first / second call", f"{result['worst_single_first_over_second']:.2f}"),
            ("median first / second call", f"{result['median_first_over_second']:.2f}"),
            ("loaded but not yet called after warm-up", f"{result['uncalled_after_warmup']}"),
            ("compiled after warm-up (functions, dynamo counters)",
             f"{result['prepared_after_warmup']}, {'changed' if result['dynamo_counters_changed'] else 'unchanged'}")]
    return "\n".join(["| measure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])

