"""The adversarial cases: random logits and token bitmasks, `Case` (a function of seed, path and index), `make_case`."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.support.adversarial.menus import (
    BF16_MAX,
    F16_MAX,
    F16_MIN_DENORMAL,
    F16_MIN_NORMAL,
    F32_MAX,
    F32_MIN_DENORMAL,
    F32_MIN_NORMAL,
    NAN,
    NEG_INF,
    POS_INF,
    RowSpec,
    pick,
    row_spec,
)
from tests.support.backends import KERNELS
from tokensampler.backends.torch_step.config import TorchStepConfig
from tokensampler.backends.triton.config import KernelConfig

PATHS = ("sample", "torch", "kernels", "split2", "split3")
MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
SPECIALS = torch.tensor([NAN, POS_INF, NEG_INF, 3e38, -3e38, F32_MAX, -F32_MAX, F32_MIN_DENORMAL, -F32_MIN_DENORMAL,
                         1e-40, F32_MIN_NORMAL, -0.0, 0.0, F16_MAX, -F16_MAX, F16_MIN_NORMAL, F16_MIN_DENORMAL,
                         -F16_MIN_DENORMAL, BF16_MAX, -BF16_MAX, 1e-30, 88.72, -103.97, 1e4, -1e4, 1.0, -1.0],
                        dtype=torch.float32)
GARBAGE = torch.tensor([POS_INF, NAN, 3e38, F32_MAX, 1e4, 50.0, 0.0, NEG_INF], dtype=torch.float32)


def random_logits(r: random.Random, gen: torch.Generator, rows: int, vocab: int, padded: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """[rows, padded] logits: per row a base (normal at a random scale, ties, a constant, a few
    values, a peak, near ties at the top-p border), salted at a random rate with a palette of
    special values (NaN, +-inf, +-3e38, denormals, -0.0, float16 and bfloat16 extremes); a few whole
    rows of specials; padding columns of garbage (+inf, NaN, 3e38, ...) that must never be sampled."""
    scales = torch.tensor([0.01, 0.3, 1.0, 3.0, 8.0, 30.0, 100.0, 1e4, 1e30])
    scale = scales[torch.randint(0, len(scales), (rows, 1), generator=gen)]
    z = torch.randn(rows, padded, generator=gen) * scale
    kind = torch.randint(0, 8, (rows, 1), generator=gen)
    z = torch.where(kind == 1, torch.round(z), z)
    z = torch.where(kind == 2, torch.randn(rows, 1, generator=gen) * 3, z)
    few = torch.tensor([-1.0, 0.0, 1.0])[torch.randint(0, 3, (rows, padded), generator=gen)]
    z = torch.where(kind == 3, few * scale, z)
    peak = torch.randint(0, padded, (rows, 1), generator=gen)
    z = torch.where((kind == 4) & (torch.arange(padded)[None, :] == peak), z + 40.0, z)
    # near ties: distinct z = -j 2^-40 (j < Vp) whose float32 p = exp(z - max) are all exactly 1, so every
    # mass above an id is an integer and top_p * total (top_p = 1/2, 1/3, ...) can equal one exactly
    levels = torch.argsort(torch.rand(rows, padded, generator=gen), dim=1).to(torch.float32)
    z = torch.where(kind == 5, -levels * 2.0**-40, z)
    rates = torch.tensor([0.0, 0.0, 0.0, 0.01, 0.05, 0.2, 0.6, 0.95])
    rate = rates[torch.randint(0, len(rates), (rows, 1), generator=gen)]
    palette = torch.randint(0, len(SPECIALS), (rows, 3), generator=gen)
    salt = SPECIALS[palette.gather(1, torch.randint(0, 3, (rows, padded), generator=gen))]
    z = torch.where(torch.rand(rows, padded, generator=gen) < rate, salt, z)
    for b in range(rows):
        if r.random() < 0.04:
            what = r.randrange(9)
            row = z[b, :vocab]
            if what < 4:
                row[:] = (NEG_INF, NAN, POS_INF, 3e38)[what]
            elif what == 4:
                row[:] = torch.where(torch.rand(vocab, generator=gen) < 0.5, NAN, NEG_INF)
            elif what == 5:
                row[:] = -3e38
            elif what in (6, 7):
                keep = r.randrange(vocab)
                value = row[keep].clone() if what == 6 else torch.tensor(POS_INF)
                row[:] = NEG_INF
                row[keep] = value
            else:
                row[:] = -0.0
    if padded > vocab:
        junk = GARBAGE[torch.randint(0, len(GARBAGE), (rows, padded - vocab), generator=gen)]
        z[:, vocab:] = torch.where(torch.rand(rows, padded - vocab, generator=gen) < 0.2,
                                   torch.randn(rows, padded - vocab, generator=gen) * 1e4, junk)
    return z.to(dtype)


def random_bitmask(gen: torch.Generator, rows: int, vocab: int, extra_word: bool) -> torch.Tensor:
    """An int32 token bitmask [rows, W] (xgrammar's layout): per row few, most, all or no ids
    allowed; the bits of ids >= vocab are random (they must be ignored)."""
    words = -(-vocab // 32) + int(extra_word)
    density = torch.tensor([0.1, 0.7, 1.0, 0.0])[torch.randint(0, 4, (rows, 1), generator=gen)]
    bits = torch.rand(rows, 32 * words, generator=gen) < density
    bits[:, vocab:] = torch.rand(rows, 32 * words - vocab, generator=gen) < 0.5
    weights = torch.tensor([1 << j for j in range(31)] + [-(1 << 31)], dtype=torch.int64)
    return (bits.view(rows, words, 32).to(torch.int64) * weights).sum(-1).to(torch.int32)


def bitmask_bits(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab]: the ids a token bitmask allows."""
    ids = torch.arange(vocab)
    words = (mask.to(torch.int64) & 0xFFFFFFFF)[:, ids // 32]
    return ((words >> (ids % 32)) & 1).to(torch.bool)


# ------------------------------------------------------------------ cases
@dataclass
class Step:
    rows: list[int]  # indices into Case.rows
    logits: torch.Tensor  # [len(rows), padded]
    bitmask: torch.Tensor | None
    record: list[bool] | None


@dataclass
class Case:
    path: str
    index: int
    vocab: int
    padded: int
    dtype: torch.dtype
    mode: str
    max_logprobs: int
    eos: tuple[int, ...]
    flavour: str
    rows: list[RowSpec]
    slots: list[int]
    max_slots: int
    steps: int
    step_config: TorchStepConfig | None = None
    kernel_config: KernelConfig | None = None
    call_error: str | None = None  # `sample` path: a deliberately invalid call argument
    shared: bool = False  # `sample` path: one SamplingParams object for every row
    r: random.Random = field(default_factory=random.Random, repr=False)
    gen: torch.Generator = field(default_factory=torch.Generator, repr=False)

    @property
    def world(self) -> int:
        return int(self.path[len("split"):]) if self.path.startswith("split") else 1

    def step(self, t: int) -> Step:
        """Step t's rows, logits, bitmask and record mask (drawn in order from the case's generators)."""
        r, n = self.r, len(self.rows)
        rows = list(range(n))
        if t > 0 or self.path != "sample":
            if r.random() < 0.3:
                rows = r.sample(rows, r.randint(1, n))
        logits = random_logits(r, self.gen, len(rows), self.vocab, self.padded, self.dtype)
        bitmask = None
        if r.random() < 0.12 and self.flavour != "plain":
            bitmask = random_bitmask(self.gen, len(rows), self.vocab, r.random() < 0.3)
        record = None
        if self.path != "sample" and r.random() < 0.15:
            record = [r.random() < 0.6 for _ in rows]
        return Step(rows, logits, bitmask, record)


SIZES = {  # path -> (vocabularies, batch sizes, most steps)
    "torch": ([1, 2, 2, 3, 3, 4, 4, 5, 6, 7, 8, 8, 9, 13, 16, 17, 31, 32, 33, 47, 64],
              [1, 2, 7, 64, 500, 2048, 8192, 16384, 16384, 16384], 12),
    "sample": ([1, 2, 3, 5, 8, 16, 31, 32, 33, 64, 100, 128, 200, 255, 256, 257, 300], [1, 2, 5, 17, 64, 256], 1),
    "kernels": ([1, 2, 3, 3, 4, 4, 5, 6, 7, 8, 16, 31, 32, 33, 64, 100, 129, 200, 300], [1, 1, 2, 3, 5, 8], 2),
    "split2": ([1, 2, 3, 5, 8, 16, 31, 32, 33, 64, 100, 128, 200, 255, 256, 257, 300], [1, 2, 7, 32, 128], 4),
    "split3": ([1, 2, 3, 5, 8, 16, 31, 32, 33, 64, 100, 128, 200, 255, 256, 257, 300], [1, 2, 7, 32, 128], 4),
}


def random_step_config(r: random.Random, batch: int) -> TorchStepConfig:
    """The torch step's routes and sizes (they change speed, never a token): default or extreme."""
    if r.random() < 0.4:
        return TorchStepConfig()
    kw: dict[str, Any] = {}
    tiny_blocks = [1, 7, 64, 4096] if batch <= 512 else [1 << 12, 1 << 14]  # one row a block: small batches only
    for name, values in (("direct_route", [True, False]), ("block_elements", tiny_blocks),
                         ("candidate_cap", [0, 1, 2, 16384]), ("top_p_head", [1, 2, 64]),
                         ("top_p_head_chunks", [1, 3, 256]), ("column_chunk", [1, 7, 1 << 16]),
                         ("histogram_bins", [1, 2, 4096]), ("dense_block", [1, 3, 1 << 18]),
                         ("dense_bracket_cap", [0, 1, 16384]), ("dense_sample_stride", [1, 7, 64]),
                         ("dense_threshold_offsets", [(0,), (-1, 1), (-64, -16, 0, 16, 64)]),
                         ("flat_block_elements", tiny_blocks)):
        if r.random() < 0.5:
            kw[name] = pick(r, values)
    thresholds = len(kw.get("dense_threshold_offsets", (-64, -16, 0, 16, 64))) + 2
    kw["dense_proxy_column"] = r.randrange(thresholds)
    return TorchStepConfig(**kw)


def random_kernel_config(r: random.Random) -> KernelConfig:
    return pick(r, [
        KernelConfig(),
        KERNELS,  # tests/support/backends.py's small blocks
        KernelConfig(prepare_block=8, select_block=16, logprobs_block=32, pivots=2, splits=4, num_warps=1,
                     window_cap=8, window_block=4),
    ])


def _case_random(seed: int, path: str, index: int) -> tuple[random.Random, torch.Generator]:
    r = random.Random(f"tokensampler-adversarial:{seed}:{path}:{index}")
    return r, torch.Generator().manual_seed(r.randrange(2**63))


def make_case(seed: int, path: str, index: int, step_scale: int = 1) -> Case:
    """Case `index` of `path` in the campaign of `seed` (a pure function of the three, and of
    `step_scale`: the cases of 2048 rows or more run that many times more steps, which spreads
    their admission over more draws; the other draws of the case stay the same)."""
    r, gen = _case_random(seed, path, index)
    vocabs, batches, most_steps = SIZES[path]
    vocab = pick(r, vocabs) if r.random() < 0.8 else r.randint(1, max(vocabs))
    pad = pick(r, [0, 0, 1, 3, 8, r.randint(0, vocab), r.randint(0, 64)])
    world = int(path[len("split"):]) if path.startswith("split") else 1
    padded = -(-(vocab + pad) // world) * world
    batch = pick(r, batches)
    flavour = pick(r, ["mixed"] * 5 + ["plain", "plain", "greedy", "edge"])
    dtype = torch.float32 if flavour == "plain" or r.random() < 0.5 else pick(r, [torch.float16, torch.bfloat16])
    # the processed modes show the kept set: the kernels' few rows use them more
    mode = pick(r, MODES + MODES[2:] * 2 if path == "kernels" else MODES)
    max_logprobs = 20 if path == "kernels" else pick(r, [20, 20, 0, 1, vocab, 1000])
    eos = tuple(r.sample(range(vocab), min(vocab, pick(r, [0, 0, 1, 2]))))
    # `sample` takes the whole batch in one call: one invalid row spoils it, so rows there are rarely invalid
    bad_rate = min(0.01, 0.05 / batch) if path == "sample" else 0.01
    shared = r.random() < 0.15
    if shared:
        one = row_spec(r, vocab, max_logprobs, path, flavour, bad_rate, batch)
        rows = []
        for _ in range(batch):  # the same request with its own seed and history (an invalid one: all of it)
            spec = row_spec(r, vocab, max_logprobs, path, flavour, 0.0, batch)
            seed = spec.kwargs.get("seed", r.randrange(2**31))
            rows.append(dataclasses.replace(one, kwargs=dict(one.kwargs)) if one.bad else
                        dataclasses.replace(spec, kwargs={**one.kwargs, "seed": seed}, bad=()))
    else:
        rows = [row_spec(r, vocab, max_logprobs, path, flavour, bad_rate, batch) for _ in range(batch)]
    call_error = None
    if path == "sample":
        for spec in rows:  # histories are per-row arguments of `sample`: seeds always explicit
            spec.kwargs.setdefault("seed", r.randrange(2**31))
        if r.random() < 0.1:
            call_error = pick(r, ["params", "dtype", "shape", "rows", "bitmask", "vocab_size", "positions"])
    max_slots = batch + pick(r, [0, 0, 1, 5])
    slots = r.sample(range(max_slots), batch)
    step_config = random_step_config(r, batch) if path == "torch" else None
    kernel_config = random_kernel_config(r) if path == "kernels" else None
    steps = r.randint(1, most_steps) if batch < 2048 else r.randint(most_steps // 2, 2 * most_steps) * step_scale
    return Case(path, index, vocab, padded, dtype, mode, max_logprobs, eos, flavour, rows, slots, max_slots, steps,
                step_config, kernel_config, call_error, shared and path == "sample", r, gen)


