"""The `tokensampler` command line: `tokensampler bench` (the main job) and friends.

Each subcommand is a (build parser, run) pair in `SUBCOMMANDS`; modules that own a subcommand
provide both functions, and this file only wires them.

User errors (a bad flag, a bad value, a library `TokenSamplerError`) are one line on stderr and exit
status 2, with no traceback; every argument (paths, counts, devices, case names) is checked before
any work starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn, Sequence

from ..core.checks import check_device, check_int
from ..core.errors import InvalidSamplingParams, TokenSamplerError
from . import bench, bench_admission, bench_distributed, bench_speculative, bench_warmup, generate_command, smollm2
from .workloads import LLAMA_CPP_CASES, SAMPLER_CASES, WORKLOAD_MATRIX

USAGE_ERROR = 2  # the exit status of every user error (argparse's)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is one line on stderr (exit status 2), like every other
    user error of the command (the subcommands' parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def one_line(error: BaseException) -> str:
    """The error's message on one line."""
    return " ".join(str(error).split()) or type(error).__name__


def check_output_file(flag: str, path: str) -> None:
    """`path` can be written: not a directory, in an existing directory this user may write (checked
    before any work, so a long run does not fail at its end)."""
    target = Path(path)
    if path == "" or target.is_dir():
        raise InvalidSamplingParams(flag, path, "a file path (not a directory)")
    parent = target.parent
    if not parent.is_dir():
        raise InvalidSamplingParams(flag, path, f"a file in an existing directory ({str(parent)!r} is not one)")
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise InvalidSamplingParams(flag, path, "a file this user can write")


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser("bench", help="time the workload matrix and check it against the reference")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds: about a minute")
    parser.add_argument("--json", dest="json_path", default=None, help="write the results as JSON here")
    parser.add_argument("--case", dest="cases", action="append", default=None,
                        help="run only this case (repeatable); default: the whole matrix")
    parser.add_argument("--samplers", action="store_true",
                        help="time the sampler cases (each full-row sampler and DRY on top of top-p 0.95, a mixed "
                             "batch, and plain top-p 0.95 to compare with) instead of the workload matrix")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per arm (default 7, quick 3)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for every arm (default: torch's default)")
    parser.add_argument("--against", choices=["vllm", "llama.cpp"], default=None,
                        help="add a column with this peer's own sampler (omitted with a note if not importable); "
                             "llama.cpp runs its own B=1 cases (bench_llama_cpp.py) unless --case names others")
    parser.add_argument("--world", type=int, default=None,
                        help="split the vocabulary over N gloo ranks on this machine (bench_distributed.py)")
    parser.add_argument("--warmup", action="store_true",
                        help="measure Sampler.warmup: cold and warm-cache seconds in fresh processes, then the first "
                             "call over the second for every batch size up to --max-slots (bench_warmup.py)")
    parser.add_argument("--max-slots", type=int, default=None,
                        help="with --warmup: the sampler's slots (default 64; --quick samples 1,3,7,13,21,29 and it)")
    parser.add_argument("--speculative", action="store_true",
                        help="time speculative verification (cases speculative_match, speculative_rejection: "
                             "B=32, K=4, V=151936) against the plain step run K+1 times (bench_speculative.py)")
    parser.add_argument("--contention", type=int, default=0, metavar="N",
                        help="also time every round beside N busy processes (each spins on one core) and "
                             "report each case's contended / quiet ratio (default 0: quiet only); with "
                             "--admission, each round's second admission")
    parser.add_argument("--admission", action="store_true",
                        help="time SamplingGenerator.apply_prefill_state admitting 1, 32, 256 and 1,024 requests "
                             "into as many lanes (CPU, V=32000; bench_admission.py); --quick's report includes it")
    return parser


def check_bench_args(args: argparse.Namespace) -> None:
    """Every `tokensampler bench` argument, before any work: raises a `TokenSamplerError` naming the flag."""
    check_device("--device", args.device)
    for flag, value in (("--rounds", args.rounds), ("--threads", args.threads), ("--world", args.world),
                        ("--max-slots", args.max_slots)):
        if value is not None:
            check_int(flag, value, 1, allowed="an int >= 1")
    check_int("--contention", args.contention, 0, allowed="an int >= 0")
    # --contention times the plain matrix or the admissions, --against llama.cpp the plain matrix
    other_mode = args.warmup or args.world is not None or args.speculative or args.admission
    if args.contention and (args.warmup or args.world is not None or args.speculative):
        raise InvalidSamplingParams("--contention", args.contention, "0 with --warmup, --world or --speculative "
                                    "(it times the workload matrix, or the admissions)")
    if args.json_path is not None:
        check_output_file("--json", args.json_path)
    if args.against == "llama.cpp" and other_mode:
        raise InvalidSamplingParams("--against", args.against, "no llama.cpp with --warmup, --world, --speculative "
                                    "or --admission (its column times the plain step)")
    if args.samplers and (other_mode or args.against is not None):
        raise InvalidSamplingParams("--samplers", True, "alone, or with --case, --quick, --rounds, --threads, "
                                    "--contention, --json (the sampler cases time the plain step)")
    if not args.cases:
        return
    plain = [c.name for c in (SAMPLER_CASES if args.samplers else WORKLOAD_MATRIX)]
    if args.against == "llama.cpp":
        plain += [c.name for c in LLAMA_CPP_CASES]
    speculative = [c.name for c in bench_speculative.SPECULATIVE_CASES]
    if args.warmup:
        raise InvalidSamplingParams("--case", args.cases, "no --case with --warmup (it times one sampler over "
                                    "every batch size)")
    if args.admission:
        raise InvalidSamplingParams("--case", args.cases, "no --case with --admission (it times admissions of "
                                    "1, 32, 256 and 1,024 requests)")
    if args.world is not None:
        names, what = plain, "cases of the workload matrix (with --world)"
    elif args.speculative or all(name in speculative for name in args.cases):
        names, what = speculative, "speculative cases"
    else:
        names, what = plain, "cases of the workload matrix, or only speculative cases"
    unknown = [name for name in args.cases if name not in names]
    if unknown:
        others = f"; speculative: {', '.join(speculative)}" if names is plain and args.world is None else ""
        raise InvalidSamplingParams("--case", unknown[0] if len(unknown) == 1 else unknown,
                                    f"{what}: {', '.join(names)}{others}")


def run_bench_command(args: argparse.Namespace) -> int:
    check_bench_args(args)  # before any work: no round runs with a bad argument
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    if args.warmup:
        result = bench_warmup.run_warmup_bench(max_slots=args.max_slots or bench_warmup.MAX_SLOTS, quick=args.quick)
        print(bench_warmup.format_warmup_table(result))
        if args.json_path:
            bench_warmup.write_json(result, args.json_path)
        return 0 if result["prepared_after_warmup"] == 0 and not result["dynamo_counters_changed"] else 1
    if args.admission:
        report = bench_admission.run_admission_bench(rounds=args.rounds, quick=args.quick,
                                                     contention=args.contention)
        print(bench_admission.format_admission_table(report))
        if args.json_path:
            bench_admission.write_json(report, args.json_path)
        return 0
    if args.world is not None:
        results = bench_distributed.run_world_bench(args.world, quick=args.quick, cases=args.cases,
                                                    rounds=args.rounds, json_path=args.json_path)
        print(bench_distributed.format_world_table(results))
        return 0 if all(r["steps_tokens_equal"] == r["steps"] for r in results) else 1
    if args.speculative or (args.cases and all(bench_speculative.is_speculative_case(c) for c in args.cases)):
        results = bench_speculative.run_bench(device=args.device, quick=args.quick, json_path=args.json_path,
                                              cases=args.cases, rounds=args.rounds, against=args.against)
        print(bench_speculative.format_table(results))
        bad = [r["case"] for r in results if r.get("rows_equal", r["batch"]) != r["batch"] or not r["ids_valid"]]
        if bad:
            print(f"speculative tokens differ from the plain sampler stepped in: {', '.join(bad)}", file=sys.stderr)
        return 1 if bad else 0
    # --quick's report (the whole matrix) also times admissions: a few seconds on the CPU
    admission = (bench_admission.run_admission_bench(quick=True) if args.quick and not args.cases
                 and not args.samplers else None)
    results = bench.run_bench(device=args.device, quick=args.quick, json_path=args.json_path,
                              matrix=SAMPLER_CASES if args.samplers else WORKLOAD_MATRIX,
                              cases=args.cases, rounds=args.rounds, against=args.against,
                              extra=None if admission is None else {"admission": admission},
                              contention=args.contention)
    print(bench.format_table(results))
    if admission is not None:
        print("\n" + bench_admission.format_admission_table(admission))
    mismatched = [r["case"] for r in results if r["reference_rows_equal"] != r["rows"]]
    if mismatched:
        print(f"tokens differ from reference.py in: {', '.join(mismatched)}", file=sys.stderr)
        return 1
    return 0


SUBCOMMANDS: list[tuple[Callable[[argparse._SubParsersAction], argparse.ArgumentParser],
                        Callable[[argparse.Namespace], int]]] = [
    (add_bench_parser, run_bench_command),
    (generate_command.add_generate_parser, generate_command.run_generate_command),
    (smollm2.add_parser, smollm2.run),
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="tokensampler", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for build, run in SUBCOMMANDS:
        build(sub).set_defaults(run=run)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except TokenSamplerError as error:  # a user error: one line, no traceback
        print(f"tokensampler {args.command}: error: {one_line(error)}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
