"""The bench's workload matrix: its cases, LLM-shaped logits and request histories."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.params import SamplingParams

PROMPT_LEN = 512
OUTPUT_LEN = 256


@dataclass(frozen=True)
class BenchCase:
    """One row of the workload matrix: all rows of the batch share `params`."""

    name: str
    batch: int
    vocab: int
    params: dict = field(default_factory=dict)
    flat: bool = False
    history: bool = False  # admit each row with a 512-token prompt and 256 output tokens
    bitmask_allowed: int = 0  # > 0: every step gets a token bitmask allowing this many ids per row
    mix: tuple[dict, ...] = ()  # non-empty: row r gets mix[r % len(mix)] instead of `params`
    repeating: int = 0  # > 0: each row's prompt is this many tokens of repeated phrases (DRY's matches)
    baseline: dict | None = None  # the parameters of a step timed in the same rounds, to compare with

    def row_params(self, row: int) -> dict:
        return self.mix[row % len(self.mix)] if self.mix else self.params

    def sampling_params(self, seed: int, row: int = 0) -> SamplingParams:
        return SamplingParams(seed=seed, **self.row_params(row))


WORKLOAD_MATRIX: tuple[BenchCase, ...] = (
    BenchCase("greedy", 32, 151936, {"temperature": 0.0}),
    BenchCase("temp", 32, 151936, {"temperature": 0.8}),
    BenchCase("topk50", 32, 151936, {"temperature": 0.8, "top_k": 50}),
    BenchCase("topp0.9", 32, 151936, {"temperature": 0.8, "top_p": 0.9}),
    BenchCase("topp0.9_flat", 32, 151936, {"temperature": 1.0, "top_p": 0.9}, flat=True),
    BenchCase("k20_p0.95", 32, 151936, {"temperature": 0.7, "top_k": 20, "top_p": 0.95}),
    BenchCase("minp0.05", 32, 151936, {"temperature": 1.0, "min_p": 0.05}),
    BenchCase("penalties_topp", 32, 151936, {"temperature": 0.8, "top_p": 0.9, "presence_penalty": 0.5,
                                              "frequency_penalty": 0.3, "repetition_penalty": 1.1}, history=True),
    BenchCase("logprobs20_topp", 32, 151936, {"temperature": 0.8, "top_p": 0.9, "logprobs": 20}),
    BenchCase("B1_V248k_topp", 1, 248320, {"temperature": 1.0, "top_p": 0.95}),
    BenchCase("B128_V128k_k20_p0.95", 128, 128256, {"temperature": 1.0, "top_k": 20, "top_p": 0.95}),
    # a grammar's token bitmask (xgrammar's int32 layout), 4096 ids allowed per row; its twin is topp0.9
    BenchCase("bitmask_topp0.9", 32, 151936, {"temperature": 0.8, "top_p": 0.9}, bitmask_allowed=4096),
)

# Samplers beyond top-p (docs/semantics.md), each with llama.cpp-like values on top of TOPP95, the
# plain top-p 0.95 case they are compared with (`run_bench(matrix=SAMPLER_CASES)`). One line per sampler.
TOPP95 = {"temperature": 1.0, "top_p": 0.95}
FULL_ROW_SAMPLERS: dict[str, dict] = {
    "top_n_sigma1": {"top_n_sigma": 1.0},
    "typical0.9": {"typical_p": 0.9},
    "epsilon3e-4": {"epsilon_cutoff": 3e-4},
    "eta1e-3": {"eta_cutoff": 1e-3},
    "dynatemp0.5": {"dynatemp_range": 0.5},
    "xtc0.5_0.1": {"xtc_probability": 0.5, "xtc_threshold": 0.1},
    "mirostat5": {"mirostat_tau": 5.0, "mirostat_eta": 0.1},
}
SAMPLER_CASES: tuple[BenchCase, ...] = (
    BenchCase("topp0.95", 32, 151936, TOPP95),
    *(BenchCase(f"{name}_topp0.95", 32, 151936, {**TOPP95, **extra}, baseline=TOPP95)
      for name, extra in FULL_ROW_SAMPLERS.items()),
    # rows cycling through every sampler above and plain top-p
    BenchCase("mixed_samplers_topp0.95", 32, 151936, TOPP95,
              mix=tuple({**TOPP95, **extra} for extra in (*FULL_ROW_SAMPLERS.values(), {})), baseline=TOPP95),
    # DRY on a 4,096-token history of repeated phrases, llama.cpp's suggested settings, 3 breaker ids
    BenchCase("dry0.8_topp0.95", 32, 151936,
              {**TOPP95, "dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2,
               "dry_sequence_breakers": ((198,), (25,), (1,))}, repeating=4096, baseline=TOPP95),
)


# `--against llama.cpp`: B=1 at SmolLM2's, Qwen's and Gemma's vocabulary sizes, llama.cpp's default chain
# (common_params_sampling: penalties off, top-k 40, top-p 0.95, min-p 0.05, temperature 0.8) and
# top-k 20 + top-p 0.95 at temperature 1 (tools/bench_llama_cpp.py)
LLAMA_CPP_VOCABS = (49152, 151936, 248320)
LLAMA_CPP_CASES: tuple[BenchCase, ...] = tuple(
    BenchCase(f"{name}_V{vocab // 1000}k", 1, vocab, params)
    for name, params in (("llama_default", {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}),
                         ("k20_p0.95", {"temperature": 1.0, "top_k": 20, "top_p": 0.95}))
    for vocab in LLAMA_CPP_VOCABS)


def make_logits(batch: int, vocab: int, *, flat: bool = False, seed: int = 0,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """LLM-shaped logits: per row `18 - s*ln(rank) + N(0, 0.7^2)` under a random permutation,
    s = 2.2 (peaked) or 1.0 (flat). float32 [batch, vocab]."""
    gen = torch.Generator().manual_seed(seed)
    slope = 1.0 if flat else 2.2
    profile = 18.0 - slope * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    rows = []
    for _ in range(batch):
        values = profile + 0.7 * torch.randn(vocab, generator=gen)
        rows.append(values[torch.randperm(vocab, generator=gen)])
    return torch.stack(rows).to(device)


def make_bitmask(logits: torch.Tensor, allowed: int, seed: int = 2) -> torch.Tensor:
    """A grammar-like token bitmask for `logits` ([B, V]): per row the 32 most likely ids (the model
    usually wants a token the grammar allows) and random others, `allowed` in all. int32 [B, ceil(V / 32)]
    in xgrammar's layout (bit j of word w allows id 32 w + j), on the logits' device."""
    batch, vocab = logits.shape
    gen = torch.Generator().manual_seed(seed)
    keep = torch.zeros(batch, 32 * -(-vocab // 32), dtype=torch.bool)
    top = logits.detach().cpu().topk(min(32, allowed, vocab), dim=-1).indices
    keep.scatter_(1, top, True)
    for row in range(batch):
        missing = allowed - int(keep[row].sum())
        if missing > 0:
            free = torch.nonzero(~keep[row, :vocab]).squeeze(-1)
            keep[row, free[torch.randperm(free.numel(), generator=gen)[:missing]]] = True
    weights = torch.tensor([1 << j for j in range(31)] + [-(1 << 31)], dtype=torch.int64)
    words = (keep.view(batch, -1, 32).to(torch.int64) * weights).sum(dim=-1)
    return words.to(torch.int32).to(logits.device)


def make_histories(case: BenchCase, seed: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """Per-row prompt and output token ids for the penalty cases and the repeating ones (empty otherwise)."""
    if case.repeating:
        return [repeated_phrases(case.vocab, case.repeating, seed + row) for row in range(case.batch)], \
            [[] for _ in range(case.batch)]
    if not case.history:
        return [[] for _ in range(case.batch)], [[] for _ in range(case.batch)]
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, case.vocab, (case.batch, PROMPT_LEN), generator=gen).tolist()
    outputs = torch.randint(0, case.vocab, (case.batch, OUTPUT_LEN), generator=gen).tolist()
    return prompts, outputs


def repeated_phrases(vocab: int, length: int, seed: int) -> list[int]:
    """`length` tokens like a model's repetitive output: phrases of 4-24 tokens from a pool of 64,
    each picked again and again, with one random token in ten between them."""
    gen = torch.Generator().manual_seed(seed)
    pool = [torch.randint(0, vocab, (int(torch.randint(4, 25, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(64)]
    out: list[int] = []
    while len(out) < length:
        out += pool[int(torch.randint(0, len(pool), (1,), generator=gen))]
        if int(torch.randint(0, 10, (1,), generator=gen)) == 0:
            out.append(int(torch.randint(0, vocab, (1,), generator=gen)))
    return out[:length]
