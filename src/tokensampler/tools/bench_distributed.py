"""`tokensampler bench --world N`: sampling from a vocabulary split over N gloo ranks (CPU).

Per case and vocabulary size, two arms run in alternating rounds on every rank:

- split:  `Sampler(..., group=WORLD).sample(slice)` - a few small all-gathers per step;
- gather: all-gather the full logits `[B, Vp]` from the slices, then the unsplit `Sampler`.

Reported per case: median step time of both arms (rank 0's clock; the collectives keep ranks in
step), the payload bytes each rank receives per step for both arms (counted by wrapping the
collectives, so transport overhead is not included), the collectives per step, and whether the
split arm's tokens equal the gather arm's on every step. Bytes of the split arm must not grow
with V, so each case runs at two vocabulary sizes.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Sequence

import torch

from ..parallel.transport import TorchExchange
from ..sampler import Sampler
from .machine import machine_info
from .workloads import WORKLOAD_MATRIX, BenchCase, make_histories, make_logits

DEFAULT_VOCABS = (32000, 128256)
DEFAULT_BATCH = 8
WORLD_CASES = ("greedy", "topk50", "topp0.9", "k20_p0.95", "minp0.05", "penalties_topp", "logprobs20_topp")


def _cases(names: Sequence[str] | None, batch: int, vocabs: Sequence[int]) -> list[BenchCase]:
    by_name = {c.name: c for c in WORKLOAD_MATRIX}
    wanted = list(names) if names else list(WORLD_CASES)
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise ValueError(f"cases={unknown} are not in the workload matrix: {sorted(by_name)}")
    return [BenchCase(by_name[n].name, batch, v, by_name[n].params, by_name[n].flat, by_name[n].history)
            for n in wanted for v in vocabs]


def _padded(vocab: int, world: int) -> int:
    return -(-vocab // (64 * world)) * 64 * world  # every slice a multiple of 64 wide


def _admit(sampler: Sampler, case: BenchCase, prompts, outputs) -> None:
    for row in range(case.batch):
        sampler.add_request(row, case.sampling_params(seed=1000 + row), prompts[row], output_token_ids=outputs[row])


def _run_case(case: BenchCase, world: int, rank: int, rounds: int) -> dict[str, Any]:
    dist = torch.distributed
    padded = _padded(case.vocab, world)
    width = padded // world
    logits = torch.nn.functional.pad(make_logits(case.batch, case.vocab, flat=case.flat), (0, padded - case.vocab))
    mine = logits[:, rank * width:(rank + 1) * width].contiguous()
    prompts, outputs = make_histories(case)
    exchange = TorchExchange(dist.group.WORLD)
    split = Sampler(case.vocab, max_slots=case.batch, padded_vocab_size=padded, group=exchange)
    whole = Sampler(case.vocab, max_slots=case.batch, padded_vocab_size=padded)
    _admit(split, case, prompts, outputs)
    _admit(whole, case, prompts, outputs)
    gathered = [torch.empty_like(mine) for _ in range(world)]

    def gather_then_sample():
        dist.all_gather(gathered, mine)
        return whole.sample(torch.cat(gathered, dim=-1))

    times: dict[str, list[float]] = {"split": [], "gather": []}
    equal = steps = 0
    exchange.reset_counters()
    for _ in range(rounds + 1):  # the first round warms up and is not timed
        tokens = {}
        for name, fn in (("split", lambda: split.sample(mine)), ("gather", gather_then_sample)):
            dist.barrier()
            start = time.perf_counter()
            tokens[name] = fn().token_ids
            times[name].append((time.perf_counter() - start) * 1e3)
        equal += int(torch.equal(tokens["split"], tokens["gather"]))
        steps += 1
    return {
        "case": case.name, "batch": case.batch, "vocab": case.vocab, "padded_vocab": padded, "world": world,
        "params": case.params, "rounds": rounds,
        "median_ms": {name: statistics.median(values[1:]) for name, values in times.items()},
        "runs_ms": {name: values[1:] for name, values in times.items()},
        "split_bytes_received_per_step": exchange.bytes_received // steps,
        "split_bytes_sent_per_step": exchange.bytes_sent // steps,
        "split_collectives_per_step": exchange.calls / steps,
        "gather_bytes_received_per_step": (world - 1) * mine.numel() * mine.element_size(),
        "steps_tokens_equal": equal, "steps": steps,
    }


def _worker(rank: int, world: int, init_file: str, out_path: str, cases: list[BenchCase], rounds: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=600))
    results = []
    for i, case in enumerate(cases, 1):
        if rank == 0:
            print(f"[{i}/{len(cases)}] {case.name} (B={case.batch}, V={case.vocab}, world={world}) ...",
                  file=sys.stderr, flush=True)
        results.append(_run_case(case, world, rank, rounds))
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(results, handle)
    torch.distributed.destroy_process_group()


def run_world_bench(world: int, *, quick: bool = False, cases: Sequence[str] | None = None,
                    rounds: int | None = None, json_path: str | None = None,
                    vocabs: Sequence[int] = DEFAULT_VOCABS, batch: int = DEFAULT_BATCH) -> list[dict]:
    """Start `world` gloo ranks on this machine, run the cases, return rank 0's results."""
    import torch.multiprocessing as mp

    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world={world!r} is invalid: allowed an int >= 1")
    selected = _cases(cases, batch, vocabs)
    n_rounds = rounds if rounds is not None else (3 if quick else 7)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.json")
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), out_path, selected, n_rounds),
                           nprocs=world, join=True, start_method=method)
        with open(out_path) as handle:
            results = json.load(handle)
    if json_path:
        payload = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "machine": machine_info(torch.device("cpu")), "world": world, "backend": "gloo",
                   "quick": quick, "results": results}
        with open(json_path, "w") as handle:
            json.dump(payload, handle, indent=1)
    return results


def _kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:.2f} MiB"


def format_world_table(results: list[dict]) -> str:
    lines = ["| case | B | V | split ms | gather+sample ms | gather / split | split bytes in/step/rank "
             "| gather bytes in/step/rank | collectives/step | tokens equal |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["median_ms"]
        lines.append(f"| {r['case']} | {r['batch']} | {r['vocab']} | {m['split']:.2f} | {m['gather']:.2f} | "
                     f"{m['gather'] / m['split']:.2f}x | {_kib(r['split_bytes_received_per_step'])} | "
                     f"{_kib(r['gather_bytes_received_per_step'])} | {r['split_collectives_per_step']:.0f} | "
                     f"{r['steps_tokens_equal']}/{r['steps']} |")
    return "\n".join(lines)
