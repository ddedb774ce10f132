"""Checks of the `SamplingGenerator`'s slot, history and position arguments (host side, before
any state changes): each returns the argument in the form the generator uses, or raises
`InvalidSamplingParams` naming the field, the value and what is allowed.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.checks import check_int, check_logits, int_list
from ..core.constants import POSITION_LIMIT
from ..core.errors import InvalidSamplingParams


def token_rows(name: str, value: Any, rows: int, vocab_size: int) -> torch.Tensor:
    """`[rows, S]` int64 ids on the CPU, -1 = padding, each checked against the vocabulary."""
    try:
        ids = value.detach().to("cpu") if isinstance(value, torch.Tensor) else torch.tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise InvalidSamplingParams(name, type(value).__name__, f"a [{rows}, S] tensor of ids") from error
    if ids.dim() != 2 or ids.shape[0] != rows or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise InvalidSamplingParams(name, tuple(ids.shape), f"an integer tensor [{rows}, S], -1 = padding")
    ids = ids.to(torch.int64)
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= vocab_size):
        bad = ids[(ids < -1) | (ids >= vocab_size)][0].item()
        raise InvalidSamplingParams(name, bad, f"token ids in [0, {vocab_size}) or -1 (padding)")
    return ids


def positions_by_slot(positions: Any, live: list[int], num_lanes: int) -> dict[int, int]:
    """slot -> new position for the `live` slots whose entry of `positions` (one per lane) is not None."""
    values = int_list("positions", positions)
    if len(values) != num_lanes:
        raise InvalidSamplingParams("positions", f"{len(values)} entries", f"one per slot ({num_lanes})")
    out = {}
    for slot in live:
        value = values[slot]
        if value is None:
            continue
        check_int(f"positions[{slot}]", value, 0, POSITION_LIMIT - 1,
                  allowed=f"None or an int in [0, {POSITION_LIMIT})")
        out[slot] = value
    return out


def logits_batch(logits: Any, width: int, num_lanes: int, device: torch.device) -> int:
    """The batch of `logits` (`[B, width]`, 1 <= B <= num_lanes), fully checked (shape, dtype, device)
    before the step changes anything."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not 1 <= logits.shape[0] <= num_lanes:
        raise InvalidSamplingParams("logits", getattr(logits, "shape", logits),
                                    f"a tensor [B, {width}] with 1 <= B <= {num_lanes}")
    return check_logits(logits, width, device)[0]


def remapped_prompt_stale(prompt_stale: list[bool], remap: list[int] | None, sampling_mode: str) -> list[bool]:
    """Prompt-row staleness after `remap`: a device-mode remap keeps each row's flag with its
    request; after a host-mode remap the contract asks for the prompts of every slot that
    changed request (an engine sampling on the host owes the device no prompt rows)."""
    if remap is None:
        return list(prompt_stale)
    if sampling_mode == "device":
        return [prompt_stale[j] for j in remap]
    return [prompt_stale[i] or remap[i] != i for i in range(len(remap))]
