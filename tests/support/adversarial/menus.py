"""The adversarial requests: per-field menus of values at and around the contract's bounds, and `row_spec`."""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

NEG_INF, POS_INF, NAN = float("-inf"), float("inf"), float("nan")
F32_MAX = 3.4028234663852886e38
F32_MIN_NORMAL = 1.1754943508222875e-38
F32_MIN_DENORMAL = 1.401298464324817e-45
F16_MAX, F16_MIN_NORMAL, F16_MIN_DENORMAL = 65504.0, 6.103515625e-05, 5.960464477539063e-08
BF16_MAX = 3.3895313892515355e38
POSITION_LIMIT = 2**32

# Each menu returns (value, valid): `valid` is the contract of SamplingParams / Sampler.add_request.
Menu = Callable[[random.Random, "Ctx", bool], tuple[Any, bool]]

@dataclass
class Ctx:
    """What a row's values may depend on: the vocabulary, the sampler's logprobs cap, the path."""

    vocab: int
    max_logprobs: int
    path: str
    outputs: list[int]
    batch: int = 1
    kwargs: dict[str, Any] = field(default_factory=dict)  # the row's values drawn so far (temperature first)


def _float32_usable(x: float) -> bool:
    """The contract of a temperature or repetition penalty: 0, or at most float32's largest value
    and not rounding to 0 in float32."""
    return x == 0.0 or (abs(x) <= F32_MAX and torch.tensor(x, dtype=torch.float64).to(torch.float32).item() != 0.0)


def pick(r: random.Random, items: Sequence[Any]) -> Any:
    return items[r.randrange(len(items))]


def temperature_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    if bad:
        return pick(r, [-1e-300, -1.0, POS_INF, NAN, NEG_INF, "1.0", True, None]), False
    u = r.random()
    if u < 0.3:
        return pick(r, [0.0, -0.0]), True
    if u < 0.65:
        return pick(r, [0.5, 0.7, 1.0, 1.3, 2.0, r.uniform(0.05, 3.0)]), True
    value = pick(r, [F32_MIN_DENORMAL, 2 * F32_MIN_DENORMAL, 1e-40, F32_MIN_NORMAL, 1e-30, 1e-10, 1e-6, 1e-5,
                      1e-3, 0.05, 1.0000001, 10.0, 1e4, 1e10, 1e30, F32_MAX, BF16_MAX, 10 ** r.uniform(-44, 38),
                      0.75 * F32_MIN_DENORMAL, 5e-324, 1e-46, 3.4028235e38, 3.5e38, 1e300, sys.float_info.max])
    return value, _float32_usable(value)


def top_k_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    v = ctx.vocab
    if bad:
        return pick(r, [-2, -(2**63), 1.0, True, "3", None]), False
    # the kernels' rows are few (Triton's interpreter): there k is mostly on, and near the row's size
    if r.random() < (0.25 if ctx.path == "kernels" else 0.5):
        return 0, True
    near = [1, 2, max(v - 2, 1), max(v - 1, 1), v, v + 1, r.randint(1, v + 1)]
    return pick(r, near * (3 if ctx.path == "kernels" else 1) + [-1, 2 * v + 3, 2**31 - 1, 2**62, 2**63 - 1,
                                                                 2**63, 10**30]), True


def top_p_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    if bad:
        return pick(r, [0.0, -0.0, 1.0000000000000002, 1.5, -0.5, NAN, POS_INF, "0.5"]), False
    if r.random() < 0.45:
        return 1.0, True
    # 1/2, 1/4, 3/4, 1/3, 2/3: top_p * total lands exactly on a mass of the near-tie rows (`random_logits`)
    value = pick(r, [0.9, 0.5, 0.5, 0.25, 0.75, 1 / 3, 2 / 3, 0.1, r.random(), r.random(), 1 - 1e-16, 1 - 1e-7,
                      0.999, 1e-3, 1e-8, 1e-30, 5e-324])
    return value, value > 0.0


def min_p_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    if bad:
        return pick(r, [-1e-300, 1.0000000000000002, NAN, POS_INF, NEG_INF, -0.5]), False
    if r.random() < 0.55:
        return 0.0, True
    return pick(r, [-0.0, 5e-324, 1e-45, 1e-30, 1e-8, 0.01, 0.1, 0.5, 0.9, 0.99, 1 - 1e-7, 1 - 1e-16, 1.0,
                     r.random()]), True


def penalty_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    if bad:
        return pick(r, [2.0000000000000004, -2.0000000000000004, POS_INF, NEG_INF, NAN, 3, "1"]), False
    if r.random() < 0.6:
        return 0.0, True
    return pick(r, [-0.0, 2.0, -2.0, 1.9999999999999998, -1.9999999999999998, 1e-30, -1e-30, 5e-324, -5e-324,
                     0.5, -0.5, r.uniform(-2, 2)]), True


def repetition_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    if bad:
        return pick(r, [0.0, -0.0, -1.0, POS_INF, NAN, "1.1"]), False
    if r.random() < 0.6:
        return 1.0, True
    value = pick(r, [0.5, 0.9, 1.1, 1.3, 2.0, 10.0, 1e-10, 1e-38, F32_MIN_DENORMAL, 1e10, 1e38, F32_MAX,
                      10 ** r.uniform(-40, 38), 0.75 * F32_MIN_DENORMAL, 5e-324, 1e-46, 3.4028235e38, 3.5e38, 1e300])
    return value, _float32_usable(value)


def seed_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    if bad:
        return pick(r, [2**64, -(2**63) - 1, 1.5, "7", True]), False
    choices = [0, 1, 2**32 - 1, 2**32, 2**63 - 1, -(2**63), 2**63, 2**64 - 1, r.randrange(2**64),
               r.randrange(-(2**63), 2**63)]
    if ctx.path != "sample":  # `sample` does not report the seeds it draws: only the stateful paths
        choices += [None, -1]
    return (r.randrange(2**31) if r.random() < 0.5 else pick(r, choices)), True


def logprobs_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    v, cap = ctx.vocab, ctx.max_logprobs
    if bad:
        if ctx.path != "sample":  # `sample` raises its cap to the largest request
            return pick(r, [-2, 1.5, True, cap + 1]), False
        return pick(r, [-2, 1.5, True]), False
    if r.random() < (0.4 if ctx.path == "kernels" else 0.7):
        return None, True
    if ctx.path == "kernels":  # the kernels return up to 20 (a wider step runs the torch step)
        return pick(r, [0, 1, 2, 5, min(v, 20), 20] + ([-1] if v <= 20 else [])), True
    value = pick(r, [0, 1, 2, 5, 20, v, v + 1, -1, min(cap, 1000)])
    return value, value <= cap or ctx.path == "sample"


def logit_bias_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    v = ctx.vocab
    ids = lambda: pick(r, [0, v - 1, r.randrange(v)])  # noqa: E731
    values = lambda: pick(r, [100.0, -100.0, 100.5, -100.5, POS_INF, NEG_INF, 1e300, -1e300, 0.0, -0.0,  # noqa: E731
                               5e-324, 1e-30, r.uniform(-10, 10), 3e38, -3e38, r.uniform(-100, 100), 1, -7])
    bias = {ids(): values() for _ in range(r.randint(1, 4))}
    if bad:
        what = r.randrange(4)
        if what == 0:
            bias[pick(r, [v, v + 5])] = 1.0
        elif what == 1:
            bias[-1] = 1.0
        elif what == 2:
            bias[ids()] = NAN
        else:
            bias[ids()] = pick(r, [True, "1"])
        return bias, False
    return bias, True


def allowed_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    v = ctx.vocab
    if bad:
        return pick(r, [(), (v,), (0, v + 3), (-1,), (0.5,), "0"]), False
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
    stops = tuple(pick(r, [0, v - 1, r.randrange(v)]) for _ in range(r.randint(0, 3)))
    if bad:
        if r.random() < 0.5:
            return (pick(r, [-1, 1.0, None]), stops), False
        return (r.randint(1, 5), stops + (pick(r, [v, -1]),)), False
    return (pick(r, [1, n, n + 1, n + 2, 5, 10**9, 2**62, 2**63 - 1, 2**63]), stops), True


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
        return pick(r, [words + [()], words + [(v,)], words + [(-1,)], "abc"]), False
    return words, True


def dry_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    """DRY's five fields together: (multiplier, base, allowed length, window, breakers); the
    breakers are ids of the output (so they bind) or random ones."""
    v, out = ctx.vocab, ctx.outputs
    breakers = [tuple(r.randrange(v) for _ in range(r.randint(1, 2))) for _ in range(r.randint(0, 2))]
    if out and r.random() < 0.5:
        breakers.append((pick(r, out),))
    value = (pick(r, [0.0, 0.5, 1.0, 3e38]), pick(r, [1.0, 1.75, 1e30]), pick(r, [1, 2, 5]),
             pick(r, [-1, 0, 1, 4, 8192]), breakers)
    if bad:
        index = r.randrange(5)
        wrong = [pick(r, [-1.0, float("nan"), float("inf")]), pick(r, [0.5, float("inf")]), pick(r, [0, -3]),
                 pick(r, [-2, 8193]), pick(r, [[()], [(v,)], [(-1,)], "abc"])][index]
        value = (*value[:index], wrong, *value[index + 1:])
        return value, False
    return value, True


# ------------------------------------------------------------------ the full-row samplers (steps 7, 10.1-10.6)
def _one_bad(r: random.Random, value: tuple, wrong: list[list[Any]]) -> tuple[Any, bool]:
    """`value` with one of its parts replaced by a value from that part's `wrong` list."""
    index = r.randrange(len(wrong))
    return (*value[:index], pick(r, wrong[index]), *value[index + 1:]), False


def dynatemp_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    """(dynatemp_range, dynatemp_exponent): the range a float32 that is 0 or not 0 in float32, with
    temperature + range at most float32's largest; the exponent a finite float >= 0 up to it."""
    value = (pick(r, [0.5, 1.0, 2.0, r.uniform(0, 3), F32_MIN_DENORMAL, 1e-30, 1e10, 1e30, F32_MAX, 0.0]),
             pick(r, [1.0, 1.0, 0.5, 2.0, 0.0, 5e-324, 1e-300, 100.0, F32_MAX, r.uniform(0, 4)]))
    if bad:
        return _one_bad(r, value, [[-1e-300, -1.0, POS_INF, NAN, 3.5e38, 5e-324, 1e-46, "1", None],
                                   [-1e-300, -1.0, POS_INF, NAN, 3.5e38, "1", True]])
    temperature = ctx.kwargs.get("temperature", 1.0)
    base = temperature if isinstance(temperature, float) and math.isfinite(temperature) else 0.0
    return value, value[0] == 0.0 or base + value[0] <= F32_MAX


def top_n_sigma_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    if bad:
        return pick(r, [-0.5, -2.0, -1e-300, NAN, POS_INF, NEG_INF, 3.5e38, "1", True]), False
    return pick(r, [1.0, 1.0, 2.0, 0.5, r.uniform(0, 3), 0.0, -0.0, 5e-324, 1e-10, 1e30, F32_MAX, -1, -1.0]), True


def typical_p_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    if bad:
        return pick(r, [0.0, -0.0, -0.5, 1.0000000000000002, NAN, POS_INF, "0.5", None]), False
    # 1/2, 1/3, 2/3: typical_p * total lands on a sum of the near-tie rows' equal p (`random_logits`)
    return pick(r, [0.5, 0.9, 0.95, 0.2, 1 / 3, 2 / 3, 1 - 1e-16, 1e-3, 5e-324, 1.0, r.random() or 0.5]), True


def cutoff_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    """epsilon_cutoff or eta_cutoff: [0, 1)."""
    if bad:
        return pick(r, [1.0, 1.0000000000000002, -1e-300, -0.5, NAN, POS_INF, "0.1", None]), False
    return pick(r, [3e-4, 1e-3, 0.01, 0.1, 0.5, 0.9, 1 - 1e-16, 5e-324, 1e-30, 0.0, -0.0, r.random()]), True


def xtc_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    """(xtc_probability, xtc_threshold), both in [0, 1]."""
    value = (pick(r, [0.5, 1.0, 1.0, 1 - 1e-16, 5e-324, 0.0, r.random()]),
             pick(r, [0.1, 0.1, 0.0, 0.5, 1.0, 5e-324, 1e-10, 0.3, 1 - 1e-16, r.random()]))
    if bad:
        wrong = [-1e-300, -0.5, 1.0000000000000002, 2.0, NAN, POS_INF, "0.5", None]
        return _one_bad(r, value, [wrong, wrong])
    return value, True


def mirostat_menu(r: random.Random, ctx: Ctx, bad: bool) -> tuple[Any, bool]:
    """(mirostat_tau, mirostat_eta): tau None or -1 (off) or a float in [0, 3.4e38], eta a float in it."""
    value = (pick(r, [5.0, 5.0, 3.0, 1.0, 0.5, r.uniform(0, 10), 0.0, -0.0, 5e-324, 1e30, F32_MAX, -1, -1.0, None]),
             pick(r, [0.1, 0.1, 1.0, 0.5, 0.0, 5e-324, 1e10, F32_MAX, r.random()]))
    if bad:
        return _one_bad(r, value, [[-0.5, -2.0, -1e-300, NAN, POS_INF, 3.5e38, "5", True],
                                   [-1e-300, -0.1, NAN, POS_INF, 3.5e38, None, "0.1"]])
    return value, True


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
    "dry": dry_menu, "dynatemp": dynatemp_menu, "top_n_sigma": top_n_sigma_menu, "typical_p": typical_p_menu,
    "epsilon_cutoff": cutoff_menu, "eta_cutoff": cutoff_menu, "xtc": xtc_menu, "mirostat": mirostat_menu,
}
RARE = {"logit_bias": 0.2, "allowed_token_ids": 0.15, "stop": 0.2, "bad_words_token_ids": 0.12, "dry": 0.2}
# the full-row samplers (steps 7, 10.1-10.6) run row by row in the library and in the oracle: each is on
# in a few rows (mixed: FULL_ROW_RATE, edge: FULL_ROW_EDGE_RATE), at most about FULL_ROW_ROWS rows of a batch
FULL_ROW_RATE, FULL_ROW_EDGE_RATE, FULL_ROW_ROWS = 0.025, 0.25, 8.0
HISTORY_FIELDS = ("prompt_token_ids", "output_token_ids", "position", "stream")
DRY_FIELDS = ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers")
# the SamplingParams keywords of the menus that draw several fields together
GROUPS = {"stop": ("min_tokens", "stop_token_ids"), "dry": DRY_FIELDS,
          "dynatemp": ("dynatemp_range", "dynatemp_exponent"), "xtc": ("xtc_probability", "xtc_threshold"),
          "mirostat": ("mirostat_tau", "mirostat_eta")}
FULL_ROW_MENUS = ("dynatemp", "top_n_sigma", "typical_p", "epsilon_cutoff", "eta_cutoff", "xtc", "mirostat")
# the error fields a bad value may be named by
FIELD_NAMES = dict(GROUPS)


def _rate(name: str, flavour: str, ctx: Ctx) -> float:
    """The probability that a row draws field `name` (else it keeps its default)."""
    if name in FULL_ROW_MENUS:
        return min(FULL_ROW_EDGE_RATE if flavour == "edge" else FULL_ROW_RATE, FULL_ROW_ROWS / ctx.batch)
    return 0.9 if flavour == "edge" else RARE.get(name, 1.0)


def row_spec(r: random.Random, vocab: int, max_logprobs: int, path: str, flavour: str, bad_rate: float,
             batch: int = 1) -> RowSpec:
    """One random request. Flavours: mixed (every field), plain (nothing to remove or add before the
    temperature: the direct route), greedy (temperature 0, nothing else), edge (every field off its
    default)."""
    prompt = [r.randrange(vocab) for _ in range(pick(r, [0, 0, 1, 2, 5, 8]))]
    outputs = [r.randrange(vocab) for _ in range(pick(r, [0, 0, 1, 2, 3, 6]))]
    if outputs and r.random() < 0.3:
        outputs += outputs[:2]  # repeated ids: counts above 1
    kwargs: dict[str, Any] = {"temperature": 0.0} if flavour == "greedy" else {}
    ctx = Ctx(vocab, max_logprobs, path, outputs, batch, kwargs)
    fields = list(FIELDS) if flavour in ("mixed", "edge") else list(PLAIN_FIELDS) if flavour == "plain" \
        else ["seed", "logprobs"]
    bad_field = None
    if r.random() < bad_rate:
        bad_field = pick(r, fields + list(HISTORY_FIELDS))
    bad: list[str] = []
    for name in fields:
        if name != bad_field and r.random() >= _rate(name, flavour, ctx):
            continue
        value, ok = FIELDS[name](r, ctx, name == bad_field)
        if not ok:  # asked for, or a value just outside the contract (a float32 edge, logprobs above the cap)
            bad.append(name)
        if name in GROUPS:
            kwargs.update(zip(GROUPS[name], value))
        else:
            kwargs[name] = value
    position = None if r.random() < 0.7 else pick(r, [0, POSITION_LIMIT - 1, POSITION_LIMIT - 2,
                                                        r.randrange(POSITION_LIMIT)])
    stream = 0 if r.random() < 0.8 else pick(r, [1, 3, POSITION_LIMIT - 1])
    if path == "sample":
        stream = 0  # `sample` has no stream argument
    if bad_field == "prompt_token_ids":
        prompt = prompt + [pick(r, [vocab, -1, vocab + 7])]
    elif bad_field == "output_token_ids":
        outputs = outputs + [pick(r, [vocab, -1])]
    elif bad_field == "position":
        position = pick(r, [POSITION_LIMIT, -1, 2**64])
    elif bad_field == "stream" and path != "sample":
        stream = pick(r, [POSITION_LIMIT, -1])
    if bad_field in HISTORY_FIELDS and (bad_field != "stream" or path != "sample"):
        bad.append(bad_field)
    return RowSpec(kwargs, prompt, outputs, position, stream, tuple(bad))


def fallback_spec(index: int) -> RowSpec:
    """What replaces a rejected request, so that the case goes on (always valid)."""
    return RowSpec({"seed": 1000 + index}, [], [], None, 0)

