"""`tokensampler bench --admission`: the host time of admitting a burst of requests at once.

`SamplingGenerator.apply_prefill_state` admits k requests into a generator of k lanes (CPU, a small
vocabulary), for k = 1, 32, 256 and 1,024: what an engine pays on the host when a burst of new
requests enters the batch (the vLLM plugin calls it once per step that admits any). Each k gets
one generator, built and warmed by one untimed admission; every timed round then admits k fresh
requests into the same slots (replacing them, as a running engine reuses its slots). Medians over
the rounds; the growth from one k to the next is what to read (these machines are shared and noisy).
"""

from __future__ import annotations

import json
import statistics
import time
from datetime import datetime, timezone

import torch

from ..core.params import SamplingParams
from ..engine.batch_params import BatchSamplingParams
from ..engine.generator import SamplingGenerator
from .machine import machine_info

ADMISSION_SIZES = (1, 32, 256, 1024)
ADMISSION_VOCAB = 32_000
PROMPT_LEN = 64


def admission_requests(k: int, seed: int) -> BatchSamplingParams:
    """k requests of an ordinary serving mix (seeded, so no seed is drawn), one lane each."""
    return BatchSamplingParams.from_requests([
        SamplingParams(temperature=0.0 if i % 4 == 0 else 0.8, top_p=0.95, top_k=50, seed=seed + i,
                       repetition_penalty=1.1 if i % 2 else 1.0, max_tokens=256)
        for i in range(k)])


def time_admission(k: int, rounds: int, vocab: int = ADMISSION_VOCAB) -> dict:
    """{"requests", "lanes", "median_ms", "runs_ms", "per_request_us"} of admitting k requests into k lanes."""
    generator = SamplingGenerator(vocab, max_batch_size=k, device="cpu", warmup=False, compile=False)
    prompts = torch.randint(0, vocab, (k, PROMPT_LEN), generator=torch.Generator().manual_seed(k))
    slots = list(range(k))
    batches = [admission_requests(k, seed=r * k) for r in range(rounds + 1)]
    runs = []
    for r, batch in enumerate(batches):
        start = time.perf_counter()
        generator.apply_prefill_state(sampling_params=batch, prompt_tokens=prompts, empty_slots=slots)
        if r:  # round 0 warms the generator (first use of its buffers), untimed
            runs.append((time.perf_counter() - start) * 1e3)
    median = statistics.median(runs)
    return {"requests": k, "lanes": k, "median_ms": median, "runs_ms": runs, "per_request_us": median * 1e3 / k}


def run_admission_bench(rounds: int | None = None, quick: bool = False,
                        sizes: tuple[int, ...] = ADMISSION_SIZES) -> dict:
    """The admission report: one `time_admission` row per size (default 5 rounds, quick 3)."""
    n_rounds = rounds if rounds is not None else (3 if quick else 5)
    return {"vocab": ADMISSION_VOCAB, "prompt_len": PROMPT_LEN, "device": "cpu", "rounds": n_rounds,
            "results": [time_admission(k, n_rounds) for k in sizes]}


def format_admission_table(report: dict) -> str:
    """Markdown: requests (= lanes), median ms, microseconds per request, growth over the row above."""
    lines = [f"admission (apply_prefill_state, CPU, V={report['vocab']}, prompts of {report['prompt_len']}, "
             f"median of {report['rounds']})",
             "| requests = lanes | median ms | us / request | time / previous row |", "|---|---|---|---|"]
    previous = None
    for row in report["results"]:
        growth = "-" if previous is None else f"{row['median_ms'] / previous['median_ms']:.1f}x " \
            f"for {row['requests'] / previous['requests']:.0f}x"
        lines.append(f"| {row['requests']} | {row['median_ms']:.2f} | {row['per_request_us']:.0f} | {growth} |")
        previous = row
    return "\n".join(lines)


def write_json(report: dict, path: str) -> None:
    payload = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "machine": machine_info(torch.device("cpu")), "admission": report}
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1)
