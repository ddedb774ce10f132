"""The tokens of the whole `tokensampler bench` matrix, written down, to compare two checkouts exactly.

For every case of `tokensampler.tools.workloads.WORKLOAD_MATRIX` (the bench's logits, histories and
bitmask), a sampler holding the case's rows samples `--steps` steps of the same logits (each step
advances every slot's position, so each step draws new noise); every token id, validity flag and
logprob (raw, and the processed mode on a second sampler) is recorded. Each case runs with the
default torch step and with every route forced by `TorchStepConfig`: the block route only
(`direct_route=False`) and the dense route for every sampled row (`candidate_cap=0`).

    python benchmarks/bench_tokens.py --out after.json                 # this checkout
    PYTHONPATH=<old checkout>/src python benchmarks/bench_tokens.py --out before.json
    python benchmarks/bench_tokens.py --compare before.json after.json  # exit 1 on any difference

Only the public `Sampler` API is used, and the config's name is looked up under both names it has
had, so the same script runs on an older checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from typing import Any

import torch

from tokensampler import Sampler
from tokensampler.tools.workloads import WORKLOAD_MATRIX, BenchCase, make_bitmask, make_histories, make_logits


def _config_kwargs(variant: str) -> dict[str, Any]:
    """The sampler keyword forcing `variant` ("default", "block", "dense"), under either name."""
    if variant == "default":
        return {}
    fields = {"block": {"direct_route": False}, "dense": {"candidate_cap": 0}}[variant]
    try:
        from tokensampler.backends.torch_step.config import TorchStepConfig
        return {"step_config": TorchStepConfig(**fields)}
    except ImportError:
        from tokensampler.backends.native.config import NativeConfig
        return {"native_config": NativeConfig(**fields)}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def case_tokens(case: BenchCase, variant: str, steps: int, logprobs_mode: str) -> dict[str, Any]:
    """Token ids and validity of each step (lists), and digests of the logprobs output."""
    logits = make_logits(case.batch, case.vocab, flat=case.flat)
    prompts, outputs = make_histories(case)
    bitmask = make_bitmask(logits, case.bitmask_allowed) if case.bitmask_allowed else None
    sampler = Sampler(case.vocab, max_slots=case.batch, logprobs_mode=logprobs_mode, **_config_kwargs(variant))
    for row in range(case.batch):
        sampler.add_request(row, case.sampling_params(seed=1000 + row), prompts[row], output_token_ids=outputs[row])
    record: dict[str, Any] = {"tokens": [], "valid": [], "logprobs": []}
    for _ in range(steps):
        out = sampler.sample(logits.clone(), token_bitmask=bitmask)
        record["tokens"].append(out.token_ids.tolist())
        record["valid"].append(out.valid.tolist())
        if out.logprobs is not None:
            record["logprobs"].append([_digest(getattr(out.logprobs, f.name))
                                       for f in dataclasses.fields(out.logprobs)])
    return record


def collect(steps: int, variants: list[str], cases: list[str] | None) -> dict[str, Any]:
    result = {}
    for case in WORKLOAD_MATRIX:
        if cases and case.name not in cases:
            continue
        for variant in variants:
            modes = ["raw_logprobs"] + (["processed_logprobs"] if "logprobs" in case.params else [])
            for mode in modes:
                key = f"{case.name}/{variant}/{mode}"
                result[key] = case_tokens(case, variant, steps, mode)
                print(key, "done", file=sys.stderr, flush=True)
    return result


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The keys (and the first differing step) where two recordings differ."""
    problems = [f"{key}: only in one file" for key in sorted(set(before) ^ set(after))]
    for key in sorted(set(before) & set(after)):
        for field in ("tokens", "valid", "logprobs"):
            if before[key][field] != after[key][field]:
                problems.append(f"{key}: {field} differ")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write this checkout's tokens here")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two recordings")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variants", default="default,block,dense")
    parser.add_argument("--case", action="append", help="only this case (repeatable)")
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.load(open(path)) for path in args.compare)
        problems = compare(before, after)
        rows = sum(len(r["tokens"]) * len(r["tokens"][0]) for r in before.values() if r["tokens"])
        print(f"{len(before)} recordings, {rows} tokens compared: "
              + ("identical" if not problems else f"{len(problems)} differ"))
        for line in problems:
            print(" ", line)
        return 1 if problems else 0
    if not args.out:
        parser.error("give --out or --compare")
    result = collect(args.steps, args.variants.split(","), args.case)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
