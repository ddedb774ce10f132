"""The fused route's rows on helper threads never waited for (`TorchStepConfig.wait_free_rows`, the
default) against torch's parallel region (`wait_free_rows=False`), quiet and beside busy processes.

    python benchmarks/wait_free_rows.py [--cases topp0.9,penalties_topp] [--calls 10] [--rounds 3]
                                        [--contention 1] [--json benchmarks/wait_free_rows.json]

Both arms are compiling samplers over the same logits and histories, in one process. Each round
times, quiet and then with `--contention` busy processes switched on, `--calls` calls in a row of
each arm in turn (the arm going first alternating from round to round), in two patterns:

- back to back: calls follow each other (a sampler process of its own);
- after torch: each call right after a torch parallel region (`logits.amax`), as in an engine whose
  forward runs on torch's threads just before the sampler; with libgomp's default wait policy those
  threads then spin for some milliseconds beside the step.

Per case, pattern and arm: the median call quiet and loaded (ms), loaded / quiet, and the 90th
percentile and the longest loaded call. The JSON records every call and the OpenMP variables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from tokensampler import Sampler
from tokensampler.backends.torch_step.config import TorchStepConfig
from tokensampler.tools import workloads
from tokensampler.tools.contention import BusyProcesses

PATTERNS = ("back_to_back", "after_torch")


def build(case: workloads.BenchCase, wait_free: bool, prompts, outputs) -> Sampler:
    sampler = Sampler(case.vocab, max_slots=case.batch, compile=True,
                      step_config=TorchStepConfig(wait_free_rows=wait_free))
    for row in range(case.batch):
        sampler.add_request(row, case.sampling_params(1000 + row, row), prompts[row], output_token_ids=outputs[row])
    sampler.warmup()
    return sampler


def run_case(case: workloads.BenchCase, calls: int, rounds: int, load: BusyProcesses) -> dict:
    logits = workloads.make_logits(case.batch, case.vocab, flat=case.flat)
    prompts, outputs = workloads.make_histories(case)
    arms = {"wait_free": build(case, True, prompts, outputs), "torch_region": build(case, False, prompts, outputs)}
    times = {(pattern, arm, state): [] for pattern in PATTERNS for arm in arms for state in ("quiet", "loaded")}
    tokens = {arm: sampler.sample(logits).token_ids for arm, sampler in arms.items()}
    for r in range(rounds):
        for state in ("quiet", "loaded"):
            if state == "loaded":
                load.on()
            try:
                for pattern in PATTERNS:
                    for arm in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                        for _ in range(calls):
                            if pattern == "after_torch":
                                logits.amax(dim=-1)
                            start = time.perf_counter()
                            arms[arm].sample(logits)
                            times[(pattern, arm, state)].append((time.perf_counter() - start) * 1e3)
            finally:
                if state == "loaded":
                    load.off()
    rows = []
    for pattern in PATTERNS:
        for arm in arms:
            quiet, loaded = times[(pattern, arm, "quiet")], sorted(times[(pattern, arm, "loaded")])
            rows.append({"pattern": pattern, "arm": arm, "quiet_ms": statistics.median(quiet),
                         "loaded_ms": statistics.median(loaded),
                         "ratio": statistics.median(loaded) / statistics.median(quiet),
                         "loaded_p90_ms": loaded[int(0.9 * (len(loaded) - 1))], "loaded_max_ms": loaded[-1],
                         "quiet_runs_ms": quiet, "loaded_runs_ms": times[(pattern, arm, "loaded")]})
    return {"case": case.name, "batch": case.batch, "vocab": case.vocab,
            "same_tokens": bool(torch.equal(tokens["wait_free"], tokens["torch_region"])), "rows": rows}


def table(results: list[dict]) -> str:
    lines = ["| case | pattern | arm | quiet ms | loaded ms | loaded / quiet | loaded p90 ms | loaded max ms |",
             "|---|---|---|---|---|---|---|---|"]
    for result in results:
        for row in result["rows"]:
            lines.append(f"| {result['case']} | {row['pattern']} | {row['arm']} | {row['quiet_ms']:.2f} | "
                         f"{row['loaded_ms']:.2f} | {row['ratio']:.2f}x | {row['loaded_p90_ms']:.1f} | "
                         f"{row['loaded_max_ms']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="greedy,temp,topp0.9,minp0.05,penalties_topp,logprobs20_topp")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contention", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    names = args.cases.split(",")
    cases = [case for case in workloads.WORKLOAD_MATRIX if case.name in names]
    results = []
    with BusyProcesses(args.contention) as load:
        for case in cases:
            results.append(run_case(case, args.calls, args.rounds, load))
            print(table(results[-1:]).splitlines()[-4:], flush=True)
    print(table(results))
    if args.json:
        report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "calls": args.calls,
                  "rounds": args.rounds, "contention": args.contention, "threads": torch.get_num_threads(),
                  "torch": torch.__version__, "platform": platform.platform(),
                  "omp": {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
                  "results": results}
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
