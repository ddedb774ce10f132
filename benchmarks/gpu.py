"""The workload matrix of `tokensampler.tools.bench` on one CUDA GPU: the Triton step against its floors
and the usual alternatives, side by side, and its tokens against the CPU reference.

    PYTHONPATH=src python benchmarks/gpu.py                 # all cases -> benchmarks/gpu.json
    PYTHONPATH=src python benchmarks/gpu.py --cases greedy,topk50 --rounds 5 --json /tmp/x.json

Per case (same logits tensor for every arm, arms alternating within each round):
  copy_floor     device-to-device copy of the logits (the bytes every method must read once)
  amax_floor     `logits.amax(-1)` (the single-pass floor)
  kernels        `Sampler.sample` on the Triton step (the default for CUDA logits)
  torch_sampler  `Sampler(backend="torch").sample` (eager: it is not graph-safe)
  sort_pipeline  the textbook sort/cumsum/multinomial step of `tokensampler.tools.bench`
  flashinfer     `flashinfer.sampling.top_k_top_p_sampling_from_logits` (cases with top-k or top-p,
                 when FlashInfer is installed)
Times are CUDA-event medians of `--rounds` rounds of `--iters` back-to-back calls, each arm
replayed from a CUDA graph where it can be captured (the JSON says which). Before timing, the
kernels' tokens on the first step are compared with `reference.py` on the same logits (CPU).
Needs a CUDA device and Triton; without one it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

try:
    import tokensampler  # noqa: F401
except ImportError:  # run from a checkout without PYTHONPATH=src
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tokensampler.tools import bench  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "gpu.json"
ARMS = ("copy_floor", "amax_floor", "kernels", "torch_sampler", "sort_pipeline", "flashinfer")


def fail(message: str) -> None:
    print(f"benchmarks/gpu.py: {message}", file=sys.stderr)
    raise SystemExit(2)


class Arm:
    """One way of doing the step, made ready to time: a CUDA graph replay when it can be captured."""

    def __init__(self, fn: Callable[[], object], graph: bool) -> None:
        self.mode = "eager"
        self.run = fn
        fn()  # warm-up: compiles kernels, sizes buffers, uploads slot indices
        torch.cuda.synchronize()
        if graph:
            try:
                cuda_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(cuda_graph):
                    fn()
                torch.cuda.synchronize()
                self.run, self.mode = cuda_graph.replay, "graph"
            except Exception as exc:  # noqa: BLE001 - an arm that cannot be captured is timed eagerly
                self.mode = f"eager (capture failed: {type(exc).__name__})"
                torch.cuda.synchronize()

    def time_ms(self, iters: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            self.run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters


def flashinfer_step(case: bench.BenchCase, logits: torch.Tensor):
    """The FlashInfer arm for cases with top-k or top-p (None otherwise or when not installed)."""
    p = case.params
    if p.get("temperature", 1.0) == 0.0 or (p.get("top_k", 0) == 0 and p.get("top_p", 1.0) == 1.0):
        return None
    try:
        from flashinfer.sampling import top_k_top_p_sampling_from_logits
    except ImportError:
        return None
    batch, vocab = logits.shape
    top_k = torch.full((batch,), p.get("top_k", 0) or vocab, dtype=torch.int32, device=logits.device)
    top_p = torch.full((batch,), p.get("top_p", 1.0), dtype=torch.float32, device=logits.device)
    temperature = p.get("temperature", 1.0)

    def step():
        return top_k_top_p_sampling_from_logits(logits / temperature, top_k, top_p, deterministic=True)
    return step


def run_case(case: bench.BenchCase, rounds: int, iters: int, device: torch.device | None = None) -> dict:
    device = device or torch.device("cuda")
    logits = bench.make_logits(case.batch, case.vocab, flat=case.flat, device=device)
    prompts, outputs = bench.make_histories(case)
    equal, rows = bench.check_against_reference(case, logits, prompts, outputs, device)
    copy_target = torch.empty_like(logits)
    kernel_sampler = bench.build_sampler(case, device, prompts, outputs, backend="auto")
    counts = prompt_mask = None
    if case.history:
        counts = torch.zeros(case.batch, case.vocab, device=device)
        counts.scatter_add_(1, torch.tensor(outputs, device=device),
                            torch.ones(case.batch, bench.OUTPUT_LEN, device=device))
        prompt_mask = torch.zeros(case.batch, case.vocab, dtype=torch.bool, device=device)
        prompt_mask.scatter_(1, torch.tensor(prompts, device=device), True)
    makers: dict[str, tuple[Callable[[], object] | None, bool]] = {
        "copy_floor": (lambda: copy_target.copy_(logits), True),
        "amax_floor": (lambda: logits.amax(dim=-1), True),
        "kernels": (lambda: kernel_sampler.sample(logits), True),
        "sort_pipeline": (lambda: bench.sort_pipeline_step(logits, case, counts, prompt_mask, None), True),
        "flashinfer": (flashinfer_step(case, logits), True),
    }
    arms: dict[str, Arm] = {}
    errors: dict[str, str] = {}
    for name, (fn, graph) in makers.items():
        if fn is None:
            continue
        try:
            arms[name] = Arm(fn, graph)
        except Exception as exc:  # noqa: BLE001 - recorded in the JSON, the other arms still run
            errors[name] = f"{type(exc).__name__}: {exc}"
    try:
        torch_sampler = bench.build_sampler(case, device, prompts, outputs, backend="torch")
        arms["torch_sampler"] = Arm(lambda: torch_sampler.sample(logits), graph=False)
    except Exception as exc:  # noqa: BLE001
        errors["torch_sampler"] = f"{type(exc).__name__}: {exc}"
    runs: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, arm in arms.items():
            runs[name].append(arm.time_ms(iters))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    ratios = {}
    if "kernels" in medians:
        ratios["kernels_over_copy_floor"] = medians["kernels"] / medians["copy_floor"]
        ratios["kernels_over_amax_floor"] = medians["kernels"] / medians["amax_floor"]
        for other in ("sort_pipeline", "torch_sampler", "flashinfer"):
            if other in medians:
                ratios[f"{other}_over_kernels"] = medians[other] / medians["kernels"]
    return {"case": case.name, "batch": case.batch, "vocab": case.vocab, "params": case.params,
            "flat": case.flat, "history": case.history, "rounds": rounds, "iters": iters,
            "median_ms": medians, "runs_ms": runs, "timing": {name: arm.mode for name, arm in arms.items()},
            "ratios": ratios, "errors": errors, "reference_rows_equal": equal, "rows": rows}


def format_table(results: list[dict]) -> str:
    lines = ["| case | kernels ms | copy floor ms | kernels / copy | sort / kernels | flashinfer / kernels | "
             "tokens = reference |", "|---|---|---|---|---|---|---|"]
    for r in results:
        m, q = r["median_ms"], r["ratios"]

        def cell(key: str, fmt: str = "{:.1f}x") -> str:
            return fmt.format(q[key]) if key in q else "-"
        lines.append(f"| {r['case']} | {m.get('kernels', float('nan')):.4f} | {m['copy_floor']:.4f} | "
                     f"{cell('kernels_over_copy_floor')} | {cell('sort_pipeline_over_kernels')} | "
                     f"{cell('flashinfer_over_kernels')} | {r['reference_rows_equal']}/{r['rows']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: the whole matrix)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=20, help="calls per timed round")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        fail("needs a CUDA device (torch.cuda.is_available() is False); nothing was measured")
    try:
        import triton
    except ImportError:
        fail("needs Triton (pip install 'tokensampler[triton]'); nothing was measured")
    names = None if args.cases is None else [c.strip() for c in args.cases.split(",") if c.strip()]
    known = {c.name for c in bench.WORKLOAD_MATRIX}
    if names is not None and set(names) - known:
        fail(f"unknown cases {sorted(set(names) - known)}; the matrix has {sorted(known)}")
    cases = [c for c in bench.WORKLOAD_MATRIX if names is None or c.name in names]
    results = []
    for i, case in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {case.name} (B={case.batch}, V={case.vocab}) ...", file=sys.stderr, flush=True)
        results.append(run_case(case, args.rounds, args.iters))
        r = results[-1]
        print(f"    {', '.join(f'{k} {v:.4f} ms' for k, v in r['median_ms'].items())}; "
              f"reference {r['reference_rows_equal']}/{r['rows']}", file=sys.stderr, flush=True)
    machine = bench.machine_info(torch.device("cuda"))
    machine["triton"] = triton.__version__
    try:
        import flashinfer
        machine["flashinfer"] = getattr(flashinfer, "__version__", "installed")
    except ImportError:
        machine["flashinfer"] = None
    payload = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine,
               "results": results}
    with open(args.json, "w") as fh:
        json.dump(payload, fh, indent=1)
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
