"""Adversarial campaign: random inputs at the edges of the definition, through every path, against reference.py.

Each case draws a vocabulary (1..300 ids, padded with garbage columns that must never be sampled), a
dtype (fp32 / fp16 / bf16), logits salted with NaN, +-inf, +-3e38, denormals, -0.0 and float16
extremes (and whole rows of them), and per-row parameters at and around their bounds: temperature 0,
tiny and huge; top-k 0, 1, V, V+1, 2^62; top-p tiny and 1; min-p 0 and ~1; penalties at +-2 and
extreme repetition; logit bias +-100 and beyond (clamped); allowed ids; min_tokens with stop and EOS
ids; bad words; token bitmasks; seeds, positions and streams at the ends of their ranges; logprobs
in every mode. A few values are deliberately invalid: the library must reject exactly those. Paths:

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
reruns it and prints every finding.

    python benchmarks/adversarial.py --draws 1000000 --seed 0 [--json out.json] [--paths sample,torch]
        [--budget sample=500000,kernels=2000] [--step-scale 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import random
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from tokensampler import Sampler, SamplerOutput, SamplingParams, TokenSamplerError, sample
from tokensampler.backends.torch_step.config import TorchStepConfig
from tokensampler.backends.triton.config import KernelConfig
from tokensampler.core import rng
from tokensampler.core.order import saturate_posinf
from tokensampler.core.output import LogprobsOutput
from tokensampler.parallel import ThreadExchange, ThreadHub
from tokensampler.reference import ReferenceRequest, bad_word_ids, bitmask_allowed_ids, reference_sample_row

PATHS = ("sample", "torch", "kernels", "split2", "split3")
MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
NEG_INF, POS_INF, NAN = float("-inf"), float("inf"), float("nan")
F32_MAX = 3.4028234663852886e38
F32_MIN_NORMAL = 1.1754943508222875e-38
F32_MIN_DENORMAL = 1.401298464324817e-45
F16_MAX, F16_MIN_NORMAL, F16_MIN_DENORMAL = 65504.0, 6.103515625e-05, 5.960464477539063e-08
BF16_MAX = 3.3895313892515355e38
POSITION_LIMIT = 2**32
# the logprob values' tolerance (docs/semantics.md): ids, ranks, tokens and validity are exact
LOGPROB_ATOL = LOGPROB_RTOL = 1e-6
# the share of each path's rows also run through reference.py one by one (at least 2 per step)
REFERENCE_SHARE = {"sample": 0.05, "torch": 0.002, "kernels": 1.0, "split2": 0.05, "split3": 0.05}
SPECIALS = torch.tensor([NAN, POS_INF, NEG_INF, 3e38, -3e38, F32_MAX, -F32_MAX, F32_MIN_DENORMAL, -F32_MIN_DENORMAL,
                         1e-40, F32_MIN_NORMAL, -0.0, 0.0, F16_MAX, -F16_MAX, F16_MIN_NORMAL, F16_MIN_DENORMAL,
                         -F16_MIN_DENORMAL, BF16_MAX, -BF16_MAX, 1e-30, 88.72, -103.97, 1e4, -1e4, 1.0, -1.0],
                        dtype=torch.float32)
GARBAGE = torch.tensor([POS_INF, NAN, 3e38, F32_MAX, 1e4, 50.0, 0.0, NEG_INF], dtype=torch.float32)


# ------------------------------------------------------------------ counters and findings
@dataclass
class Tally:
    """What one path did. `failures` (invalid ids, mismatches, unexpected exceptions, valid input
    rejected, invalid input accepted, and the oracle's own checks) must stay 0; library errors
    are the rejections of invalid input; `topp_border` counts rows whose top-p kept set differs from
    reference.py only where a float64 mass lies within summation-order rounding of `top_p * total`
    and the library's row equals the definition with one of the kept sets that rounding allows."""

    cases: int = 0
    calls: int = 0  # `sample` / `Sampler.sample` calls (one per step)
    requests: int = 0  # rows admitted (a stateful path) or rows of a checked `sample` call
    draws: int = 0
    reference_rows: int = 0
    library_errors: int = 0
    invalid_ids: int = 0
    mismatches: int = 0
    other_exceptions: int = 0
    rejected_valid: int = 0
    accepted_invalid: int = 0
    oracle_disagreements: int = 0
    reference_invalid_ids: int = 0
    topp_border: int = 0  # rows whose top-p kept set differs only where float64 summation order decides
    seconds: float = 0.0  # wall time of the path
    cpu_seconds: float = 0.0  # the process's CPU time meanwhile (every thread; not counting time waiting for a core)
    library_seconds: float = 0.0  # inside the library's sample / add_request calls
    oracle_seconds: float = 0.0  # in the oracle and reference.py

    def add(self, other: Tally) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def failures(self) -> int:
        return (self.invalid_ids + self.mismatches + self.other_exceptions + self.rejected_valid
                + self.accepted_invalid + self.oracle_disagreements + self.reference_invalid_ids)


@dataclass
class Finding:
    path: str
    case: int
    step: int
    row: int
    kind: str
    detail: str

    def line(self, seed: int, step_scale: int = 1) -> str:
        scale = f" --step-scale {step_scale}" if step_scale != 1 else ""
        return (f"[{self.path} case {self.case} step {self.step} row {self.row}] {self.kind}: {self.detail}"
                f"  (rerun: python benchmarks/adversarial.py --seed {seed}{scale} --case {self.path}:{self.case})")


class Log:
    """Findings of a run: the first `keep` failures with their details, and the first few of each
    allowed kind (`info`)."""

    def __init__(self, keep: int = 50) -> None:
        self.keep = keep
        self.findings: list[Finding] = []
        self.info: list[Finding] = []

    def note(self, finding: Finding, info: bool = False) -> None:
        if info:
            if sum(f.path == finding.path for f in self.info) < 3:
                self.info.append(finding)
        elif len(self.findings) < self.keep:
            self.findings.append(finding)


def _short(value: Any, limit: int = 400) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _params_text(params: SamplingParams | dict) -> str:
    if isinstance(params, SamplingParams):
        defaults = SamplingParams()
        params = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
                  if getattr(params, f.name) != getattr(defaults, f.name) or f.name == "seed"}
        if params.get("logit_bias") is not None:
            params["logit_bias"] = dict(params["logit_bias"])
    return _short(params, 600)


# ------------------------------------------------------------------ parameter menus
# Each menu returns (value, valid): `valid` is the contract of SamplingParams / Sampler.add_request.
Menu = Callable[[random.Random, "Ctx", bool], tuple[Any, bool]]


@dataclass
class Ctx:
    """What a row's values may depend on: the vocabulary, the sampler's logprobs cap, the path."""

    vocab: int
    max_logprobs: int
    path: str
    outputs: list[int]


def _float32_usable(x: float) -> bool:
    """The contract of a temperature or repetition penalty: 0, or at most float32's largest value
    and not rounding to 0 in float32."""
    return x == 0.0 or (abs(x) <= F32_MAX and torch.tensor(x, dtype=torch.float64).to(torch.float32).item() != 0.0)


def _pick(r: random.Random, items: Sequence[Any]) -> Any:
    return items[r.randrange(len(items))]


def temperature_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    if bad:
        return _pick(r, [-1e-300, -1.0, POS_INF, NAN, NEG_INF, "1.0", True, None]), False
    u = r.random()
    if u < 0.3:
        return _pick(r, [0.0, -0.0]), True
    if u < 0.65:
        return _pick(r, [0.5, 0.7, 1.0, 1.3, 2.0, r.uniform(0.05, 3.0)]), True
    value = _pick(r, [F32_MIN_DENORMAL, 2 * F32_MIN_DENORMAL, 1e-40, F32_MIN_NORMAL, 1e-30, 1e-10, 1e-6, 1e-5,
                      1e-3, 0.05, 1.0000001, 10.0, 1e4, 1e10, 1e30, F32_MAX, BF16_MAX, 10 ** r.uniform(-44, 38),
                      0.75 * F32_MIN_DENORMAL, 5e-324, 1e-46, 3.4028235e38, 3.5e38, 1e300, sys.float_info.max])
    return value, _float32_usable(value)


def top_k_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    v = ctx.vocab
    if bad:
        return _pick(r, [-2, -(2**63), 1.0, True, "3", None]), False
    # the kernels' rows are few (Triton's interpreter): there k is mostly on, and near the row's size
    if r.random() < (0.25 if ctx.path == "kernels" else 0.5):
        return 0, True
    near = [1, 2, max(v - 2, 1), max(v - 1, 1), v, v + 1, r.randint(1, v + 1)]
    return _pick(r, near * (3 if ctx.path == "kernels" else 1) + [-1, 2 * v + 3, 2**31 - 1, 2**62, 2**63 - 1,
                                                                 2**63, 10**30]), True


def top_p_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    if bad:
        return _pick(r, [0.0, -0.0, 1.0000000000000002, 1.5, -0.5, NAN, POS_INF, "0.5"]), False
    if r.random() < 0.45:
        return 1.0, True
    # 1/2, 1/4, 3/4, 1/3, 2/3: top_p * total lands exactly on a mass of the near-tie rows (`random_logits`)
    value = _pick(r, [0.9, 0.5, 0.5, 0.25, 0.75, 1 / 3, 2 / 3, 0.1, r.random(), r.random(), 1 - 1e-16, 1 - 1e-7,
                      0.999, 1e-3, 1e-8, 1e-30, 5e-324])
    return value, value > 0.0


def min_p_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    if bad:
        return _pick(r, [-1e-300, 1.0000000000000002, NAN, POS_INF, NEG_INF, -0.5]), False
    if r.random() < 0.55:
        return 0.0, True
    return _pick(r, [-0.0, 5e-324, 1e-45, 1e-30, 1e-8, 0.01, 0.1, 0.5, 0.9, 0.99, 1 - 1e-7, 1 - 1e-16, 1.0,
                     r.random()]), True


def penalty_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    if bad:
        return _pick(r, [2.0000000000000004, -2.0000000000000004, POS_INF, NEG_INF, NAN, 3, "1"]), False
    if r.random() < 0.6:
        return 0.0, True
    return _pick(r, [-0.0, 2.0, -2.0, 1.9999999999999998, -1.9999999999999998, 1e-30, -1e-30, 5e-324, -5e-324,
                     0.5, -0.5, r.uniform(-2, 2)]), True


def repetition_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    if bad:
        return _pick(r, [0.0, -0.0, -1.0, POS_INF, NAN, "1.1"]), False
    if r.random() < 0.6:
        return 1.0, True
    value = _pick(r, [0.5, 0.9, 1.1, 1.3, 2.0, 10.0, 1e-10, 1e-38, F32_MIN_DENORMAL, 1e10, 1e38, F32_MAX,
                      10 ** r.uniform(-40, 38), 0.75 * F32_MIN_DENORMAL, 5e-324, 1e-46, 3.4028235e38, 3.5e38, 1e300])
    return value, _float32_usable(value)


def seed_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    if bad:
        return _pick(r, [2**64, -(2**63) - 1, 1.5, "7", True]), False
    choices = [0, 1, 2**32 - 1, 2**32, 2**63 - 1, -(2**63), 2**63, 2**64 - 1, r.randrange(2**64),
               r.randrange(-(2**63), 2**63)]
    if ctx.path != "sample":  # `sample` does not report the seeds it draws: only the stateful paths
        choices += [None, -1]
    return (r.randrange(2**31) if r.random() < 0.5 else _pick(r, choices)), True


def logprobs_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    v, cap = ctx.vocab, ctx.max_logprobs
    if bad:
        if ctx.path != "sample":  # `sample` raises its cap to the largest request
            return _pick(r, [-2, 1.5, True, cap + 1]), False
        return _pick(r, [-2, 1.5, True]), False
    if r.random() < (0.4 if ctx.path == "kernels" else 0.7):
        return None, True
    if ctx.path == "kernels":  # the kernels return up to 20 (a wider step runs the torch step)
        return _pick(r, [0, 1, 2, 5, min(v, 20), 20] + ([-1] if v <= 20 else [])), True
    value = _pick(r, [0, 1, 2, 5, 20, v, v + 1, -1, min(cap, 1000)])
    return value, value <= cap or ctx.path == "sample"


def logit_bias_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    v = ctx.vocab
    ids = lambda: _pick(r, [0, v - 1, r.randrange(v)])  # noqa: E731
    values = lambda: _pick(r, [100.0, -100.0, 100.5, -100.5, POS_INF, NEG_INF, 1e300, -1e300, 0.0, -0.0,  # noqa: E731
                               5e-324, 1e-30, r.uniform(-10, 10), 3e38, -3e38, r.uniform(-100, 100), 1, -7])
    bias = {ids(): values() for _ in range(r.randint(1, 4))}
    if bad:
        what = r.randrange(4)
        if what == 0:
            bias[_pick(r, [v, v + 5])] = 1.0
        elif what == 1:
            bias[-1] = 1.0
        elif what == 2:
            bias[ids()] = NAN
        else:
            bias[ids()] = _pick(r, [True, "1"])
        return bias, False
    return bias, True


def allowed_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    v = ctx.vocab
    if bad:
        return _pick(r, [(), (v,), (0, v + 3), (-1,), (0.5,), "0"]), False
    kind = r.randrange(5)
    if kind == 0:
        return (r.randrange(v),), True
    if kind == 1:
        return (v - 1,), True
    if kind == 2:
        return tuple(range(v)), True
    if kind == 3:
        ids = [r.randrange(v) for _ in range(r.randint(1, 6))]
        return tuple(ids + ids[:2]), True  # duplicates
    return tuple(r.sample(range(v), r.randint(1, v))), True


def stop_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    """(min_tokens, stop_token_ids)."""
    v, n = ctx.vocab, len(ctx.outputs)
    stops = tuple(_pick(r, [0, v - 1, r.randrange(v)]) for _ in range(r.randint(0, 3)))
    if bad:
        if r.random() < 0.5:
            return (_pick(r, [-1, 1.0, None]), stops), False
        return (r.randint(1, 5), stops + (_pick(r, [v, -1]),)), False
    return (_pick(r, [1, n, n + 1, n + 2, 5, 10**9, 2**62, 2**63 - 1, 2**63]), stops), True


def bad_words_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    v, out = ctx.vocab, ctx.outputs
    words = []
    for _ in range(r.randint(1, 4)):
        kind = r.randrange(3)
        if kind == 0 or not out:
            words.append(tuple(r.randrange(v) for _ in range(r.randint(1, 3))))
        elif kind == 1:  # the output ends with the prefix: the last id is banned now
            words.append((*out[-r.randint(1, min(2, len(out))):], r.randrange(v)))
        else:  # a prefix the next token may complete
            words.append((out[-1], r.randrange(v), r.randrange(v)))
    if bad:
        return _pick(r, [words + [()], words + [(v,)], words + [(-1,)], "abc"]), False
    return words, True


@dataclass
class RowSpec:
    """One request of a case: SamplingParams keywords, history, noise coordinates, and which field
    (if any) was made invalid."""

    kwargs: dict[str, Any]
    prompt: list[int]
    outputs: list[int]
    position: int | None = None
    stream: int = 0
    bad: tuple[str, ...] = ()  # the fields holding an invalid value (the library must name one of them)


PLAIN_FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "seed", "logprobs")
FIELDS: dict[str, Menu] = {
    "temperature": temperature_menu, "top_k": top_k_menu, "top_p": top_p_menu, "min_p": min_p_menu,
    "presence_penalty": penalty_menu, "frequency_penalty": penalty_menu, "repetition_penalty": repetition_menu,
    "seed": seed_menu, "logprobs": logprobs_menu, "logit_bias": logit_bias_menu,
    "allowed_token_ids": allowed_menu, "stop": stop_menu, "bad_words_token_ids": bad_words_menu,
}
RARE = {"logit_bias": 0.2, "allowed_token_ids": 0.15, "stop": 0.2, "bad_words_token_ids": 0.12}
HISTORY_FIELDS = ("prompt_token_ids", "output_token_ids", "position", "stream")
FIELD_NAMES = {"stop": ("min_tokens", "stop_token_ids")}  # the error fields a bad value may be named by


def row_spec(r: random.Random, vocab: int, max_logprobs: int, path: str, flavour: str, bad_rate: float) -> RowSpec:
    """One random request. Flavours: mixed (every field), plain (nothing to remove or add before the
    temperature: the direct route), greedy (temperature 0, nothing else), edge (every field off its
    default)."""
    prompt = [r.randrange(vocab) for _ in range(_pick(r, [0, 0, 1, 2, 5, 8]))]
    outputs = [r.randrange(vocab) for _ in range(_pick(r, [0, 0, 1, 2, 3, 6]))]
    if outputs and r.random() < 0.3:
        outputs += outputs[:2]  # repeated ids: counts above 1
    ctx = Ctx(vocab, max_logprobs, path, outputs)
    fields = list(FIELDS) if flavour in ("mixed", "edge") else list(PLAIN_FIELDS) if flavour == "plain" \
        else ["seed", "logprobs"]
    bad_field = None
    if r.random() < bad_rate:
        bad_field = _pick(r, fields + list(HISTORY_FIELDS))
    kwargs: dict[str, Any] = {"temperature": 0.0} if flavour == "greedy" else {}
    bad: list[str] = []
    for name in fields:
        rate = 0.9 if flavour == "edge" else RARE.get(name, 1.0)
        if name != bad_field and r.random() >= rate:
            continue
        value, ok = FIELDS[name](r, ctx, name == bad_field)
        if not ok:  # asked for, or a value just outside the contract (a float32 edge, logprobs above the cap)
            bad.append(name)
        if name == "stop":
            kwargs["min_tokens"], kwargs["stop_token_ids"] = value
        else:
            kwargs[name] = value
    position = None if r.random() < 0.7 else _pick(r, [0, POSITION_LIMIT - 1, POSITION_LIMIT - 2,
                                                        r.randrange(POSITION_LIMIT)])
    stream = 0 if r.random() < 0.8 else _pick(r, [1, 3, POSITION_LIMIT - 1])
    if path == "sample":
        stream = 0  # `sample` has no stream argument
    if bad_field == "prompt_token_ids":
        prompt = prompt + [_pick(r, [vocab, -1, vocab + 7])]
    elif bad_field == "output_token_ids":
        outputs = outputs + [_pick(r, [vocab, -1])]
    elif bad_field == "position":
        position = _pick(r, [POSITION_LIMIT, -1, 2**64])
    elif bad_field == "stream" and path != "sample":
        stream = _pick(r, [POSITION_LIMIT, -1])
    if bad_field in HISTORY_FIELDS and (bad_field != "stream" or path != "sample"):
        bad.append(bad_field)
    return RowSpec(kwargs, prompt, outputs, position, stream, tuple(bad))


def fallback_spec(index: int) -> RowSpec:
    """What replaces a rejected request, so that the case goes on (always valid)."""
    return RowSpec({"seed": 1000 + index}, [], [], None, 0)


# ------------------------------------------------------------------ logits
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
    native: TorchStepConfig | None = None
    kernel: KernelConfig | None = None
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
                         ("dense_threshold_offsets", [(0,), (-1, 1), (-64, -16, 0, 16, 64)])):
        if r.random() < 0.5:
            kw[name] = _pick(r, values)
    thresholds = len(kw.get("dense_threshold_offsets", (-64, -16, 0, 16, 64))) + 2
    kw["dense_proxy_column"] = r.randrange(thresholds)
    return TorchStepConfig(**kw)


def random_kernel_config(r: random.Random) -> KernelConfig:
    return _pick(r, [
        KernelConfig(),
        KernelConfig(prepare_block=32, select_block=64, logprobs_block=64, pivots=8, splits=2, num_warps=4,
                     window_cap=64, window_block=32),
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
    vocab = _pick(r, vocabs) if r.random() < 0.8 else r.randint(1, max(vocabs))
    pad = _pick(r, [0, 0, 1, 3, 8, r.randint(0, vocab), r.randint(0, 64)])
    world = int(path[len("split"):]) if path.startswith("split") else 1
    padded = -(-(vocab + pad) // world) * world
    batch = _pick(r, batches)
    flavour = _pick(r, ["mixed"] * 5 + ["plain", "plain", "greedy", "edge"])
    dtype = torch.float32 if flavour == "plain" or r.random() < 0.5 else _pick(r, [torch.float16, torch.bfloat16])
    # the processed modes show the kept set: the kernels' few rows use them more
    mode = _pick(r, MODES + MODES[2:] * 2 if path == "kernels" else MODES)
    max_logprobs = 20 if path == "kernels" else _pick(r, [20, 20, 0, 1, vocab, 1000])
    eos = tuple(r.sample(range(vocab), min(vocab, _pick(r, [0, 0, 1, 2]))))
    # `sample` takes the whole batch in one call: one invalid row spoils it, so rows there are rarely invalid
    bad_rate = min(0.01, 0.05 / batch) if path == "sample" else 0.01
    shared = r.random() < 0.15
    if shared:
        one = row_spec(r, vocab, max_logprobs, path, flavour, bad_rate)
        rows = []
        for _ in range(batch):  # the same request with its own seed and history (an invalid one: all of it)
            spec = row_spec(r, vocab, max_logprobs, path, flavour, 0.0)
            seed = spec.kwargs.get("seed", r.randrange(2**31))
            rows.append(dataclasses.replace(one, kwargs=dict(one.kwargs)) if one.bad else
                        dataclasses.replace(spec, kwargs={**one.kwargs, "seed": seed}, bad=()))
    else:
        rows = [row_spec(r, vocab, max_logprobs, path, flavour, bad_rate) for _ in range(batch)]
    call_error = None
    if path == "sample":
        for spec in rows:  # histories are per-row arguments of `sample`: seeds always explicit
            spec.kwargs.setdefault("seed", r.randrange(2**31))
        if r.random() < 0.1:
            call_error = _pick(r, ["params", "dtype", "shape", "rows", "bitmask", "vocab_size", "positions"])
    max_slots = batch + _pick(r, [0, 0, 1, 5])
    slots = r.sample(range(max_slots), batch)
    native = random_step_config(r, batch) if path == "torch" else None
    kernel = random_kernel_config(r) if path == "kernels" else None
    steps = r.randint(1, most_steps) if batch < 2048 else r.randint(most_steps // 2, 2 * most_steps) * step_scale
    return Case(path, index, vocab, padded, dtype, mode, max_logprobs, eos, flavour, rows, slots, max_slots, steps,
                native, kernel, call_error, shared and path == "sample", r, gen)


# ------------------------------------------------------------------ the oracle
@dataclass
class OracleRow:
    params: SamplingParams
    seed: int
    position: int
    stream: int
    prompt: list[int]
    outputs: list[int]


def logprob_rows(scores: torch.Tensor, values: torch.Tensor, tokens: torch.Tensor, num: torch.Tensor,
                 width: int) -> LogprobsOutput:
    """reference_sample's logprobs fields for rows whose (scores, values) are given: ranks and the
    top-N on the scores (value, then lower id), rows with num -1 padded."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :width]
    inside = torch.arange(width)[None, :] < num[:, None]
    top_ids = torch.where(inside, order, -1)
    top_lp = torch.where(inside, values.gather(1, order), NEG_INF)
    token_scores = scores.gather(1, tokens[:, None])
    asked = num >= 0
    ranks = torch.where(asked, (scores >= token_scores).sum(-1), 0)
    token_lp = torch.where(asked, values.gather(1, tokens[:, None]).squeeze(1), 0.0)
    return LogprobsOutput(token_lp, ranks, top_ids, top_lp)


def _log_softmax_rows(z: torch.Tensor) -> torch.Tensor:
    """reference._log_softmax per row: rows with every id at -inf are returned as they are."""
    out = torch.log_softmax(z, dim=-1)
    empty = torch.isneginf(z).all(dim=-1, keepdim=True)
    return torch.where(empty, z, out)


class Oracle:
    """The definition (reference.py, step by step) for a batch at once, with the rows' state.

    Every elementwise float32 operation is reference_sample_row's, on the same values, so it gives
    the same bits; the float64 top-p masses are summed in reference.py's order only where that
    order cannot matter (every kept p is 0 or a float32 >= 2^(ceil(log2 V) - 30), so the sums are
    exact; or no id's mass lies within 8 (n + 2) 2^-53 total of the border `top_p * total`, more
    than the rounding of any summation order), and rows where it could, or where NaN arises, are
    given to `reference_sample_row` itself. Rows where a kept p below the max equals min_p or a mass equals
    `top_p * total` exactly (where a strict and a loose comparison differ) are also run through
    `reference_sample_row`, and the two must agree."""

    def __init__(self, vocab: int, mode: str, eos: Sequence[int]) -> None:
        self.vocab, self.mode, self.eos = vocab, mode, tuple(eos)
        self.rows: dict[int, OracleRow] = {}
        bits = max(0, math.ceil(math.log2(vocab)))
        self.exact_floor = 2.0 ** (bits - 30)

    def admit(self, i: int, params: SamplingParams, seed: int, position: int, stream: int, prompt: Sequence[int],
              outputs: Sequence[int]) -> None:
        self.rows[i] = OracleRow(params, seed, position, stream, list(prompt), list(outputs))

    def freeze(self, n: int) -> None:
        """Per-row tensors of the admitted rows (indices 0..n-1; others neutral)."""
        v = self.vocab
        rows = [self.rows.get(i) for i in range(n)]
        default = SamplingParams()
        ps = [row.params if row is not None else default for row in rows]
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float64).to(torch.float32)  # noqa: E731
        self.temperature = f32([p.temperature for p in ps])
        self.greedy = torch.tensor([p.greedy for p in ps], dtype=torch.bool)
        self.min_p, self.min_p_on = f32([p.min_p for p in ps]), torch.tensor([p.min_p > 0 for p in ps])
        self.top_k = torch.tensor([min(p.top_k, v + 1) for p in ps], dtype=torch.int64)
        self.top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float64)
        self.top_p_on = torch.tensor([p.top_p < 1.0 for p in ps])
        self.repetition = f32([p.repetition_penalty for p in ps])
        self.frequency = f32([p.frequency_penalty for p in ps])
        self.presence = f32([p.presence_penalty for p in ps])
        self.seed = torch.tensor([rng.seed_to_int64(row.seed) if row else 0 for row in rows], dtype=torch.int64)
        self.stream = torch.tensor([row.stream if row else 0 for row in rows], dtype=torch.int64)
        self.position = torch.tensor([row.position if row else 0 for row in rows], dtype=torch.int64)
        self.num_logprobs = torch.tensor([-1 if p.logprobs is None else v if p.logprobs == -1 else min(p.logprobs, v)
                                          for p in ps], dtype=torch.int64)
        self.min_tokens = torch.tensor([min(p.min_tokens, 2**62) for p in ps], dtype=torch.int64)
        self.out_len = torch.tensor([len(row.outputs) if row else 0 for row in rows], dtype=torch.int64)
        self.allowed = torch.ones(n, v, dtype=torch.bool)
        self.bias = torch.zeros(n, v, dtype=torch.float32)
        self.has_bias = torch.zeros(n, v, dtype=torch.bool)
        self.stop = torch.zeros(n, v, dtype=torch.bool)
        self.prompt_mask = torch.zeros(n, v, dtype=torch.bool)
        self.counts = torch.zeros(n, v, dtype=torch.float32)
        self.bad_words = [i for i, p in enumerate(ps) if p.bad_words_token_ids]
        self.any_allowed = any(p.allowed_token_ids is not None for p in ps)
        self.any_bias = any(bool(p.logit_bias) for p in ps)
        self.any_stop = any(p.min_tokens > 0 for p in ps)
        for i, (row, p) in enumerate(zip(rows, ps)):
            if row is None:
                continue
            if p.allowed_token_ids is not None:
                self.allowed[i] = False
                self.allowed[i, list(p.allowed_token_ids)] = True
            if p.logit_bias:
                ids = list(p.logit_bias)
                self.bias[i, ids] = f32(list(p.logit_bias.values()))
                self.has_bias[i, ids] = True
            if p.min_tokens > 0:
                self.stop[i, list(p.stop_token_ids) + list(self.eos)] = True
            if row.prompt:
                self.prompt_mask[i, row.prompt] = True
            for token in row.outputs:
                self.counts[i, token] += 1

    def request(self, i: int) -> ReferenceRequest:
        row = self.rows[i]
        return ReferenceRequest(row.params, row.seed, int(self.position[i]), row.prompt, list(row.outputs),
                                row.stream, self.eos)

    def step(self, logits: torch.Tensor, idx: list[int], bitmask: torch.Tensor | None,
             check: set[int]) -> tuple[SamplerOutput, torch.Tensor, set[int], list[int]]:
        """The definition for rows idx (logits [B, Vp]). Returns (output, removed [B, V] (NaN, -inf and
        step 3 removals: ids a valid row must never return), rows also run through reference.py (given
        to it, the share `check`, and those at a min-p or top-p bound), rows where reference.py and the
        batched form disagree)."""
        v, mode = self.vocab, self.mode
        ix = torch.tensor(idx, dtype=torch.int64)
        batch = len(idx)
        z = logits[:, :v].to(torch.float32).clone()
        z[torch.isnan(z)] = NEG_INF
        raw = saturate_posinf(z.clone())
        self.raw = raw
        self.border: dict[int, tuple[torch.Tensor, ...]] = {}
        removed = torch.isneginf(z) | ~self.allowed[ix] if self.any_allowed else torch.isneginf(z)
        step_bits = None if bitmask is None else bitmask_bits(bitmask, v)
        if step_bits is not None:
            removed |= ~step_bits
        for b, i in enumerate(idx):
            if i in self.bad_words_set:
                banned = bad_word_ids(self.rows[i].params, self.rows[i].outputs)
                if banned:
                    removed[b, list(banned)] = True
        if self.any_stop:
            below = self.out_len[ix] < self.min_tokens[ix]
            removed |= self.stop[ix] & below[:, None]
        z = z.masked_fill(removed, NEG_INF)
        if self.any_bias:
            z = torch.where(self.has_bias[ix], z + self.bias[ix], z)
        counts = self.counts[ix]
        seen = (counts > 0) | self.prompt_mask[ix]
        r = self.repetition[ix][:, None]
        z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
        z = z - self.frequency[ix][:, None] * counts
        z = z - self.presence[ix][:, None] * (counts > 0).to(torch.float32)
        nan_rows = torch.isnan(z).any(-1)
        z = saturate_posinf(z)
        kept = ~torch.isneginf(z)
        valid = kept.any(-1)
        greedy = self.greedy[ix]
        s = (valid & ~greedy).nonzero().squeeze(1)
        if s.numel():
            zs = saturate_posinf(z[s] / self.temperature[ix[s]][:, None])
            nan_rows[s] |= torch.isnan(zs).any(-1)
            z[s] = zs
            kept[s] = ~torch.isneginf(zs)
            valid[s] = kept[s].any(-1)
        tokens = torch.zeros(batch, dtype=torch.int64)
        self.edge = torch.zeros(batch, dtype=torch.bool)  # rows with a p or a mass exactly at a bound
        tokens[~valid] = raw[~valid].argmax(-1)
        g = (valid & greedy).nonzero().squeeze(1)
        tokens[g] = z[g].argmax(-1)
        inexact = torch.zeros(batch, dtype=torch.bool)
        s = (valid & ~greedy & ~nan_rows).nonzero().squeeze(1)
        if s.numel():
            self._sample_rows(z, kept, tokens, inexact, ix, s)
        final = z
        lp = None
        if bool((self.num_logprobs[ix] >= 0).any()):
            scores = raw if mode.startswith("raw") else final
            values = _log_softmax_rows(scores) if mode.endswith("logprobs") else scores
            num = self.num_logprobs[ix]
            lp = logprob_rows(scores, values, tokens, num, int(num.max()))
        out = SamplerOutput(tokens, valid, lp)
        given = set((nan_rows | inexact).nonzero().squeeze(1).tolist())
        edge = set(self.edge.nonzero().squeeze(1).tolist())
        disagree = []
        for b in sorted(given | check | edge):
            want = self.reference_row(logits[b], idx[b], None if step_bits is None else bitmask[b:b + 1],
                                      None if lp is None else int(lp.top_token_ids.shape[1]))
            if b in given:
                _put_row(out, b, want)
            elif _differing(_take_row(out, b), want)[0].any():
                disagree.append(b)
        return out, removed, given | check | edge, disagree

    @property
    def bad_words_set(self) -> set[int]:
        if not hasattr(self, "_bad_words_set"):
            self._bad_words_set = set(self.bad_words)
        return self._bad_words_set

    def _sample_rows(self, z: torch.Tensor, kept: torch.Tensor, tokens: torch.Tensor, inexact: torch.Tensor,
                     ix: torch.Tensor, s: torch.Tensor) -> None:
        """Steps 8-11 for the sampled rows s (z and kept are edited in place)."""
        v = self.vocab
        zs, ks = z[s], kept[s]
        rows = ix[s]
        edge = torch.zeros(len(s), dtype=torch.bool)
        p = torch.exp(zs - zs.amax(-1, keepdim=True))
        on = self.min_p_on[rows]
        if bool(on.any()):
            edge = on & (ks & (p == self.min_p[rows][:, None]) & (p < 1)).any(-1)  # below the max
            ks &= ~on[:, None] | (p >= self.min_p[rows][:, None])
        k = self.top_k[rows]
        if bool((k > 0).any()):  # kept ids with a strictly larger z: V - #(values <= z), exact
            ordered = torch.sort(torch.where(ks, zs, NEG_INF), dim=-1).values
            above = v - torch.searchsorted(ordered, zs.contiguous(), right=True)
            ks &= (k[:, None] <= 0) | (above < k[:, None])
        on = self.top_p_on[rows]
        if bool(on.any()):
            p64 = torch.where(ks, p, 0.0).to(torch.float64)
            # sums in any order are exact when every kept p is 0 or >= exact_floor; else the order
            # matters only for an id whose mass is within the rounding error bound of the border
            exact = ~(ks & (p > 0) & (p < self.exact_floor)).any(-1)
            n_kept = ks.sum(-1, keepdim=True).to(torch.float64)
            ordered, order = torch.sort(torch.where(ks, zs, NEG_INF), dim=-1)
            # the float64 mass of the ids above each sorted position, summed from the largest down
            suffix = torch.flip(torch.cumsum(torch.flip(p64.gather(1, order), [1]), dim=1), [1])
            suffix = torch.cat([suffix, torch.zeros(suffix.shape[0], 1, dtype=torch.float64)], dim=1)
            mass = suffix.gather(1, torch.searchsorted(ordered, zs.contiguous(), right=True))
            total = suffix[:, :1]
            border = self.top_p[rows][:, None] * total
            margin = 8 * (n_kept + 2) * 2.0**-53 * total
            near = ks & (mass != 0) & ((mass - border).abs() <= margin)
            ambiguous = on & ~exact & near.any(-1)
            inexact[s] = ambiguous
            for j in ambiguous.nonzero().squeeze(1).tolist():  # kept for `border_outputs`
                self.border[int(s[j])] = (zs[j].clone(), ks[j].clone(), near[j].clone(), (mass[j] < border[j]).clone(),
                                          int(rows[j]))
            edge |= on & (ks & (mass == border)).any(-1)
            ks &= ~on[:, None] | (mass < border)
        zs = torch.where(ks, zs, NEG_INF)
        noise = rng.gumbel(self.seed[rows][:, None], self.position[rows][:, None], torch.arange(v)[None, :],
                           self.stream[rows][:, None])
        score = torch.where(ks, zs + noise, NEG_INF)
        tokens[s] = score.argmax(-1)
        z[s] = zs
        kept[s] = ks
        self.edge[s] = edge

    def border_outputs(self, b: int, width: int | None) -> list[SamplerOutput]:
        """Row b of the last step with each kept set the definition allows where top-p masses lie
        within float64 rounding of the border (docs/cpu-fast-path.md, "Float64 sums"): the ids
        whose mass is that close may be kept or not, as a prefix in value order; [] if none."""
        if b not in self.border:
            return []
        zs, before, near, below, i = self.border[b]
        certain = before & ~near & below
        noise = rng.gumbel(self.seed[i], self.position[i], torch.arange(self.vocab), self.stream[i])
        outs = []
        for cut in [POS_INF] + sorted(set(zs[near].tolist()), reverse=True):
            kept = certain | (near & (zs >= cut))
            if not bool(kept.any()):
                continue
            token = torch.where(kept, zs + noise, NEG_INF).argmax()[None]
            final = torch.where(kept, zs, NEG_INF)[None]
            lp = None
            if width is not None:
                scores = self.raw[b:b + 1] if self.mode.startswith("raw") else final
                values = _log_softmax_rows(scores) if self.mode.endswith("logprobs") else scores
                lp = logprob_rows(scores, values, token, self.num_logprobs[i:i + 1], width)
            outs.append(SamplerOutput(token, torch.tensor([True]), lp))
        return outs

    def reference_row(self, logits_row: torch.Tensor, i: int, bitmask_row: torch.Tensor | None,
                      width: int | None) -> SamplerOutput:
        """reference_sample_row for one row, as a one-row output with logprobs of width `width`
        (None: the batch has no logprobs)."""
        allowed = None if bitmask_row is None else bitmask_allowed_ids(bitmask_row, self.vocab)[0]
        token, valid, lp = reference_sample_row(logits_row, self.request(i), self.vocab, self.mode, allowed)
        tokens = torch.tensor([token])
        out_lp = None
        if width is not None:
            scores, values = lp
            out_lp = logprob_rows(scores[None], values[None], tokens, self.num_logprobs[i:i + 1], width)
        return SamplerOutput(tokens, torch.tensor([valid]), out_lp)

    def record(self, idx: list[int], tokens: torch.Tensor, record: list[bool] | None) -> None:
        """Step 13: count the tokens of the recorded rows, advance their positions."""
        keep = range(len(idx)) if record is None else [b for b in range(len(idx)) if record[b]]
        rows = [idx[b] for b in keep]
        if not rows:
            return
        ix = torch.tensor(rows, dtype=torch.int64)
        tok = tokens[list(keep)]
        self.counts.index_put_((ix, tok), torch.ones(len(rows)), accumulate=True)
        self.out_len[ix] += 1
        self.position[ix] += 1
        for i, t in zip(rows, tok.tolist()):
            self.rows[i].outputs.append(t)


def _take_row(out: SamplerOutput, b: int) -> SamplerOutput:
    lp = out.logprobs
    if lp is not None:
        lp = LogprobsOutput(lp.token_logprobs[b:b + 1], lp.token_ranks[b:b + 1], lp.top_token_ids[b:b + 1],
                            lp.top_logprobs[b:b + 1])
    return SamplerOutput(out.token_ids[b:b + 1], out.valid[b:b + 1], lp)


def _put_row(out: SamplerOutput, b: int, row: SamplerOutput) -> None:
    out.token_ids[b] = row.token_ids[0]
    out.valid[b] = row.valid[0]
    if out.logprobs is not None and row.logprobs is not None:
        for name in ("token_logprobs", "token_ranks", "top_token_ids", "top_logprobs"):
            getattr(out.logprobs, name)[b] = getattr(row.logprobs, name)[0]


def _values_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: infinities (and NaN) must be equal, finite values within the logprob tolerance."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    finite = torch.isfinite(a64) & torch.isfinite(b64)
    far = (a64 - b64).abs() > LOGPROB_ATOL + LOGPROB_RTOL * b64.abs()
    return torch.where(finite, far, ~(a64 == b64))


def _differing(got: SamplerOutput, want: SamplerOutput) -> tuple[torch.Tensor, str]:
    """bool [B]: rows where `got` differs from `want` (tokens, validity, logprob ids and ranks exactly,
    logprob values within the tolerance), and what differs in the first of them."""
    tokens, valid = got.token_ids.cpu(), got.valid.cpu()
    bad = (tokens != want.token_ids) | (valid != want.valid)
    what = ["token/valid"]
    if (got.logprobs is None) != (want.logprobs is None):
        return torch.ones_like(bad), "logprobs present in one output only"
    if want.logprobs is not None:
        g, w = got.logprobs, want.logprobs
        if tuple(g.top_token_ids.shape) != tuple(w.top_token_ids.shape):
            return torch.ones_like(bad), f"top-N shape {tuple(g.top_token_ids.shape)} != {tuple(w.top_token_ids.shape)}"
        parts = {"token_ranks": g.token_ranks.cpu() != w.token_ranks,
                 "top_token_ids": (g.top_token_ids.cpu() != w.top_token_ids).any(-1),
                 "token_logprobs": _values_differ(g.token_logprobs.cpu(), w.token_logprobs),
                 "top_logprobs": _values_differ(g.top_logprobs.cpu(), w.top_logprobs).any(-1)}
        for name, rows in parts.items():
            bad |= rows
            if bool(rows.any()):
                what.append(name)
    return bad, ",".join(what)


def _row_text(out: SamplerOutput, b: int) -> str:
    text = f"token {int(out.token_ids[b])} valid {bool(out.valid[b])}"
    if out.logprobs is not None:
        lp = out.logprobs
        text += (f" lp {float(lp.token_logprobs[b]):.7g} rank {int(lp.token_ranks[b])} top "
                 f"{_short(lp.top_token_ids[b].tolist(), 120)} {_short(lp.top_logprobs[b].tolist(), 200)}")
    return text


# ------------------------------------------------------------------ the paths' engines
COMPILE = {"compile": False}  # the samplers' torch.compile choice (--compile), passed to each of them


class RanksDisagree(Exception):
    """The ranks of a split returned different outputs or outcomes."""


# (slot, params, prompt, outputs, position, stream) of one add_request
Admission = tuple[int, SamplingParams, list[int], list[int], int | None, int]


class Engine:
    """One path's sampler(s): admit requests, sample steps."""

    def __init__(self, case: Case) -> None:
        self.case = case
        kw: dict[str, Any] = dict(max_slots=case.max_slots, padded_vocab_size=case.padded,
                                  logprobs_mode=case.mode, max_logprobs=case.max_logprobs,
                                  eos_token_ids=list(case.eos))
        kw["compile"] = COMPILE["compile"]
        self.world = case.world
        if self.world == 1:
            backend = {"torch": "torch", "kernels": "triton"}.get(case.path, "auto")
            self.samplers = [Sampler(case.vocab, step_config=case.native, kernel_config=case.kernel,
                                     backend=backend, **kw)]
        else:
            self.hub = ThreadHub(self.world)
            self.samplers = self._on_ranks(lambda rank, _: Sampler(
                case.vocab, group=ThreadExchange(self.hub, rank), **kw), [None] * self.world)

    def _on_ranks(self, fn: Callable[[int, Any], Any], items: list[Any]) -> list[Any]:
        """fn(rank, items[rank]) on one thread per rank; re-raises the first error (after the
        barrier is reset, so the group can go on)."""
        results: list[Any] = [None] * self.world
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank, items[rank])
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                errors.append(exc)
                self.hub.barrier.abort()

        threads = [threading.Thread(target=body, args=(rank,)) for rank in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.hub.barrier.reset()
            raise errors[0]
        return results

    def admit_all(self, requests: list[Admission]) -> list[int | BaseException]:
        """Admit each request; per request its seed or the exception it raised."""
        def admit(sampler: Sampler) -> list[int | BaseException]:
            outcomes: list[int | BaseException] = []
            for slot, params, prompt, outputs, position, stream in requests:
                try:
                    outcomes.append(sampler.add_request(slot, params, prompt, output_token_ids=outputs,
                                                        position=position, stream=stream))
                except Exception as exc:  # noqa: BLE001 - classified by the caller
                    outcomes.append(exc)
            return outcomes

        if self.world == 1:
            return admit(self.samplers[0])
        per_rank = self._on_ranks(lambda rank, sampler: admit(sampler), self.samplers)
        for outcomes in per_rank[1:]:
            for a, b in zip(per_rank[0], outcomes):
                if type(a) is not type(b) or (isinstance(a, int) and a != b):
                    raise RanksDisagree(f"admission outcomes differ: {_short(a)} vs {_short(b)}")
        return per_rank[0]

    def sample(self, logits: torch.Tensor, slots: list[int], record: list[bool] | None,
               bitmask: torch.Tensor | None) -> SamplerOutput:
        mask = None if record is None else torch.tensor(record, dtype=torch.bool)
        if self.world == 1:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # Triton's interpreter: numpy overflow notes
                out = self.samplers[0].sample(logits, slots, record=mask, token_bitmask=bitmask)
            return _copy(out)  # the kernels return views of buffers they reuse
        width = self.case.padded // self.world
        outs = self._on_ranks(lambda rank, sampler: _copy(sampler.sample(
            logits[:, rank * width:(rank + 1) * width], slots, record=mask, token_bitmask=bitmask)), self.samplers)
        for rank, out in enumerate(outs[1:], 1):
            bad, what = _differing(out, outs[0])
            if bool(bad.any()) or not torch.equal(out.token_ids, outs[0].token_ids):
                raise RanksDisagree(f"rank {rank} differs from rank 0 ({what})")
        return outs[0]


def _copy(out: SamplerOutput) -> SamplerOutput:
    lp = out.logprobs
    if lp is not None:
        lp = LogprobsOutput(*(t.clone() for t in (lp.token_logprobs, lp.token_ranks, lp.top_token_ids,
                                                  lp.top_logprobs)))
    return SamplerOutput(out.token_ids.clone(), out.valid.clone(), lp)


# ------------------------------------------------------------------ running a case
class Runner:
    """Runs cases of one path, counting into `tally` and noting findings in `log`."""

    def __init__(self, path: str, tally: Tally, log: Log) -> None:
        self.path, self.tally, self.log = path, tally, log

    def note(self, case: Case, step: int, row: int, kind: str, detail: str, info: bool = False) -> None:
        self.log.note(Finding(self.path, case.index, step, row, kind, detail), info)

    def params(self, case: Case, i: int, spec: RowSpec) -> SamplingParams | None:
        """SamplingParams of a row (None: rejected, as it should be, or with an unexpected error)."""
        try:
            return SamplingParams(**spec.kwargs)
        except TokenSamplerError as exc:
            self.rejected(case, i, spec, exc)
        except Exception as exc:  # noqa: BLE001 - counted
            self.other(case, -1, i, exc, f"SamplingParams({_params_text(spec.kwargs)})")
        return None

    def rejected(self, case: Case, i: int, spec: RowSpec, exc: TokenSamplerError) -> None:
        if not spec.bad:
            self.tally.rejected_valid += 1
            self.note(case, -1, i, "valid input rejected", f"{type(exc).__name__}: {exc} for "
                      f"{_params_text(spec.kwargs)}")
            return
        self.tally.library_errors += 1
        expected = tuple(n for name in spec.bad for n in FIELD_NAMES.get(name, (name,)))
        if not str(exc.field).startswith(expected):
            self.tally.rejected_valid += 1
            self.note(case, -1, i, "rejected for another field", f"expected {spec.bad}, got {exc.field}: {exc}")

    def other(self, case: Case, step: int, row: int, exc: BaseException, what: str) -> None:
        self.tally.other_exceptions += 1
        tb = traceback.extract_tb(exc.__traceback__)
        where = f"{tb[-1].filename.rsplit('/', 2)[-1]}:{tb[-1].lineno}" if tb else "?"
        self.note(case, step, row, f"unexpected {type(exc).__name__}", f"{exc} at {where} in {what}")

    def run(self, case: Case) -> None:
        self.tally.cases += 1
        if self.path == "sample":
            self.run_stateless(case)
        else:
            self.run_stateful(case)

    # -------------------------------------------------------------- stateful paths
    def run_stateful(self, case: Case) -> None:
        try:
            engine = Engine(case)
        except Exception as exc:  # noqa: BLE001 - counted
            self.other(case, -1, -1, exc, "Sampler construction")
            return
        oracle = Oracle(case.vocab, case.mode, case.eos)
        admitted = self.admit(case, engine, oracle)
        if not any(admitted):
            return
        oracle.freeze(len(case.rows))
        check_rng = random.Random(f"check:{case.index}")
        for t in range(case.steps):
            step = case.step(t)
            keep = [b for b, i in enumerate(step.rows) if admitted[i]]
            if not keep:
                continue
            idx = [step.rows[b] for b in keep]
            logits = step.logits[keep] if len(keep) < len(step.rows) else step.logits
            bitmask = None if step.bitmask is None else step.bitmask[keep]
            record = None if step.record is None else [step.record[b] for b in keep]
            if not self.sample_and_check(case, t, engine, oracle, idx, logits, bitmask, record, check_rng):
                return

    def admit(self, case: Case, engine: Engine, oracle: Oracle) -> list[bool]:
        """Admit every row (a rejected row is replaced by `fallback_spec`); which rows are in."""
        specs = list(case.rows)
        params = [self.params(case, i, spec) for i, spec in enumerate(specs)]
        admitted = [False] * len(specs)
        for attempt in range(2):
            todo = [i for i in range(len(specs)) if not admitted[i] and params[i] is not None]
            requests = [(case.slots[i], params[i], specs[i].prompt, specs[i].outputs, specs[i].position,
                         specs[i].stream) for i in todo]
            start = time.perf_counter()
            try:
                outcomes = engine.admit_all(requests)
            except Exception as exc:  # noqa: BLE001 - counted
                self.other(case, -1, -1, exc, "admission")
                return admitted
            finally:
                self.tally.library_seconds += time.perf_counter() - start
            for i, outcome in zip(todo, outcomes):
                spec = specs[i]
                if isinstance(outcome, TokenSamplerError):
                    self.rejected(case, i, spec, outcome)
                elif isinstance(outcome, BaseException):
                    self.other(case, -1, i, outcome, f"add_request({_params_text(params[i])})")
                else:
                    if spec.bad:
                        self.tally.accepted_invalid += 1
                        self.note(case, -1, i, "invalid input accepted", f"{spec.bad} in {_params_text(spec.kwargs)} "
                                  f"prompt {spec.prompt} outputs {spec.outputs} position {spec.position} "
                                  f"stream {spec.stream}")
                    admitted[i] = True
                    self.tally.requests += 1
                    position = spec.position if spec.position is not None else len(spec.prompt) + len(spec.outputs)
                    oracle.admit(i, params[i], outcome, position, spec.stream, spec.prompt, spec.outputs)
            if attempt == 0:  # the rejected rows: their fallback requests
                for i in range(len(specs)):
                    if not admitted[i]:
                        specs[i] = fallback_spec(i)
                        params[i] = SamplingParams(**specs[i].kwargs)
        return admitted

    def sample_and_check(self, case: Case, t: int, engine: Engine, oracle: Oracle, idx: list[int],
                         logits: torch.Tensor, bitmask: torch.Tensor | None, record: list[bool] | None,
                         check_rng: random.Random) -> bool:
        """One step through the engine, checked against the oracle. False: the case stops."""
        slots = [case.slots[i] for i in idx]
        before = logits.clone()
        self.tally.calls += 1
        start = time.perf_counter()
        try:
            out = engine.sample(logits, slots, record, bitmask)
        except TokenSamplerError as exc:
            self.tally.rejected_valid += 1
            self.note(case, t, -1, "valid step rejected", f"{type(exc).__name__}: {exc}")
            return False
        except Exception as exc:  # noqa: BLE001 - counted
            self.other(case, t, -1, exc, f"sample(B={len(idx)}, V={case.vocab}, Vp={case.padded}, {case.dtype})")
            return False
        finally:
            self.tally.library_seconds += time.perf_counter() - start
        return self.check(case, t, oracle, idx, logits, before, bitmask, out, record, check_rng)

    def check(self, case: Case, t: int, oracle: Oracle, idx: list[int], logits: torch.Tensor,
              before: torch.Tensor, bitmask: torch.Tensor | None, out: SamplerOutput, record: list[bool] | None,
              check_rng: random.Random) -> bool:
        batch = len(idx)
        share = REFERENCE_SHARE[self.path]
        count = min(batch, max(2, math.ceil(share * batch)))
        check = set(check_rng.sample(range(batch), count))
        start = time.perf_counter()
        want, removed, checked, disagree = oracle.step(logits, idx, bitmask, check)
        self.tally.oracle_seconds += time.perf_counter() - start
        self.tally.draws += batch
        self.tally.reference_rows += len(checked)
        ok = True
        if not torch.equal(before.view(torch.int16 if before.element_size() == 2 else torch.int32),
                           logits.view(torch.int16 if logits.element_size() == 2 else torch.int32)):
            self.tally.mismatches += 1
            self.note(case, t, -1, "logits changed by the call", "the caller's logits hold other values after it")
            ok = False
        for b in disagree:
            self.tally.oracle_disagreements += 1
            ref = oracle.reference_row(logits[b], idx[b], None if bitmask is None else bitmask[b:b + 1],
                                       None if want.logprobs is None else int(want.logprobs.top_token_ids.shape[1]))
            self.note(case, t, b, "batched oracle != reference.py", f"{_row_text(want, b)} vs {_row_text(ref, 0)}"
                      f" for {_params_text(oracle.rows[idx[b]].params)} logits {_short(logits[b].tolist())}")
        tokens = out.token_ids.cpu()
        out_of_range = (tokens < 0) | (tokens >= case.vocab)
        picked = removed.gather(1, tokens.clamp(0, case.vocab - 1)[:, None]).squeeze(1)
        invalid = out_of_range | (out.valid.cpu() & picked)
        ref_picked = removed.gather(1, want.token_ids[:, None]).squeeze(1) & want.valid
        if bool(ref_picked.any()):
            self.tally.reference_invalid_ids += int(ref_picked.sum())
            b = int(ref_picked.nonzero()[0])
            self.note(case, t, b, "reference returned a removed id", self.describe(case, oracle, idx, logits, b,
                                                                                 out, want))
            ok = False
        if bool(invalid.any()):
            self.tally.invalid_ids += int(invalid.sum())
            b = int(invalid.nonzero()[0])
            self.note(case, t, b, "invalid id", self.describe(case, oracle, idx, logits, b, out, want))
            ok = False
        bad, what = _differing(out, want)
        width = None if want.logprobs is None else int(want.logprobs.top_token_ids.shape[1])
        border = torch.zeros_like(bad)
        for b in bad.nonzero().squeeze(1).tolist():  # the float64 order at a top-p border: allowed
            if any(not bool(_differing(_take_row(out, b), alt)[0].any()) for alt in oracle.border_outputs(b, width)):
                border[b] = True
        if bool(border.any()):
            self.tally.topp_border += int(border.sum())
            b = int(border.nonzero()[0])
            self.note(case, t, b, "top-p border decided by float64 order (allowed)",
                      self.describe(case, oracle, idx, logits, b, out, want), info=True)
            bad &= ~border
        if bool(bad.any()):
            self.tally.mismatches += int(bad.sum())
            b = int(bad.nonzero()[0])
            self.note(case, t, b, f"mismatch ({what}; {int(bad.sum())} rows)",
                      self.describe(case, oracle, idx, logits, b, out, want))
            ok = False
        if ok:  # a row at a top-p border goes on with the library's choice
            oracle.record(idx, torch.where(border, tokens, want.token_ids), record)
        return ok

    def describe(self, case: Case, oracle: Oracle, idx: list[int], logits: torch.Tensor, b: int,
                 got: SamplerOutput, want: SamplerOutput) -> str:
        row = oracle.rows[idx[b]]
        return (f"got {_row_text(got, b)}; reference {_row_text(want, b)}; V={case.vocab} Vp={case.padded} "
                f"{case.dtype} {case.mode} eos={case.eos} params {_params_text(row.params)} seed {row.seed} "
                f"position {int(oracle.position[idx[b]])} stream {row.stream} prompt {row.prompt} "
                f"outputs {_short(row.outputs, 120)} logits {_short(logits[b].tolist())}")

    # -------------------------------------------------------------- the stateless path
    def run_stateless(self, case: Case) -> None:
        """One `tokensampler.sample` call holding every row (histories and positions passed in)."""
        params = [self.params(case, i, spec) for i, spec in enumerate(case.rows)]
        if any(p is None for p in params):
            return  # `sample` takes the whole batch: a rejected row was counted above
        step = case.step(0)
        specs = case.rows
        positions = None if all(s.position is None for s in specs) else [
            s.position if s.position is not None else len(s.prompt) + len(s.outputs) for s in specs]
        vocab_size = case.vocab if case.padded > case.vocab or case.r.random() < 0.5 else None
        args: dict[str, Any] = dict(prompt_token_ids=[s.prompt for s in specs],
                                    output_token_ids=[s.outputs for s in specs], positions=positions,
                                    vocab_size=vocab_size, logprobs_mode=case.mode, eos_token_ids=list(case.eos),
                                    token_bitmask=step.bitmask)
        logits = step.logits
        rows: Any = params[0] if case.shared and all(s.kwargs == specs[0].kwargs for s in specs) else params
        expect = case.call_error
        bad_history = any(s.bad for s in specs)
        if expect is not None:
            logits, rows, args = self.spoil(case, expect, logits, rows, args)
        before = logits.clone() if isinstance(logits, torch.Tensor) else None
        self.tally.calls += 1
        try:
            out = sample(logits, rows, **args, compile=COMPILE["compile"])
        except TokenSamplerError as exc:
            if expect is None and not bad_history:
                self.tally.rejected_valid += 1
                self.note(case, 0, -1, "valid call rejected", f"{type(exc).__name__}: {exc}")
            else:
                self.tally.library_errors += 1
            return
        except Exception as exc:  # noqa: BLE001 - counted
            self.other(case, 0, -1, exc, f"sample(B={len(specs)}, V={case.vocab}, Vp={case.padded}, {case.dtype},"
                       f" spoiled={expect})")
            return
        if expect is not None or bad_history:
            self.tally.accepted_invalid += 1
            bad = {i: (s.bad, s.kwargs, s.prompt, s.outputs, s.position) for i, s in enumerate(specs) if s.bad}
            self.note(case, 0, -1, "invalid call accepted", f"{expect or _short(bad)}")
            return
        oracle = Oracle(case.vocab, case.mode, case.eos)
        for i, (spec, p) in enumerate(zip(specs, params)):
            position = spec.position if spec.position is not None else len(spec.prompt) + len(spec.outputs)
            oracle.admit(i, p, p.seed, position, 0, spec.prompt, spec.outputs)
        oracle.freeze(len(specs))
        self.tally.requests += len(specs)
        self.check(case, 0, oracle, list(range(len(specs))), logits, before, step.bitmask, out, None,
                   random.Random(f"check:{case.index}"))

    def spoil(self, case: Case, what: str, logits: torch.Tensor, rows: Any,
              args: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
        """One invalid argument of a `sample` call (the library must raise its own error)."""
        args = dict(args)
        if what == "params":
            rows = "not params"
        elif what == "dtype":
            logits = logits.to(_pick(case.r, [torch.float64, torch.int32, torch.int64]))
        elif what == "shape":
            logits = logits.reshape(-1) if case.r.random() < 0.5 else logits[None]
        elif what == "rows":
            rows = (list(rows) if isinstance(rows, list) else [rows] * logits.shape[0]) + [SamplingParams()]
        elif what == "bitmask":
            words = -(-case.vocab // 32)
            args["token_bitmask"] = _pick(case.r, [torch.zeros(logits.shape[0], words, dtype=torch.int64),
                                                   torch.zeros(logits.shape[0] + 1, words, dtype=torch.int32),
                                                   torch.zeros(logits.shape[0], max(0, words - 1), dtype=torch.int32)])
        elif what == "vocab_size":
            args["vocab_size"] = _pick(case.r, [case.padded + 1, 0, -3])
        else:
            args["positions"] = [POSITION_LIMIT] * logits.shape[0]
        return logits, rows, args


# ------------------------------------------------------------------ the campaign
def budgets(draws: int, paths: Sequence[str]) -> dict[str, int]:
    """Draws per path: the kernels (Triton's interpreter, ~0.1 s a row) get a fixed small share."""
    shares = {"torch": 0.90, "sample": 0.05, "split2": 0.025, "split3": 0.025}
    out = {}
    rest = [p for p in paths if p != "kernels"]
    total = sum(shares[p] for p in rest)
    for p in rest:
        out[p] = math.ceil(draws * shares[p] / total)
    if "kernels" in paths:
        out["kernels"] = min(4000, max(60, draws // 25_000))
    return out


def run_campaign(draws_per_path: dict[str, int], seed: int, keep: int = 50, progress: bool = False,
                 max_seconds: float | None = None, threads: int | None = 1, step_scale: int = 1) -> dict[str, Any]:
    """Run each path until it made its draws; the report (per path and total tallies, findings).
    threads: torch's intra-op threads meanwhile (1: the batches are small, and a shared machine
    makes thread synchronisation cost more than it gains); None leaves torch's setting."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels run on CPU tensors
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _campaign(draws_per_path, seed, keep, progress, max_seconds, step_scale)
    finally:
        torch.set_num_threads(before)


def _campaign(draws_per_path: dict[str, int], seed: int, keep: int, progress: bool,
              max_seconds: float | None, step_scale: int) -> dict[str, Any]:
    log = Log(keep)
    tallies: dict[str, Tally] = {}
    start = time.perf_counter()
    for path in PATHS:
        if path not in draws_per_path:
            continue
        tally = tallies[path] = Tally()
        runner = Runner(path, tally, log)
        t0, c0 = time.perf_counter(), time.process_time()
        index = 0
        last = t0
        while tally.draws < draws_per_path[path]:
            runner.run(make_case(seed, path, index, step_scale))
            index += 1
            tally.seconds, tally.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
            if index >= 200 and tally.draws == 0:
                break  # nothing runs: reported as it is
            if max_seconds is not None and time.perf_counter() - start > max_seconds:
                break
            if progress and time.perf_counter() - last > 30:
                last = time.perf_counter()
                print(f"  {path}: {index} cases, {tally.draws:,} draws, {tally.failures} failures, "
                      f"{tally.seconds:.0f} s", file=sys.stderr, flush=True)
    total = Tally()
    for tally in tallies.values():
        total.add(tally)
    return {"seed": seed, "budgets": dict(draws_per_path),
            "paths": {p: dataclasses.asdict(t) for p, t in tallies.items()},
            "total": dataclasses.asdict(total), "failures": total.failures,
            "findings": [dataclasses.asdict(f) for f in log.findings],
            "allowed_examples": [dataclasses.asdict(f) for f in log.info],
            "wall_seconds": time.perf_counter() - start, "cpu_seconds": total.cpu_seconds}


COLUMNS = [("cases", "cases"), ("requests", "rows"), ("draws", "draws"), ("invalid_ids", "invalid ids"),
           ("mismatches", "mismatches"),
           ("library_errors", "library errors"), ("other_exceptions", "other exceptions"),
           ("rejected_valid", "valid input rejected"), ("accepted_invalid", "invalid input accepted"),
           ("topp_border", "top-p border (float64 order)"), ("reference_rows", "rows also through reference.py"),
           ("oracle_disagreements", "batched oracle != reference.py"),
           ("seconds", "wall seconds"), ("cpu_seconds", "CPU seconds")]


def table(report: dict[str, Any]) -> str:
    """The report's figures as a Markdown table (one row per path and the total)."""
    lines = ["| path | " + " | ".join(title for _, title in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for name, tally in list(report["paths"].items()) + [("total", report["total"])]:
        cells = [f"{tally[key]:,.0f}" if key.endswith("seconds") else f"{tally[key]:,}" for key, _ in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    COMPILE["compile"] = args.compile
    started = datetime.datetime.now(datetime.timezone.utc)
    if args.case:
        path, index = args.case.split(":")
        tally, log = Tally(), Log(keep=10_000)
        case = make_case(args.seed, path, int(index), args.step_scale)
        torch.set_num_threads(args.threads)
        print(f"case {path}:{index}: V={case.vocab} Vp={case.padded} {case.dtype} {case.mode} flavour={case.flavour} "
              f"rows={len(case.rows)} steps={case.steps} eos={case.eos} max_logprobs={case.max_logprobs}"
              f" native={case.native} kernel={case.kernel} call_error={case.call_error}")
        Runner(path, tally, log).run(case)
        for finding in log.info + log.findings:
            print(finding.line(args.seed, args.step_scale))
        print(dataclasses.asdict(tally))
        return 1 if tally.failures else 0
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        parser.error(f"unknown paths {unknown}: choose from {PATHS}")
    plan = budgets(args.draws, paths)
    if args.kernel_draws is not None and "kernels" in plan:
        plan["kernels"] = args.kernel_draws
    for item in filter(None, (part.strip() for part in args.budget.split(","))):
        name, _, draws = item.partition("=")
        if name not in plan or not draws.isdigit():
            parser.error(f"--budget {item!r}: expected PATH=DRAWS with PATH among {list(plan)}")
        plan[name] = int(draws)
    print(f"adversarial campaign, seed {args.seed}: {plan}", file=sys.stderr)
    report = run_campaign(plan, args.seed, progress=True, threads=args.threads, step_scale=args.step_scale)
    report.update({
        "command": "python benchmarks/adversarial.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": started.strftime("%Y-%m-%d %H:%M UTC"), "torch": torch.__version__,
        "triton": _version("triton"), "python": platform.python_version(), "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "threads": args.threads, "compile": args.compile, "step_scale": args.step_scale,
    })
    print(table(report))
    for finding in report["findings"][:10]:
        print(Finding(**finding).line(args.seed, args.step_scale))
    print(f"{report['total']['draws']:,} draws in {report['wall_seconds']:.0f} s "
          f"({report['cpu_seconds']:.0f} s of CPU); failures: {report['failures']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return 1 if report["failures"] else 0


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001 - not installed
        return None


if __name__ == "__main__":
    sys.exit(main())
