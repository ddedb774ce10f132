"""`tokensampler bench`: the workload matrix, timed side by side, every case checked against the oracle.

Per case, arms run in alternating rounds on the same logits tensor: the single-pass floor
(`logits.amax(-1)`), the plain sort-based torch pipeline most engines ship (sort, softmax, cumsum,
multinomial), and tokensampler's `Sampler.sample` (and, with `--against`, a peer's own sampler: vLLM's,
bench_vllm.py, or llama.cpp's chain, bench_llama_cpp.py, imported only then). Medians over the rounds;
ratios within one run are what to compare (these machines are shared and noisy). Before timing, the
sampler's tokens on the case's first step are compared with `reference.py`, token for token, and the
sampler warms up (`Sampler.warmup`): the rounds time the steady state, and the warm-up's seconds are
reported apart (per case, and for the whole run under "compile"). With `--contention N`
(`contention.BusyProcesses`), every round is timed twice, quiet then with N spinning processes
beside it, and each case reports its contended/quiet ratio (tokensampler's and the sort pipeline's).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from ..backends.choice import BackendChoice
from ..backends.torch_step import compile_cache
from ..reference import ReferenceRequest, bitmask_allowed_ids, reference_sample
from ..sampler import Sampler
from . import bench_vllm, workloads
from .bench_memory import step_memory_report
from .contention import BusyProcesses
from .machine import machine_info
from .workloads import OUTPUT_LEN, WORKLOAD_MATRIX, BenchCase, make_bitmask, make_histories, make_logits

QUICK_CHECK_ROWS = 4  # --quick checks this many rows per case against the reference (all otherwise)
PEERS = {"vllm": "vLLM", "llama.cpp": "llama.cpp"}  # --against NAME: the arm's name and its column's
PEER_STEP = {  # what one timed call of the peer's arm does (recorded in the JSON)
    "vllm": "one Sampler.forward; the copy of the logits into its input buffer is untimed",
    "llama.cpp": "per row, the logits copied into a llama_token_data_array (ids, logits, p = 0) and the chain "
                 "applied (llama_sampler_apply, ending with dist): timed together; llama.cpp_copy times the copy "
                 "alone",
}


def peer_unavailable(against: str | None) -> str | None:
    """None if the peer's sampler can run here, else the one-line note that replaces its column."""
    if against == "vllm":
        return bench_vllm.why_unavailable()
    if against == "llama.cpp":
        try:
            from . import bench_llama_cpp  # needs numpy, which tokensampler does not
        except ImportError as exc:
            return f"llama.cpp column omitted: {type(exc).__name__}: {exc}"
        return bench_llama_cpp.why_unavailable()
    return None


def peer_version(against: str | None) -> str | None:
    if against == "vllm":
        return bench_vllm.vllm_version()
    if against == "llama.cpp" and peer_unavailable(against) is None:
        from . import bench_llama_cpp
        return bench_llama_cpp.llama_cpp_version()
    return None


def build_sampler(case: BenchCase, device: torch.device | str, prompts, outputs, backend: str | None = None,
                  compile: bool | None = None) -> Sampler:
    """A sampler holding the case's rows (`backend`, `compile`: as `Sampler`'s, None the defaults)."""
    sampler = Sampler(case.vocab, max_slots=case.batch, device=device, backend=backend, compile=compile)
    for row in range(case.batch):
        sampler.add_request(row, case.sampling_params(1000 + row, row), prompts[row],
                            output_token_ids=outputs[row])
    return sampler


def check_against_reference(case: BenchCase, logits: torch.Tensor, prompts, outputs,
                            device: torch.device | str, max_rows: int | None = None,
                            bitmask: torch.Tensor | None = None) -> tuple[int, int]:
    """(rows equal to reference.py, rows checked) on the first step of a fresh sampler.

    The whole batch is sampled; the reference (about a second per 150k-wide row on a CPU core)
    checks the first `max_rows` rows (all by default)."""
    sampler = build_sampler(case, device, prompts, outputs)
    got = sampler.sample(logits, token_bitmask=bitmask).token_ids.cpu()
    rows = case.batch if max_rows is None else min(max_rows, case.batch)
    requests = [ReferenceRequest(case.sampling_params(1000 + row, row), 1000 + row,
                                 len(prompts[row]) + len(outputs[row]), prompts[row], outputs[row])
                for row in range(rows)]
    allowed = None if bitmask is None else bitmask_allowed_ids(bitmask[:rows], case.vocab)
    want = reference_sample(logits[:rows].cpu(), requests, vocab_size=case.vocab, allowed=allowed).token_ids
    return int((got[:rows] == want).sum()), rows


def sort_pipeline_step(logits: torch.Tensor, case: BenchCase, counts: torch.Tensor | None,
                       prompt_mask: torch.Tensor | None, gen: torch.Generator) -> torch.Tensor:
    """The textbook step: penalties, temperature, top-k by threshold, top-p by sort + cumsum,
    min-p, softmax, multinomial (and log_softmax + topk when logprobs are asked)."""
    p = case.params
    z = logits.float()
    if counts is not None:
        seen = (counts > 0) | prompt_mask
        rep = p.get("repetition_penalty", 1.0)
        z = torch.where(seen, torch.where(z > 0, z / rep, z * rep), z)
        z = z - p.get("frequency_penalty", 0.0) * counts - p.get("presence_penalty", 0.0) * (counts > 0)
    if p.get("logprobs") is not None:
        torch.topk(torch.log_softmax(logits.float(), dim=-1), p["logprobs"], dim=-1)
    if p.get("temperature", 1.0) == 0.0:
        return z.argmax(dim=-1)
    z = z / p.get("temperature", 1.0)
    if p.get("top_k", 0) > 0:
        kth = torch.topk(z, p["top_k"], dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, -math.inf)
    if p.get("top_p", 1.0) < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_z, dim=-1).cumsum(dim=-1)
        remove = cumulative - torch.softmax(sorted_z, dim=-1) > p["top_p"]
        sorted_z = sorted_z.masked_fill(remove, -math.inf)
        z = torch.empty_like(z).scatter_(-1, order, sorted_z)
    probs = torch.softmax(z, dim=-1)
    if p.get("min_p", 0.0) > 0.0:
        probs = probs.masked_fill(probs < p["min_p"] * probs.amax(dim=-1, keepdim=True), 0.0)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_arms(arms: dict, rounds: int, device: torch.device, warmup: int = 1) -> dict[str, list[float]]:
    """Milliseconds per call of each arm, alternating arms within each round, the order rotated from
    round to round (round r starts at arm r mod n): each arm follows each other one equally often, so
    none always runs in what one arm leaves behind (the sort pipeline's large temporaries slowed the
    next arm's reads of a single row 3-4x). An arm is a callable, or a (setup, callable) pair whose
    setup runs untimed before each call."""
    arms = {name: fn if isinstance(fn, tuple) else (None, fn) for name, fn in arms.items()}
    for setup, fn in arms.values():
        for _ in range(warmup):
            if setup is not None:
                setup()
            fn()
    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            setup, fn = arms[name]
            if setup is not None:  # untimed preparation, e.g. a fresh copy of an input edited in place
                setup()
            _synchronize(device)
            start = time.perf_counter()
            fn()
            _synchronize(device)
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def time_arms_contended(arms: dict, rounds: int, device: torch.device,
                        load: BusyProcesses) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(quiet, contended) milliseconds per call of each arm: each round times every arm quiet, then
    again with `load` switched on, so both are measured side by side."""
    quiet: dict[str, list[float]] = {name: [] for name in arms}
    contended: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds):
        rotated = dict(list(arms.items())[r % len(arms):] + list(arms.items())[:r % len(arms)])
        for name, values in time_arms(rotated, 1, device, warmup=1 if r == 0 else 0).items():
            quiet[name] += values
        load.on()
        try:
            for name, values in time_arms(rotated, 1, device, warmup=0).items():
                contended[name] += values
        finally:
            load.off()
    return quiet, contended


def contention_report(quiet: dict[str, list[float]], contended: dict[str, list[float]], n: int) -> dict:
    """Medians under load and each arm's contended / quiet ratio of medians."""
    medians = {name: statistics.median(values) for name, values in contended.items()}
    ratios = {name: medians[name] / statistics.median(quiet[name]) for name in medians}
    return {"processes": n, "median_ms": medians, "runs_ms": contended, "ratio": ratios}


def run_case(case: BenchCase, device: torch.device, rounds: int, check_rows: int | None = None,
             against: str | None = None, load: BusyProcesses | None = None) -> dict:
    logits = make_logits(case.batch, case.vocab, flat=case.flat, device=device)
    prompts, outputs = make_histories(case)
    bitmask = make_bitmask(logits, case.bitmask_allowed) if case.bitmask_allowed else None
    equal, rows = check_against_reference(case, logits, prompts, outputs, device, check_rows, bitmask)
    sampler = build_sampler(case, device, prompts, outputs)
    warmup = sampler.warmup()  # steady state only: compilation (or loading) happens here, reported apart
    counts = prompt_mask = None
    if case.history:
        counts = torch.zeros(case.batch, case.vocab, device=device)
        counts.scatter_add_(1, torch.tensor(outputs, device=device), torch.ones(case.batch, OUTPUT_LEN, device=device))
        prompt_mask = torch.zeros(case.batch, case.vocab, dtype=torch.bool, device=device)
        prompt_mask.scatter_(1, torch.tensor(prompts, device=device), True)
    gen = torch.Generator(device=device).manual_seed(0)
    arms = {
        "floor": lambda: logits.amax(dim=-1),
        "sort_pipeline": lambda: sort_pipeline_step(logits, case, counts, prompt_mask, gen),
        "tokensampler": lambda: sampler.sample(logits, token_bitmask=bitmask),
    }
    if case.baseline is not None:  # the step to compare with, on the same logits, in the same rounds
        plain = build_sampler(dataclasses.replace(case, params=case.baseline, mix=()), device, prompts, outputs)
        plain.warmup()
        arms["baseline"] = lambda: plain.sample(logits)
    if bitmask is not None:  # the same step without the mask, in the same rounds: the mask's cost
        unmasked = build_sampler(case, device, prompts, outputs)
        arms["tokensampler_unmasked"] = lambda: unmasked.sample(logits)
    if against == "vllm" and device.type == "cpu":
        peer = bench_vllm.vllm_arm(case, logits, prompts, outputs)
        if peer is not None:
            arms["vllm"] = peer
    if against == "llama.cpp" and device.type == "cpu" and peer_unavailable(against) is None:
        from . import bench_llama_cpp
        arms.update(bench_llama_cpp.llama_cpp_arms(case, logits) or {})
    contention = None
    if load is None:
        times = time_arms(arms, rounds, device)
    else:
        times, contended = time_arms_contended(arms, rounds, device, load)
        contention = contention_report(times, contended, load.n)
    medians = {name: statistics.median(values) for name, values in times.items()}
    memory = step_memory_report(lambda: sampler.sample(logits, token_bitmask=bitmask), logits, case.vocab,
                                lambda: sampler.workspace_bytes) if device.type == "cpu" else None
    return {
        "case": case.name, "batch": case.batch, "vocab": case.vocab, "params": case.params,
        "flat": case.flat, "history": case.history, "rounds": rounds,
        "median_ms": medians, "runs_ms": times,
        "reference_rows_equal": equal, "rows": rows, "memory": memory, "warmup": warmup,
        **({"contention": contention} if contention is not None else {}),
        **({"baseline": case.baseline, "baseline_ratio": paired_ratio(times["tokensampler"], times["baseline"])}
           if case.baseline is not None else {}),
        **({"bitmask_allowed": case.bitmask_allowed,
            "mask_ratio": medians["tokensampler"] / medians["tokensampler_unmasked"]} if bitmask is not None else {}),
    }


def paired_ratio(times: list[float], other: list[float]) -> float:
    """The median over rounds of times[i] / other[i] (two arms timed one after the other each round)."""
    return statistics.median(a / b for a, b in zip(times, other))


def peer_ratio(ratio: float) -> str:
    """A peer's time over ours: one decimal, two below 1 (a faster peer is not rounded to 0.0x)."""
    return f"{ratio:.2f}x" if ratio < 1 else f"{ratio:.1f}x"


def format_table(results: list[dict]) -> str:
    peers = [name for name in PEERS if any(name in r["median_ms"] for r in results)]
    memory = any(r.get("memory") for r in results)
    masked = any("mask_ratio" in r for r in results)
    loaded = any("contention" in r for r in results)
    header = "| case | tokensampler ms | sort pipeline ms | floor ms | ts / floor | sort / ts |"
    header += "".join(f" {PEERS[name]} ms | {PEERS[name]} / ts |" for name in peers)
    header += " mask / unmasked |" if masked else ""
    baseline = any("baseline_ratio" in r for r in results)
    header += " baseline ms | ts / baseline (paired) |" if baseline else ""
    header += " peak extra / fp32 logits |" if memory else ""
    header += (" ts loaded ms | ts loaded / quiet | sort loaded ms | sort loaded / quiet | sort / ts loaded |"
               " floor loaded / quiet |" if loaded else "")
    header += " rows = reference |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in results:
        m = r["median_ms"]
        line = (f"| {r['case']} | {m['tokensampler']:.2f} | {m['sort_pipeline']:.2f} | {m['floor']:.3f} | "
                f"{m['tokensampler'] / m['floor']:.1f}x | {m['sort_pipeline'] / m['tokensampler']:.1f}x |")
        for name in peers:
            line += (f" {m[name]:.2f} | {peer_ratio(m[name] / m['tokensampler'])} |" if name in m else " - | - |")
        if masked:
            line += f" {r['mask_ratio']:.2f}x |" if "mask_ratio" in r else " - |"
        if baseline:
            line += f" {m['baseline']:.2f} | {r['baseline_ratio']:.2f}x |" if "baseline_ratio" in r else " - | - |"
        if memory:
            line += f" {r['memory']['ratio']:.2f} |" if r.get("memory") else " - |"
        if loaded:
            line += contention_cells(r.get("contention"))
        lines.append(line + f" {r['reference_rows_equal']}/{r['rows']} |")
    return "\n".join(lines)


def contention_cells(report: dict | None) -> str:
    """The table's cells for one case's `contention_report` (dashes without one); the floor's loaded /
    quiet ratio is the control: what the same load does to one plain torch reduction."""
    if report is None:
        return " - | - | - | - | - | - |"
    m, ratio = report["median_ms"], report["ratio"]
    return (f" {m['tokensampler']:.2f} | {ratio['tokensampler']:.2f}x | {m['sort_pipeline']:.2f} | "
            f"{ratio['sort_pipeline']:.2f}x | {m['sort_pipeline'] / m['tokensampler']:.1f}x | "
            f"{ratio['floor']:.2f}x |")


def run_bench(device: str = "cpu", quick: bool = False, json_path: str | None = None,
              cases: list[str] | None = None, rounds: int | None = None, log=sys.stderr,
              matrix: tuple[BenchCase, ...] = WORKLOAD_MATRIX, against: str | None = None,
              extra: dict | None = None, contention: int = 0) -> list[dict]:
    """Run the matrix (or the named cases); print progress to `log`, return per-case results.
    `contention` N > 0: every round is also timed beside N busy processes (`BusyProcesses`).
    `extra`: more top-level entries of the JSON (e.g. the admission report). `against="llama.cpp"`
    runs its own cases (`workloads.LLAMA_CPP_CASES`, B=1) unless cases are named; those names are
    known only then."""
    dev = torch.device(device)
    if against == "llama.cpp" and matrix is WORKLOAD_MATRIX:
        matrix = workloads.LLAMA_CPP_CASES if cases is None else WORKLOAD_MATRIX + workloads.LLAMA_CPP_CASES
    selected = [c for c in matrix if cases is None or c.name in cases]
    unknown = set(cases or ()) - {c.name for c in matrix}
    if unknown:
        raise ValueError(f"cases={sorted(unknown)} are not in the workload matrix: {[c.name for c in matrix]}")
    n_rounds = rounds if rounds is not None else (3 if quick else 7)
    check_rows = QUICK_CHECK_ROWS if quick else None
    peer_note = peer_unavailable(against)
    if peer_note:
        print(peer_note, file=log, flush=True)
    with BusyProcesses(contention) as load:
        results = _run_cases(selected, dev, n_rounds, check_rows, against, load if contention else None, log)
    if json_path:
        payload = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "machine": machine_info(dev), "quick": quick, "contention": contention, "results": results}
        if against is not None:
            payload["peer"] = {"name": against, "version": peer_version(against), "note": peer_note,
                               "step": PEER_STEP.get(against)}
        # the samplers were made with compile=None: the environment's default, as resolved here
        payload["compile"] = {"enabled": BackendChoice.resolve(device=dev).compile, **compile_cache.report()}
        payload.update(extra or {})
        with open(json_path, "w") as fh:
            json.dump(payload, fh, indent=1)
    return results


def _run_cases(selected: list[BenchCase], dev: torch.device, n_rounds: int, check_rows: int | None,
               against: str | None, load: BusyProcesses | None, log) -> list[dict]:
    results = []
    for i, case in enumerate(selected, 1):
        print(f"[{i}/{len(selected)}] {case.name} (B={case.batch}, V={case.vocab}) ...", file=log, flush=True)
        results.append(run_case(case, dev, n_rounds, check_rows, against, load))
        m = results[-1]["median_ms"]
        peer = "".join(f", {PEERS[name]} {m[name]:.2f} ms" for name in PEERS if name in m)
        if "mask_ratio" in results[-1]:
            peer += (f", unmasked {m['tokensampler_unmasked']:.2f} ms (mask / unmasked "
                     f"{results[-1]['mask_ratio']:.2f}x)")
        print(f"    tokensampler {m['tokensampler']:.2f} ms, sort pipeline {m['sort_pipeline']:.2f} ms{peer}, "
              f"floor {m['floor']:.3f} ms, reference {results[-1]['reference_rows_equal']}/{case.batch}",
              file=log, flush=True)
        if load is not None:
            loaded = results[-1]["contention"]["median_ms"]
            print(f"    with {load.n} busy process(es): tokensampler {loaded['tokensampler']:.2f} ms, "
                  f"sort pipeline {loaded['sort_pipeline']:.2f} ms", file=log, flush=True)
    return results
