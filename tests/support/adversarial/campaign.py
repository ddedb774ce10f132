"""The campaign: every path's cases until its draws are made (`run_campaign`), `budgets`, the report's `table`."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any, Sequence

import torch

from tests.support.adversarial.cases import PATHS, Case, make_case
from tests.support.adversarial.findings import Log, Tally
from tests.support.adversarial.runner import Runner


def budgets(draws: int, paths: Sequence[str]) -> dict[str, int]:
    """Draws per path: the kernels (Triton's interpreter, ~0.1 s a row) get a fixed small share."""
    shares = {"torch": 0.90, "sample": 0.05, "split2": 0.025, "split3": 0.025}
    out = {}
    rest = [p for p in paths if p != "kernels"]
    total = sum(shares[p] for p in rest)
    for p in rest:
        out[p] = math.ceil(draws * shares[p] / total)
    if "kernels" in paths:
        out["kernels"] = min(4000, max(60, draws // 25_000))
    return out


def run_campaign(draws_per_path: dict[str, int], seed: int, keep: int = 50, progress: bool = False,
                 max_seconds: float | None = None, threads: int | None = 1, step_scale: int = 1) -> dict[str, Any]:
    """Run each path until it made its draws; the report (per path and total tallies, findings).
    threads: torch's intra-op threads meanwhile (1: the batches are small, and a shared machine
    makes thread synchronisation cost more than it gains); None leaves torch's setting."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels run on CPU tensors
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _campaign(draws_per_path, seed, keep, progress, max_seconds, step_scale)
    finally:
        torch.set_num_threads(before)


def _campaign(draws_per_path: dict[str, int], seed: int, keep: int, progress: bool,
              max_seconds: float | None, step_scale: int) -> dict[str, Any]:
    log = Log(keep)
    tallies: dict[str, Tally] = {}
    start = time.perf_counter()
    for path in PATHS:
        if path not in draws_per_path:
            continue
        tally = tallies[path] = Tally()
        runner = Runner(path, tally, log)
        t0, c0 = time.perf_counter(), time.process_time()
        index = 0
        last = t0
        while tally.draws < draws_per_path[path]:
            runner.run(make_case(seed, path, index, step_scale))
            index += 1
            tally.seconds, tally.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
            if index >= 200 and tally.draws == 0:
                break  # nothing runs: reported as it is
            if max_seconds is not None and time.perf_counter() - start > max_seconds:
                break
            if progress and time.perf_counter() - last > 30:
                last = time.perf_counter()
                print(f"  {path}: {index} cases, {tally.draws:,} draws, {tally.failures} failures, "
                      f"{tally.seconds:.0f} s", file=sys.stderr, flush=True)
    total = Tally()
    for tally in tallies.values():
        total.add(tally)
    return {"seed": seed, "budgets": dict(draws_per_path),
            "paths": {p: dataclasses.asdict(t) for p, t in tallies.items()},
            "total": dataclasses.asdict(total), "failures": total.failures,
            "findings": [dataclasses.asdict(f) for f in log.findings],
            "allowed_examples": [dataclasses.asdict(f) for f in log.info],
            "wall_seconds": time.perf_counter() - start, "cpu_seconds": total.cpu_seconds}


COLUMNS = [("cases", "cases"), ("requests", "rows"), ("draws", "draws"), ("invalid_ids", "invalid ids"),
           ("mismatches", "mismatches"),
           ("library_errors", "library errors"), ("other_exceptions", "other exceptions"),
           ("rejected_valid", "valid input rejected"), ("accepted_invalid", "invalid input accepted"),
           ("topp_border", "top-p border (float64 order)"), ("reference_rows", "rows also through reference.py"),
           ("oracle_disagreements", "batched oracle != reference.py"),
           ("seconds", "wall seconds"), ("cpu_seconds", "CPU seconds")]


def table(report: dict[str, Any]) -> str:
    """The report's figures as a Markdown table (one row per path and the total)."""
    lines = ["| path | " + " | ".join(title for _, title in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for name, tally in list(report["paths"].items()) + [("total", report["total"])]:
        cells = [f"{tally[key]:,.0f}" if key.endswith("seconds") else f"{tally[key]:,}" for key, _ in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)



def run_case(seed: int, path: str, index: int, step_scale: int = 1) -> tuple[Case, Tally, Log]:
    """One case of the campaign of `seed` run alone, every finding kept: (the case, its tally, its log)."""
    tally, log = Tally(), Log(keep=10_000)
    case = make_case(seed, path, index, step_scale)
    Runner(path, tally, log).run(case)
    return case, tally, log
