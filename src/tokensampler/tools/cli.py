"""The `tokensampler` command line: `tokensampler bench` (the main job) and friends.

Each subcommand is a (build parser, run) pair in `SUBCOMMANDS`; modules that own a subcommand
provide both functions, and this file only wires them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from ..core.errors import TokenSamplerError
from . import bench, bench_distributed, generate_command, smollm2


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser("bench", help="time the workload matrix and check it against the reference")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds: about a minute")
    parser.add_argument("--json", dest="json_path", default=None, help="write the results as JSON here")
    parser.add_argument("--case", dest="cases", action="append", default=None,
                        help="run only this case (repeatable); default: the whole matrix")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per arm (default 7, quick 3)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for every arm (default: torch's default)")
    parser.add_argument("--against", choices=["vllm"], default=None,
                        help="add a column with this peer's own sampler (omitted with a note if not importable)")
    parser.add_argument("--world", type=int, default=None,
                        help="split the vocabulary over N gloo ranks on this machine (bench_distributed.py)")
    return parser


def run_bench_command(args: argparse.Namespace) -> int:
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    if args.world is not None:
        results = bench_distributed.run_world_bench(args.world, quick=args.quick, cases=args.cases,
                                                    rounds=args.rounds, json_path=args.json_path)
        print(bench_distributed.format_world_table(results))
        return 0 if all(r["steps_tokens_equal"] == r["steps"] for r in results) else 1
    results = bench.run_bench(device=args.device, quick=args.quick, json_path=args.json_path,
                              cases=args.cases, rounds=args.rounds, against=args.against)
    print(bench.format_table(results))
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
    parser = argparse.ArgumentParser(prog="tokensampler", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for build, run in SUBCOMMANDS:
        build(sub).set_defaults(run=run)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except TokenSamplerError as error:  # a user error: one line, no traceback
        print(f"tokensampler {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
