"""The argument checks of `Sampler`'s calls that read no slot state: shapes, dtypes, devices and
ranges of what a call passes (a slot's occupancy is the caller's `check_occupied`). Each raises
`InvalidSamplingParams` (or `UnsupportedOnSplit`) naming the field, before anything changes."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from ..backends.torch_step.config import TorchStepConfig
from ..backends.triton.config import KernelConfig
from ..core.checks import as_list, check_choice, check_int, check_real, check_token_ids, int_list, is_int
from ..core.constants import INT64_MIN, LOGITS_DTYPES, LOGPROBS_MODES, POSITION_LIMIT, UINT64_MAX
from ..core.errors import InvalidSamplingParams, UnsupportedOnSplit
from ..core.params import SamplingParams, check_params_for_vocab
from ..speculative import SPECULATIVE_MODES
from ..state import VocabLayout


def check_sampler(vocab_size: Any, max_slots: Any, padded_vocab_size: Any, world: int, logprobs_mode: Any,
                  max_logprobs: Any, eos_token_ids: Any, step_config: Any, kernel_config: Any) -> tuple:
    """The `Sampler`'s constructor arguments: (vocab_size, padded, max_slots, logprobs_mode,
    max_logprobs, eos ids as a tuple)."""
    check_int("vocab_size", vocab_size, 1)
    check_int("max_slots", max_slots, 1)
    padded = vocab_size if padded_vocab_size is None else padded_vocab_size
    if not is_int(padded) or padded < vocab_size:
        raise InvalidSamplingParams("padded_vocab_size", padded_vocab_size, f"None or an int >= {vocab_size}")
    if padded % world:
        raise InvalidSamplingParams("padded_vocab_size", padded, f"a multiple of the group size {world}")
    check_choice("logprobs_mode", logprobs_mode, LOGPROBS_MODES)
    check_int("max_logprobs", max_logprobs, 0)
    eos = int_list("eos_token_ids", eos_token_ids)
    check_token_ids("eos_token_ids", eos, vocab_size)
    for name, config, kind in (("step_config", step_config, TorchStepConfig),
                               ("kernel_config", kernel_config, KernelConfig)):
        if config is not None and not isinstance(config, kind):
            raise InvalidSamplingParams(name, config, f"None or a {kind.__name__}")
    return vocab_size, padded, max_slots, logprobs_mode, max_logprobs, tuple(eos)


def check_noise(slots: Sequence[int], seeds: Sequence[int | None], positions: Sequence[int | None],
                 streams: Sequence[int], drawn: Sequence[bool] | None, check_occupied: Callable[[int], None]
                 ) -> tuple[list[int], list, list, list[int], list[bool]]:
    """The checked (slots, seeds, positions, streams, drawn) of `set_noise`, as lists."""
    slots, streams = int_list("slots", slots), int_list("streams", streams)
    seeds = as_list("seeds", seeds, "a sequence of seeds (ints, or None)")
    positions = as_list("positions", positions, "a sequence of positions (ints, or None)")
    drawn = [False] * len(slots) if drawn is None else as_list("drawn", drawn, "a sequence of bools")
    for slot in slots:
        check_occupied(slot)
    if len(set(slots)) != len(slots):
        raise InvalidSamplingParams("slots", slots, "distinct slots")
    if not len(slots) == len(seeds) == len(positions) == len(streams) == len(drawn):
        raise InvalidSamplingParams("seeds/positions/streams", (len(seeds), len(positions), len(streams)),
                                    f"one entry per slot ({len(slots)})")
    for name, values, low, high in (("seed", seeds, INT64_MIN, UINT64_MAX),
                                    ("position", positions, 0, POSITION_LIMIT - 1),
                                    ("stream", streams, 0, POSITION_LIMIT - 1)):
        for value in values:
            if value is not None or name == "stream":
                check_int(name, value, low, high)
    for value in drawn:
        if not isinstance(value, bool):
            raise InvalidSamplingParams("drawn", value, "True or False")
    return slots, [None if s is None else int(s) for s in seeds], \
        [None if p is None else int(p) for p in positions], streams, drawn


def check_history(slots: Sequence[int], prompt_token_ids: torch.Tensor | None,
                   output_token_ids: torch.Tensor | None, check_occupied: Callable[[int], None],
                  device: torch.device, vocab_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(slot index, prompt ids, output ids) of `reset_history`: int64 on the device, global ids."""
    slots = int_list("slots", slots)
    for slot in slots:
        check_occupied(slot)
    tensors = []
    for name, ids in (("prompt_token_ids", prompt_token_ids), ("output_token_ids", output_token_ids)):
        if ids is not None:
            if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != len(slots) \
                    or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool \
                    or ids.device.type == "meta":
                raise InvalidSamplingParams(name, getattr(ids, "shape", ids),
                                            f"an integer tensor [{len(slots)}, S] (-1 = padding) that holds data")
            ids = ids.to(device=device, dtype=torch.int64)
            if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= vocab_size):
                raise InvalidSamplingParams(name, (int(ids.min()), int(ids.max())),
                                            f"token ids in [0, {vocab_size}) or -1 (padding)")
        tensors.append(ids)
    index = torch.tensor(list(slots), dtype=torch.int64, device=device)
    return index, tensors[0], tensors[1]


def check_speculative(layout: VocabLayout, device: torch.device, vocab_size: int, target_logits: Any,
                      draft_token_ids: Any, draft_probs: Any,
                      mode: Any, token_bitmask: Any = None) -> tuple[str, torch.Tensor]:
    """`sample_speculative`'s own checks (no state change): (mode, drafts as int64 on the device)."""
    width = layout.columns
    what = " (this rank's slice)" if layout.split else ""
    if mode is None:
        mode = "match" if draft_probs is None else "rejection"
    check_choice("mode", mode, SPECULATIVE_MODES, f"None or one of {SPECULATIVE_MODES}")
    if mode == "rejection" and layout.split:
        raise UnsupportedOnSplit("mode", "rejection", "mode='match' on a vocabulary split (rejection needs "
                                 "each row's whole filtered distribution on one rank)")
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 3 or target_logits.shape[1] < 1:
        raise InvalidSamplingParams("target_logits", getattr(target_logits, "shape", target_logits),
                                    f"a 3-d tensor [B, K+1, {width}]{what}, K >= 0")
    batch, positions, columns = target_logits.shape
    if columns != width:
        raise InvalidSamplingParams("target_logits.shape[2]", columns, f"the padded vocabulary size {width}{what}")
    if target_logits.dtype not in LOGITS_DTYPES:
        raise InvalidSamplingParams("target_logits.dtype", target_logits.dtype, "float32, float16 or bfloat16")
    if target_logits.device != device and not (target_logits.device.type == device.type == "cuda"):
        raise InvalidSamplingParams("target_logits.device", target_logits.device,
                                    f"the sampler's device {device}")
    drafts_shape = (batch, positions - 1)
    ids = draft_token_ids
    if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != drafts_shape or ids.dtype.is_floating_point \
            or ids.dtype.is_complex or ids.dtype == torch.bool or ids.device.type == "meta":
        raise InvalidSamplingParams("draft_token_ids", getattr(ids, "shape", ids),
                                    f"an integer tensor of shape {drafts_shape} (-1 = no draft)")
    drafts = ids.to(device=device, dtype=torch.int64)
    if drafts.numel():
        low, high = torch.stack([drafts.min(), drafts.max()]).tolist()
        if low < -1 or high >= vocab_size:
            raise InvalidSamplingParams("draft_token_ids", low if low < -1 else high,
                                        f"token ids in [0, {vocab_size}), or -1 (no draft from there on)")
    if draft_probs is not None:
        if mode == "match":
            raise InvalidSamplingParams("draft_probs", "a tensor", "None in mode='match' (it compares tokens)")
        probs_shape = (batch, positions - 1, width)
        if not isinstance(draft_probs, torch.Tensor) or tuple(draft_probs.shape) != probs_shape \
                or draft_probs.dtype not in LOGITS_DTYPES + (torch.float64,):
            raise InvalidSamplingParams("draft_probs", getattr(draft_probs, "shape", draft_probs),
                                        f"None or a float16/bfloat16/float32/float64 tensor of shape {probs_shape}")
        if draft_probs.device != target_logits.device:
            raise InvalidSamplingParams("draft_probs.device", draft_probs.device,
                                        f"the device of target_logits ({target_logits.device})")
    if token_bitmask is not None:
        if not isinstance(token_bitmask, torch.Tensor) or token_bitmask.dim() != 3 \
                or tuple(token_bitmask.shape[:2]) != (batch, positions):
            raise InvalidSamplingParams("token_bitmask", getattr(token_bitmask, "shape", token_bitmask),
                                        f"None or an int32 tensor [{batch}, {positions}, W] (one mask per "
                                        "position)")
        check_bitmask(token_bitmask[:, 0], target_logits[:, 0], vocab_size)
    return mode, drafts


def check_bitmask(token_bitmask: Any, logits: torch.Tensor, vocab_size: int) -> None:
    """None, or an int32 [B, W >= ceil(V / 32)] tensor on the logits' device."""
    if token_bitmask is None:
        return
    batch, words = logits.shape[0], -(-vocab_size // 32)
    if not isinstance(token_bitmask, torch.Tensor):
        raise InvalidSamplingParams("token_bitmask", type(token_bitmask).__name__,
                                    f"None or an int32 tensor [{batch}, >= {words}]")
    if token_bitmask.dtype != torch.int32:
        raise InvalidSamplingParams("token_bitmask.dtype", token_bitmask.dtype, "torch.int32 (xgrammar's layout)")
    if token_bitmask.dim() != 2 or token_bitmask.shape[0] != batch or token_bitmask.shape[1] < words:
        raise InvalidSamplingParams("token_bitmask.shape", tuple(token_bitmask.shape),
                                    f"[{batch}, W] with W >= ceil(vocab_size / 32) = {words}")
    if token_bitmask.device != logits.device:
        raise InvalidSamplingParams("token_bitmask.device", token_bitmask.device,
                                    f"the logits' device {logits.device}")


def check_record(record: torch.Tensor | None, batch: int) -> None:
    if record is not None and (not isinstance(record, torch.Tensor) or record.dtype != torch.bool
                               or tuple(record.shape) != (batch,)):
        raise InvalidSamplingParams("record", getattr(record, "shape", record),
                                    f"None or a bool tensor of shape ({batch},)")


def _distinct_occupied(slots: Sequence[int], values: Sequence, name: str,
                       check_occupied: Callable[[int], None]) -> list[int]:
    """`slots` as a list of distinct occupied slots, with one of `values` (the field `name`) per slot."""
    slot_list = int_list("slots", slots)
    if len(values) != len(slot_list):
        raise InvalidSamplingParams(name, f"{len(values)} values", f"one per slot ({len(slot_list)})")
    for slot in slot_list:
        check_occupied(slot)
    if len(set(slot_list)) != len(slot_list):
        raise InvalidSamplingParams("slots", slot_list, "distinct slots")
    return slot_list


def check_advance(slots: Sequence[int], counts: Sequence[int], check_occupied: Callable[[int], None],
                  positions: Callable[[list[int]], list[int]]) -> tuple[list[int], list[int]]:
    """`Sampler.advance`'s (slots, counts): distinct occupied slots, counts >= 0, positions kept
    below 2^32 (`positions`: the slots' current positions, one read)."""
    count_list = int_list("counts", counts)
    slot_list = _distinct_occupied(slots, count_list, "counts", check_occupied)
    for count in count_list:
        check_int("counts", count, 0, allowed="an int >= 0")
    for position, count in zip(positions(slot_list), count_list):
        if position + count >= POSITION_LIMIT:
            raise InvalidSamplingParams("position", position + count, f"below {POSITION_LIMIT}")
    return slot_list, count_list


def check_mus(slots: Sequence[int], mus: Sequence[float | None], check_occupied: Callable[[int], None],
              params: Sequence[SamplingParams | None]) -> tuple[list[int], list[float]]:
    """`Sampler.set_mu`'s (slots, mus) without the None entries: distinct occupied slots, each mu a
    finite float on a slot whose request has Mirostat on (`params`: the host record, by slot)."""
    mu_list = as_list("mus", mus, "a sequence of floats (or None), one per slot")
    slot_list = _distinct_occupied(slots, mu_list, "mus", check_occupied)
    out: tuple[list[int], list[float]] = ([], [])
    for slot, mu in zip(slot_list, mu_list):
        if mu is None:
            continue
        if params[slot].mirostat_tau is None:
            raise InvalidSamplingParams("mus", mu, f"None for slot {slot}: its request has no Mirostat")
        out[0].append(slot)
        out[1].append(check_real("mu", mu, -math.inf, math.inf, allowed="a finite float"))
    return out


def check_moves(dst_slots: Sequence[int], src_slots: Sequence[int], check_slot: Callable[[int], None]
                ) -> tuple[list[int], list[int]]:
    """`Sampler.move_slots`'s (destinations, sources): one source per destination, every slot in
    range, distinct destinations."""
    dst, src = int_list("dst_slots", dst_slots), int_list("src_slots", src_slots)
    if len(dst) != len(src):
        raise InvalidSamplingParams("src_slots", f"{len(src)} slots", f"one per destination ({len(dst)})")
    for slot in dst + src:
        check_slot(slot)
    if len(set(dst)) != len(dst):
        raise InvalidSamplingParams("dst_slots", dst, "distinct slots")
    return dst, src


def check_request(slot: int, params: SamplingParams, prompt_token_ids: Sequence[int],
                  output_token_ids: Sequence[int], position: int | None, stream: int,
                  check_slot: Callable[[int], None], vocab_size: int,
                  max_logprobs: int, split: bool = False) -> tuple[list[int], list[int], int]:
    """`Sampler.add_request`'s checks: returns (prompt, outputs, position), position defaulting to
    len(prompt) + len(outputs); `split`: the sampler is a vocabulary split (`check_params_for_vocab`)."""
    check_slot(slot)
    if not isinstance(params, SamplingParams):
        raise InvalidSamplingParams("params", params, "a SamplingParams")
    check_params_for_vocab(params, vocab_size, max_logprobs, split)
    prompt = token_list("prompt_token_ids", prompt_token_ids, vocab_size)
    outputs = token_list("output_token_ids", output_token_ids, vocab_size)
    if position is None:
        position = len(prompt) + len(outputs)
    check_int("position", position, 0, POSITION_LIMIT - 1, allowed="an int in [0, 2^32)")
    check_int("stream", stream, 0, POSITION_LIMIT - 1, allowed="an int in [0, 2^32)")
    return prompt, outputs, position


def token_list(name: str, ids: Sequence[int] | torch.Tensor, vocab_size: int) -> list[int]:
    """`ids` as a list of token ids in [0, vocab_size)."""
    out = int_list(name, ids)
    check_token_ids(name, out, vocab_size)
    return out
