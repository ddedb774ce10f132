"""A two-rank gloo job (run by torchrun) that samples through a split `Sampler` and a split
`SamplingGenerator`, destroys its process group and exits: tests/split/test_clean_exit.py runs it
repeatedly and requires exit status 0 from both ranks."""

import torch
import torch.distributed as dist

from tokensampler import BatchSamplingParams, Sampler, SamplingGenerator, SamplingParams

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
vocab, padded = 1000, 1024
width = padded // world
logits = torch.randn(4, padded, generator=torch.Generator().manual_seed(0))
mine = logits[:, rank * width:(rank + 1) * width].contiguous()
sampler = Sampler(vocab, max_slots=4, padded_vocab_size=padded, group=dist.group.WORLD)
for slot in range(4):
    sampler.add_request(slot, SamplingParams(temperature=0.8, top_p=0.9, seed=slot, logprobs=2), [1, 2, 3])
for _ in range(3):
    sampler.sample(mine)
generator = SamplingGenerator(vocab, max_batch_size=4, padded_vocab_size=padded, device="cpu", group=dist.group.WORLD)
generator.apply_prefill_state(sampling_params=BatchSamplingParams.from_requests([SamplingParams(seed=3)] * 2),
                              prompt_tokens=torch.tensor([[1, 2], [3, 4]]), empty_slots=[0, 1])
generator.sample(mine)
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
