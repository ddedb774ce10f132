"""What a vocabulary-split `SamplingGenerator` step costs on top of a bare split `Sampler.sample`.

Forks `--world` gloo ranks on this machine (CPU); each rank holds `[B, V / world]` logits. Arms,
alternated round by round on the same logits (medians over the rounds, ratios side by side):
  sampler    Sampler(..., group).sample(slice)                            (no contract bookkeeping)
  generator  apply_decode_state(no commands) + SamplingGenerator(..., group).sample(slice)
The difference is the generator's bookkeeping and its per-call agreement all-gathers.

    PYTHONPATH=src python benchmarks/generator_split_overhead.py [--world 2] [--batch 8] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

from tokensampler import Sampler, SamplingParams
from tokensampler.engine import BatchSamplingParams, SamplingGenerator


def _rank(rank: int, world: int, init: str, out: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    group, vocab, batch = dist.group.WORLD, args.vocab, args.batch
    width = vocab // world
    params = [SamplingParams(seed=i, top_k=50, temperature=0.8, repetition_penalty=1.1) for i in range(batch)]
    prompts = torch.arange(batch * 4).reshape(batch, 4) % vocab
    gen = SamplingGenerator(vocab, max_batch_size=batch, device="cpu", group=group)
    gen.apply_prefill_state(sampling_params=BatchSamplingParams.from_requests(params), prompt_tokens=prompts,
                            empty_slots=list(range(batch)))
    chunks = BatchSamplingParams.from_requests(params)
    bare = Sampler(vocab, max_slots=batch, group=group)
    for slot, p in enumerate(params):
        bare.add_request(slot, p, prompts[slot].tolist())
    rng = torch.Generator().manual_seed(0)
    steps = [torch.randn(batch, vocab, generator=rng)[:, rank * width:(rank + 1) * width].contiguous()
             for _ in range(args.steps)]
    times: dict[str, list[float]] = {"sampler": [], "generator": []}
    for _ in range(args.rounds):
        for arm in times:
            dist.barrier()
            start = time.perf_counter()
            for logits in steps:
                if arm == "generator":
                    gen.apply_decode_state(chunks, reload_sampling_params=False, reset_sampling_state=False)
                    gen.sample(logits)
                else:
                    bare.sample(logits)
            times[arm].append((time.perf_counter() - start) / len(steps) * 1e3)
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(times, handle)
    dist.barrier()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(_rank, args=(args.world, os.path.join(tmp, "store"), out, args), nprocs=args.world,
                           join=True, start_method="fork")
        with open(out) as handle:
            times = json.load(handle)
    sampler, generator = statistics.median(times["sampler"]), statistics.median(times["generator"])
    print("| world | B | V | split Sampler ms/step | split generator ms/step | generator / Sampler |")
    print("|---|---|---|---|---|---|")
    ratio = generator / sampler
    print(f"| {args.world} | {args.batch} | {args.vocab} | {sampler:.2f} | {generator:.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
