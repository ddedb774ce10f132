"""Argument checks shared by every public entry point: each returns the checked value in the form
the caller uses, or raises `InvalidSamplingParams` naming the field, the value and what is allowed."""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import torch

from .constants import LOGITS_DTYPES
from .errors import InvalidEnvironment, InvalidSamplingParams


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


def as_list(name: str, values: Any, allowed: str) -> list:
    """A sequence (or a 1-d tensor that holds data) as a list; a string, bytes, a mapping, a tensor
    of another shape or anything not iterable is an error naming `name` with `allowed`."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise InvalidSamplingParams(name, tuple(values.shape), f"{allowed} (a 1-d tensor)")
        if values.device.type == "meta":
            raise InvalidSamplingParams(name, "a meta tensor", f"{allowed} (a tensor that holds data)")
        return values.tolist()
    if isinstance(values, (str, bytes, bytearray, Mapping)) or not isinstance(values, Iterable):
        raise InvalidSamplingParams(name, values, allowed)
    try:
        return list(values)
    except TypeError:  # an iterable that cannot be iterated (e.g. a 0-d array)
        raise InvalidSamplingParams(name, values, allowed) from None


def int_list(name: str, values: Any) -> list:
    """A sequence (or a 1-d tensor) as a list; anything else is an error naming `name`. The items
    are not checked here (`check_token_ids`, `check_int` do it with their range)."""
    return as_list(name, values, "a sequence of ints")


def check_choice(name: str, value: Any, choices: Sequence[str], allowed: str | None = None) -> str:
    """`value` if it is one of the strings `choices`."""
    if not isinstance(value, str) or value not in choices:
        raise InvalidSamplingParams(name, value, allowed or f"one of {tuple(choices)}")
    return value


def check_device(name: str, device: Any) -> torch.device:
    """`device` (a torch.device, a string such as "cpu" or "cuda:1", or a CUDA index) as a
    torch.device this machine has: `InvalidSamplingParams` if it names no device, and
    `InvalidEnvironment` if it names one this machine cannot use (CUDA without a CUDA device)."""
    allowed = "a torch.device or a device string such as 'cpu', 'cuda' or 'cuda:0'"
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise InvalidSamplingParams(name, device, allowed)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidSamplingParams(name, device, allowed) from None
    if dev.type == "meta":
        raise InvalidSamplingParams(name, device, "a device that holds data (cpu, cuda)")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidEnvironment(name, device, "cpu: this machine has no CUDA device (torch.cuda.is_available() "
                                     "is False)")
        if dev.index is not None and dev.index >= count:
            raise InvalidEnvironment(name, device, f"cuda or cuda:0 .. cuda:{count - 1} (this machine's CUDA devices)")
    elif dev.type != "cpu":
        try:
            torch.empty(0, device=dev)
        except Exception:  # noqa: BLE001 - any failure means this machine cannot use the device
            raise InvalidEnvironment(name, device, "a device this machine has (cpu, or cuda with a CUDA device)") \
                from None
    return dev


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
