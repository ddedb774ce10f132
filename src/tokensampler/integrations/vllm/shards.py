"""Which logits a tensor-parallel vLLM engine samples: the gathered `[B, V]`, or each rank's shard.

vLLM's LM head leaves each of the `tp` ranks with the columns `[r * Vp / tp, (r + 1) * Vp / tp)` of
the padded vocabulary (`Vp`: the vocabulary padded to a multiple of 64), and vLLM all-gathers the
whole `[B, Vp]` logits to every rank at every step so that every rank can sample the same token. On
the **shard path** the plugin skips that all-gather: each rank's sampler gets its own
`[B, Vp / tp]` slice and samples it with tokensampler's vocabulary split over the tensor-parallel
group (`SamplingGenerator(group=...)`, docs/distributed.md), which returns on every rank exactly the
token (and logprobs) the unsplit sampler returns on the gathered logits, moving a few numbers per
row instead of the logits.

The path is chosen once per engine, when the sampler's state is made (`choose_path`): the shard
path when `TOKENSAMPLER_VLLM_LOGITS=shards` and the engine has more than one tensor-parallel rank,
unless something needs the whole logits row on one rank: speculative decoding (the draft
verification takes the gathered logits), vLLM's custom logits processors (they edit whole rows),
`VLLM_COMPUTE_NANS_IN_LOGITS` (counted on whole rows), a pooling model. The default is the
gathered path: the split sampler moves a few numbers per row instead of the logits, but its step
is plain torch (no fused fast path, no Triton mirror) and costs more than the gathered step saves
on the all-gather for sampled rows on the CPU engine measured (docs/vllm.md). Prompt logprobs
are computed by vLLM from logits it gathers for them; they are not affected. A structured-output
bitmask is applied to each rank's own columns (`apply_bitmask_to_shard`).

Mechanics: while the runner's `execute_model` runs for an engine on the shard path, `sharding(...)`
marks the call, and `LogitsProcessor._get_logits` (hooked by `patches.py`) returns the LM head's
local logits instead of gathering them, when the head's layout is the expected one (no added
vocabulary, the expected padded width); otherwise it gathers as usual and the sampler takes its
own columns of the whole row (`local_columns`), so the tokens are the same either way.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import os
from typing import Any, Iterator

import torch

from ...core.constants import NEG_INF
from ...core.errors import InvalidEnvironment
from ...state.layout import VocabLayout

LOGITS_ENV = "TOKENSAMPLER_VLLM_LOGITS"
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: the LM head's vocabulary is padded to a multiple of it


class LogitsPath(enum.Enum):
    """The logits an engine's sampler reads."""

    GATHERED = "gathered"  # vLLM's all-gathered [B, V] logits (one rank, or something needs whole rows)
    SHARDS = "shards"      # each tensor-parallel rank's [B, Vp / tp] slice, sampled over the group


def shard_layout(rank: int, world_size: int, vocab_size: int) -> VocabLayout:
    """The columns rank `rank` of `world_size` computes: vLLM's LM head pads the vocabulary to a
    multiple of 64 and gives each rank `Vp / world_size` contiguous columns (`offset`, `columns`)."""
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    return VocabLayout(vocab_size, padded, rank, world_size, sliced=True)


def head_matches(layout: VocabLayout, lm_head: Any) -> bool:
    """Whether vLLM's LM head (a `VocabParallelEmbedding`) computes exactly `layout`'s columns."""
    indices = getattr(lm_head, "shard_indices", None)
    return (indices is not None and getattr(lm_head, "num_added_embeddings", 1) == 0
            and getattr(lm_head, "num_embeddings_padded", None) == layout.padded_vocab_size
            and getattr(lm_head, "tp_size", None) == layout.world
            and indices.org_vocab_start_index == layout.offset)


def local_columns(layout: VocabLayout, logits: torch.Tensor) -> torch.Tensor:
    """This rank's `[B, columns]` slice: `logits` itself when it is the shard, else the columns of
    the whole `[B, V]` rows (padding columns at -inf)."""
    width, start = layout.columns, layout.offset
    if logits.shape[-1] == width:
        return logits
    part = logits[:, start:min(start + width, logits.shape[-1])]
    if part.shape[-1] == width:
        return part
    return torch.cat([part, part.new_full((part.shape[0], width - part.shape[-1]), NEG_INF)], dim=1)


def requested_path() -> LogitsPath:
    """`TOKENSAMPLER_VLLM_LOGITS`: "gathered" (the default) or "shards"; anything else is refused."""
    value = os.environ.get(LOGITS_ENV, LogitsPath.GATHERED.value)
    try:
        return LogitsPath(value)
    except ValueError:
        raise InvalidEnvironment(LOGITS_ENV, value, "'gathered' (default) or 'shards'") from None


def choose_path(runner: Any, world_size: int) -> tuple[LogitsPath, str]:
    """The logits path of `runner`'s engine and why (one line, for the log)."""
    from vllm import envs

    from .processors import custom_processors

    requested = requested_path()
    custom = custom_processors(getattr(getattr(runner, "input_batch", None), "logitsprocs", None))
    reasons = [
        (world_size <= 1, "one tensor-parallel rank"),
        (requested is LogitsPath.GATHERED, f"{LOGITS_ENV}=gathered (the default)"),
        (runner.speculative_config is not None, "speculative decoding verifies drafts on gathered logits"),
        (bool(custom), "custom logits processors edit whole rows"),
        (bool(envs.VLLM_COMPUTE_NANS_IN_LOGITS), "VLLM_COMPUTE_NANS_IN_LOGITS counts NaNs in whole rows"),
        (bool(getattr(runner, "is_pooling_model", False)), "a pooling model"),
        (bool(getattr(runner, "broadcast_pp_output", False)), "pipeline output broadcast (external launcher)"),
    ]
    for applies, why in reasons:
        if applies:
            return LogitsPath.GATHERED, why
    return LogitsPath.SHARDS, f"{world_size} tensor-parallel ranks, each samples its own logits columns"


_SHARDING: contextvars.ContextVar[VocabLayout | None] = contextvars.ContextVar("tokensampler_sharding", default=None)


@contextlib.contextmanager
def sharding(layout: VocabLayout | None) -> Iterator[None]:
    """While active (layout not None), the LM head's logits are not gathered (see the module doc)."""
    token = _SHARDING.set(layout)
    try:
        yield
    finally:
        _SHARDING.reset(token)


def skip_gather(lm_head: Any) -> bool:
    """Whether the logits of `lm_head` stay on their rank in the current call."""
    layout = _SHARDING.get()
    return layout is not None and head_matches(layout, lm_head)


def apply_bitmask_to_shard(logits: torch.Tensor, req_ids: list[str], grammar_output: Any,
                           layout: VocabLayout) -> None:
    """vLLM's structured-output bitmask on this rank's columns of `logits` (`[B, width]`, in place):
    row b of the batch takes the bitmask row of its request (none: every id allowed), and column c
    is global id `layout.offset + c`, removed (-inf) where its bit is 0. Without speculative decoding
    (which takes the gathered path), request k of the grammar output owns bitmask row k."""
    bitmask = torch.from_numpy(grammar_output.grammar_bitmask)
    row_of = {rid: b for b, rid in enumerate(req_ids[:logits.shape[0]])}
    rows, masks = [], []
    for k, rid in enumerate(grammar_output.structured_output_request_ids):
        if rid in row_of:
            rows.append(row_of[rid])
            masks.append(k)
    if not rows:
        return
    ids = layout.global_ids("cpu")
    words = bitmask[masks].to(torch.int64)
    word = (ids >> 5).clamp(max=words.shape[1] - 1)
    allowed = ((words[:, word] >> (ids & 31)) & 1).bool() & (ids < words.shape[1] * 32)
    target = logits[rows]
    logits[rows] = target.masked_fill(~allowed.to(logits.device), NEG_INF)
