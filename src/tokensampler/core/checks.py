"""Argument checks shared by every public entry point: each returns the checked value in the form
the caller uses, or raises `InvalidSamplingParams` naming the field, the value and what is allowed."""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch

from .constants import LOGITS_DTYPES
from .errors import InvalidSamplingParams


def is_int(value: Any) -> bool:
    """A Python int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A Python int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None,
              allowed: str | None = None, error: type[InvalidSamplingParams] = InvalidSamplingParams) -> int:
    """`value` as an int in [low, high] (either bound may be None: open)."""
    if not is_int(value) or (low is not None and value < low) or (high is not None and value > high):
        if allowed is None:
            allowed = ("an int" + (f" in [{low}, {high}]" if low is not None and high is not None
                                   else f" >= {low}" if low is not None else f" <= {high}" if high is not None else ""))
        raise error(name, value, allowed)
    return int(value)


def check_real(name: str, value: Any, low: float, high: float, *, low_open: bool = False,
               high_open: bool = False, allowed: str) -> float:
    """`value` as a finite float in the interval from low to high (each end open or closed)."""
    if not is_real(value) or not math.isfinite(value):
        raise InvalidSamplingParams(name, value, allowed)
    if value < low or (low_open and value == low) or value > high or (high_open and value == high):
        raise InvalidSamplingParams(name, value, allowed)
    return float(value)


def check_bool(name: str, value: Any, allowed: str = "True or False") -> bool:
    if not isinstance(value, bool):
        raise InvalidSamplingParams(name, value, allowed)
    return value


def int_list(name: str, values: Any) -> list:
    """A sequence (or a 1-d tensor) as a list; anything else is an error naming `name`."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise InvalidSamplingParams(name, tuple(values.shape), "a 1-d sequence of ints")
        return values.tolist()
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise InvalidSamplingParams(name, values, "a sequence of ints")
    return list(values)


def check_token_ids(field_name: str, ids: Iterable[int], vocab_size: int) -> None:
    """Raise `InvalidSamplingParams` unless every id is an int in [0, vocab_size)."""
    for token in ids:
        if not is_int(token) or not 0 <= token < vocab_size:
            raise InvalidSamplingParams(field_name, token, f"token ids in [0, {vocab_size})")


def check_slots(name: str, slots: Sequence[int] | torch.Tensor, num_slots: int) -> list[int]:
    """Distinct ints in [0, num_slots), as a list."""
    slot_list = int_list(name, slots)
    for slot in slot_list:
        if not is_int(slot) or not 0 <= slot < num_slots:
            raise InvalidSamplingParams(name, slot, f"slots in [0, {num_slots})")
    if len(set(slot_list)) != len(slot_list):
        raise InvalidSamplingParams(name, slot_list, "distinct slots")
    return slot_list


def check_logits(logits: Any, width: int, device: torch.device, *, what: str = "") -> tuple[int, int]:
    """(batch, width) of a logits tensor `[B, width]` of a float dtype the library reads, on `device`
    (any CUDA device when `device` is CUDA). `what` qualifies the expected shape in the message."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise InvalidSamplingParams("logits", getattr(logits, "shape", logits), f"a 2-d tensor [B, {width}]{what}")
    if logits.shape[1] != width:
        raise InvalidSamplingParams("logits.shape[1]", logits.shape[1], f"{width}{what}")
    if logits.dtype not in LOGITS_DTYPES:
        raise InvalidSamplingParams("logits.dtype", logits.dtype, "float32, float16 or bfloat16")
    if logits.device != device and not (logits.device.type == device.type == "cuda"):
        raise InvalidSamplingParams("logits.device", logits.device, f"the sampler's device {device}")
    return logits.shape[0], logits.shape[1]
