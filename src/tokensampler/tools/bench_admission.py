"""`tokensampler bench --admission`: the host time of admitting a burst of requests at once.

`SamplingGenerator.apply_prefill_state` admits k requests into a generator of k lanes (CPU, a small
vocabulary), for k = 1, 32, 256 and 1,024: what an engine pays on the host when a burst of new
requests enters the batch (the vLLM plugin calls it once per step that admits any). Each k gets
one generator, built and warmed by one untimed admission; every timed round then admits k fresh
requests into the same slots (replacing them, as a running engine reuses its slots). Medians over
the rounds; the growth from one k to the next is what to read (these machines are shared and noisy).
With `--contention N`, each round admits twice: quiet, then beside N busy processes (side by side).
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
from .contention import BusyProcesses
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


def time_admission(k: int, rounds: int, vocab: int = ADMISSION_VOCAB, load: BusyProcesses | None = None) -> dict:
    """{"requests", "lanes", "median_ms", "runs_ms", "per_request_us"} of admitting k requests into k
    lanes; with `load`, each round also admits k more with the busy processes on (side by side),
    adding {"contended_median_ms", "contended_runs_ms", "contention_ratio"}."""
    generator = SamplingGenerator(vocab, max_batch_size=k, device="cpu", warmup=False, compile=False)
    prompts = torch.randint(0, vocab, (k, PROMPT_LEN), generator=torch.Generator().manual_seed(k))
    slots = list(range(k))
    arms = 1 if load is None else 2
    batches = [admission_requests(k, seed=r * k) for r in range(arms * rounds + 1)]

    def admit(batch: BatchSamplingParams) -> float:
        start = time.perf_counter()
        generator.apply_prefill_state(sampling_params=batch, prompt_tokens=prompts, empty_slots=slots)
        return (time.perf_counter() - start) * 1e3

    admit(batches[0])  # warms the generator (first use of its buffers), untimed
    runs, contended = [], []
    for r in range(rounds):
        runs.append(admit(batches[arms * r + 1]))
        if load is not None:
            load.on()
            try:
                contended.append(admit(batches[arms * r + 2]))
            finally:
                load.off()
    median = statistics.median(runs)
    row = {"requests": k, "lanes": k, "median_ms": median, "runs_ms": runs, "per_request_us": median * 1e3 / k}
    if load is not None:
        loaded = statistics.median(contended)
        row.update(contended_median_ms=loaded, contended_runs_ms=contended, contention_ratio=loaded / median)
    return row


def run_admission_bench(rounds: int | None = None, quick: bool = False,
                        sizes: tuple[int, ...] = ADMISSION_SIZES, contention: int = 0) -> dict:
    """The admission report: one `time_admission` row per size (default 5 rounds, quick 3);
    `contention` busy processes beside every round's second admission (0: quiet only)."""
    n_rounds = rounds if rounds is not None else (3 if quick else 5)
    report = {"vocab": ADMISSION_VOCAB, "prompt_len": PROMPT_LEN, "device": "cpu", "rounds": n_rounds,
              "threads": torch.get_num_threads(), "contention": contention}
    if not contention:
        return {**report, "results": [time_admission(k, n_rounds) for k in sizes]}
    with BusyProcesses(contention) as load:
        return {**report, "results": [time_admission(k, n_rounds, load=load) for k in sizes]}


def format_admission_table(report: dict) -> str:
    """Markdown: requests (= lanes), median ms, microseconds per request, growth over the row above;
    with contention, the contended median and its ratio to the quiet one."""
    contention = report.get("contention", 0)
    lines = [f"admission (apply_prefill_state, CPU, V={report['vocab']}, prompts of {report['prompt_len']}, "
             f"median of {report['rounds']}"
             + (f"; each round also beside {contention} busy process(es))" if contention else ")"),
             "| requests = lanes | median ms | us / request | time / previous row |"
             + (" contended ms | contended / quiet |" if contention else ""),
             "|---|---|---|---|" + ("---|---|" if contention else "")]
    previous = None
    for row in report["results"]:
        growth = "-" if previous is None else f"{row['median_ms'] / previous['median_ms']:.1f}x " \
            f"for {row['requests'] / previous['requests']:.0f}x"
        line = f"| {row['requests']} | {row['median_ms']:.2f} | {row['per_request_us']:.0f} | {growth} |"
        if contention:
            line += f" {row['contended_median_ms']:.2f} | {row['contention_ratio']:.2f}x |"
        lines.append(line)
        previous = row
    return "\n".join(lines)


def write_json(report: dict, path: str) -> None:
    payload = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "machine": machine_info(torch.device("cpu")), "admission": report}
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1)
