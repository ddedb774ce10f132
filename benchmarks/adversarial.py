"""Adversarial campaign: random inputs at the edges of the definition, through every path, against reference.py.

Each case draws a vocabulary (1..300 ids, padded with garbage columns that must never be sampled), a
dtype (fp32 / fp16 / bf16), logits salted with NaN, +-inf, +-3e38, denormals, -0.0 and float16
extremes (and whole rows of them), and per-row parameters at and around their bounds: temperature 0,
tiny and huge; top-k 0, 1, V, V+1, 2^62; top-p tiny and 1; min-p 0 and ~1; penalties at +-2 and
extreme repetition; logit bias +-100 and beyond (clamped); allowed ids; min_tokens with stop and EOS
ids; bad words; DRY; in a few rows the full-row samplers (dynamic temperature, top-n-sigma, typical-p,
epsilon, eta, XTC) and Mirostat v2 (each row's mu checked to the bit after every step); token
bitmasks; seeds, positions and streams at the ends of their ranges; logprobs in every mode. A few
values are deliberately invalid: the library must reject exactly those. Paths:

    sample   `tokensampler.sample`: stateless, one call per case, the default backend
    torch    `Sampler(backend="torch")`: the torch step, several steps, a random TorchStepConfig
    kernels  `Sampler(backend="triton")`: the Triton kernels in Triton's CPU interpreter (TRITON_INTERPRET=1)
    split2   `Sampler` with the vocabulary split over 2 ranks (one thread per rank, in-process all-gather)
    split3   the same over 3 ranks

Every token, validity flag and logprob is compared with `tokensampler.reference`: a batched
transcription of `reference_sample_row` checks every row, and `reference_sample_row` itself runs on a
share of the rows and on every row with a p or a mass exactly at a min-p or top-p bound (where the
two must agree exactly), and on every row where NaN arithmetic or the order of a float64 sum could
matter. One draw is one token of one row. A case is reproducible from (seed, path, index, and
`--step-scale`, the number of times more steps the cases of 2048 rows or more run): `--case torch:17`
reruns it and prints every finding. The generator, the batched oracle and the runner are the test
harness in tests/support/adversarial/; this command runs it and reports (a table, `--json`).

    python benchmarks/adversarial.py --draws 1000000 --seed 0 [--json out.json] [--paths sample,torch]
        [--budget sample=500000,kernels=2000] [--step-scale 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `tests.support`

import torch  # noqa: E402

from tests.support.adversarial.campaign import budgets, run_campaign, run_case, table  # noqa: E402
from tests.support.adversarial.cases import PATHS  # noqa: E402
from tests.support.adversarial.findings import Finding  # noqa: E402
from tests.support.adversarial.runner import COMPILE  # noqa: E402


def parse(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=1_000_000, help="draws in all (the kernels get a fixed share)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, from {','.join(PATHS)}")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--case", help="PATH:INDEX: run one case and print every finding")
    parser.add_argument("--kernel-draws", type=int, help="draws of the kernels path (default from --draws)")
    parser.add_argument("--budget", default="", help="PATH=DRAWS,...: these paths' draws instead of their "
                        "share of --draws")
    parser.add_argument("--step-scale", type=int, default=1, help="cases of 2048 rows or more run this many times "
                        "more steps (default 1; part of a case's definition, so give it to --case too)")
    parser.add_argument("--compile", action="store_true", help="the torch step's compiled reductions "
                        "(default: eager, every sampler made with compile=False)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    return parser, parser.parse_args(argv)


def one_case(args: argparse.Namespace) -> int:
    """--case PATH:INDEX: the case's shape, every finding and its tally."""
    path, index = args.case.split(":")
    torch.set_num_threads(args.threads)
    case, tally, log = run_case(args.seed, path, int(index), args.step_scale)
    print(f"case {path}:{index}: V={case.vocab} Vp={case.padded} {case.dtype} {case.mode} flavour={case.flavour} "
          f"rows={len(case.rows)} steps={case.steps} eos={case.eos} max_logprobs={case.max_logprobs}"
          f" step_config={case.step_config} kernel_config={case.kernel_config} call_error={case.call_error}")
    for finding in log.info + log.findings:
        print(finding.line(args.seed, args.step_scale))
    print(dataclasses.asdict(tally))
    return 1 if tally.failures else 0


def plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, int]:
    """Draws per path: --draws shared out, then --kernel-draws and --budget."""
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        parser.error(f"unknown paths {unknown}: choose from {PATHS}")
    out = budgets(args.draws, paths)
    if args.kernel_draws is not None and "kernels" in out:
        out["kernels"] = args.kernel_draws
    for item in filter(None, (part.strip() for part in args.budget.split(","))):
        name, _, draws = item.partition("=")
        if name not in out or not draws.isdigit():
            parser.error(f"--budget {item!r}: expected PATH=DRAWS with PATH among {list(out)}")
        out[name] = int(draws)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser, args = parse(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    COMPILE["compile"] = args.compile
    started = datetime.datetime.now(datetime.timezone.utc)
    if args.case:
        return one_case(args)
    draws = plan(parser, args)
    print(f"adversarial campaign, seed {args.seed}: {draws}", file=sys.stderr)
    report = run_campaign(draws, args.seed, progress=True, threads=args.threads, step_scale=args.step_scale)
    report.update(environment(args, argv, started))
    print(table(report))
    for finding in report["findings"][:10]:
        print(Finding(**finding).line(args.seed, args.step_scale))
    print(f"{report['total']['draws']:,} draws in {report['wall_seconds']:.0f} s "
          f"({report['cpu_seconds']:.0f} s of CPU); failures: {report['failures']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return 1 if report["failures"] else 0


def environment(args: argparse.Namespace, argv: Sequence[str] | None, started: datetime.datetime) -> dict[str, Any]:
    """The report's record of the command and the machine."""
    return {
        "command": "python benchmarks/adversarial.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": started.strftime("%Y-%m-%d %H:%M UTC"), "torch": torch.__version__,
        "triton": _version("triton"), "python": platform.python_version(), "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "threads": args.threads, "compile": args.compile, "step_scale": args.step_scale,
    }


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001 - not installed
        return None


if __name__ == "__main__":
    sys.exit(main())
