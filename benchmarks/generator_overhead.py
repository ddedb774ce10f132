"""What the `SamplingGenerator` bookkeeping costs on top of a bare `Sampler.sample`, side by side.

Arms, alternated round by round on the same logits tensor (medians over the rounds; ratios are
what to compare on a shared machine):
  floor      logits.amax(-1)
  sampler    Sampler.sample(logits)                                     (no contract bookkeeping)
  generator  apply_decode_state(no commands) + SamplingGenerator.sample(logits)
  rebuild    apply_decode_state(reload + reset, full histories)         (a mode/layout transition)

    PYTHONPATH=src python benchmarks/generator_overhead.py [--batch 32] [--vocab 32000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokensampler import Sampler, SamplingParams
from tokensampler.engine import BatchSamplingParams, SamplingGenerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--outputs", type=int, default=128)
    args = parser.parse_args()
    batch, vocab = args.batch, args.vocab
    gen_rng = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.3, seed=1000 + b) for b in range(batch)]
    prompts = torch.randint(0, vocab, (batch, args.prompt), generator=gen_rng)
    outputs = torch.randint(0, vocab, (batch, args.outputs), generator=gen_rng)
    logits = torch.randn(batch, vocab, generator=gen_rng) * 3

    sampler = Sampler(vocab, max_slots=batch)
    for b in range(batch):
        sampler.add_request(b, params[b], prompts[b].tolist(), output_token_ids=outputs[b].tolist())
    gen = SamplingGenerator(vocab, max_batch_size=batch, device="cpu")
    chunks = [BatchSamplingParams.from_requests(params)]
    gen.apply_prefill_state(sampling_params=chunks[0], prompt_tokens=prompts, empty_slots=list(range(batch)))
    gen.apply_decode_state(chunks, reload_sampling_params=True, reset_sampling_state=True,
                           prompt_tokens=prompts, output_tokens=outputs)

    arms = {
        "floor": lambda: logits.amax(-1),
        "sampler": lambda: sampler.sample(logits),
        "generator": lambda: (gen.apply_decode_state(chunks, reload_sampling_params=False, reset_sampling_state=False),
                              gen.sample(logits)),
        "rebuild": lambda: gen.apply_decode_state(chunks, reload_sampling_params=True, reset_sampling_state=True,
                                                  prompt_tokens=prompts, output_tokens=outputs),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for name, arm in arms.items():  # warm-up
        arm()
    for _ in range(args.rounds):
        for name, arm in arms.items():
            start = time.perf_counter()
            arm()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"B={batch} V={vocab} rounds={args.rounds} threads={torch.get_num_threads()}")
    print(f"{'arm':<10} {'median ms':>10} {'x floor':>8} {'x sampler':>10}")
    for name, value in median.items():
        print(f"{name:<10} {value * 1e3:>10.3f} {value / median['floor']:>8.1f} {value / median['sampler']:>10.2f}")


if __name__ == "__main__":
    main()
