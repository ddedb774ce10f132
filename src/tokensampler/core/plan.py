"""`plan_step`: what a sampling step must do, decided on the host from the rows' parameters.

Every backend (the torch step, the Triton kernels, the vocabulary split) reads the same plan, so a
step never inspects the device to find out which stages its rows need.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from .params import SamplingParams

# The definition's edits (steps 3-5) and filters (steps 7-10.6), in the definition's order, each named
# by its `StepPlan` flag. "token_bitmask" is the one edit that is a call argument, not a row
# parameter: `StepPlan.edits(token_bitmask=...)` adds it for a masked call. Every name has one
# torch implementation in `backends/torch_step/stages.py` (docs/architecture.md, "Adding a stage").
EDIT_STAGES = ("allowed_ids", "token_bitmask", "bad_words", "min_tokens", "logit_bias", "penalties", "dry")
FILTER_STAGES = ("dynatemp", "min_p", "top_k", "top_p", "top_n_sigma", "typical_p", "epsilon", "eta", "xtc",
                 "mirostat")
# The filters whose kept set is not a threshold of z / T (or that change T per row): their rows take
# the torch step's full-row route (`backends/torch_step/extra_filters.py`), docs/semantics.md 7, 10.1-10.6.
# Mirostat (10.6) also keeps a state per slot (mu, column MU of `SamplerState.mirostat`), updated at step 13.
FULL_ROW_STAGES = ("dynatemp", "top_n_sigma", "typical_p", "epsilon", "eta", "xtc", "mirostat")


def full_row_stages(p: SamplingParams) -> tuple[str, ...]:
    """The full-row stages (`FULL_ROW_STAGES`) a sampled row with these parameters runs, in order
    (none for a greedy row: temperature 0 ignores every filter)."""
    if p.greedy:
        return ()
    on = {"dynatemp": p.dynatemp_range > 0.0, "top_n_sigma": p.top_n_sigma is not None,
          "typical_p": p.typical_p < 1.0, "epsilon": p.epsilon_cutoff > 0.0, "eta": p.eta_cutoff > 0.0,
          "xtc": p.xtc_probability > 0.0, "mirostat": p.mirostat_tau is not None}
    return tuple(name for name in FULL_ROW_STAGES if on[name])


def has_penalties(p: SamplingParams) -> bool:
    """Whether step 5 changes this row: any of the three penalties is not neutral."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


@dataclass(frozen=True)
class StepPlan:
    """What a step must do: the slot of each row, the rows' parameters, and which stages run."""

    slots: tuple[int, ...]
    rows: tuple[SamplingParams, ...]
    greedy_rows: list[int]
    sampled_rows: list[int]
    penalties: bool
    logit_bias: bool
    allowed_ids: bool
    min_tokens: bool
    min_p: bool
    top_k: bool
    top_p: bool
    num_logprobs: list[int]  # -1 = row did not ask
    logprobs_width: int
    bad_words: bool = False  # a row has bad words (step 3, on the slot's recorded output)
    dry: bool = False  # a row has DRY (step 5.1, on the slot's history; greedy rows too)
    dynatemp: bool = False  # a sampled row has a dynamic temperature (step 7)
    top_n_sigma: bool = False  # steps 10.1-10.6, on sampled rows
    typical_p: bool = False
    epsilon: bool = False
    eta: bool = False
    xtc: bool = False
    mirostat: bool = False  # 10.6, with its mu updated at step 13

    def edits(self, token_bitmask: bool = False) -> tuple[str, ...]:
        """The edit stages (steps 3-5) some row of this plan needs, in the definition's order
        (`EDIT_STAGES`); `token_bitmask`: the call passes a token bitmask."""
        if not token_bitmask:
            return self._row_edits
        return tuple(name for name in EDIT_STAGES if name == "token_bitmask" or name in self._row_edits)

    @cached_property
    def _row_edits(self) -> tuple[str, ...]:
        """The edits the rows' parameters ask for (computed once: a plan is reused from step to step)."""
        return tuple(name for name in EDIT_STAGES if name != "token_bitmask" and getattr(self, name))

    @property
    def filters(self) -> tuple[str, ...]:
        """The filter stages (steps 7-10.6) some sampled row of this plan needs, in order (`FILTER_STAGES`)."""
        return tuple(name for name in FILTER_STAGES if getattr(self, name))

    @property
    def full_row(self) -> bool:
        """Some sampled row needs a full-row stage (`FULL_ROW_STAGES`)."""
        return any(getattr(self, name) for name in FULL_ROW_STAGES)

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy and no row removes or changes an id (steps 3-6 change nothing): each
        row's token is the first maximum of its raw logits (a call's token bitmask aside)."""
        return not (self.sampled_rows or self.edits())

    @cached_property
    def wants_logprobs(self) -> bool:
        """Whether some row asked for logprobs."""
        return any(n >= 0 for n in self.num_logprobs)

    @property
    def batch(self) -> int:
        """The number of rows."""
        return len(self.slots)


def plan_step(rows: Sequence[SamplingParams], vocab_size: int, slots: Sequence[int] | None = None) -> StepPlan:
    """The step plan for rows with these parameters (no device access); row b samples slot
    `slots[b]` (default b)."""
    sampled = [b for b, p in enumerate(rows) if not p.greedy]
    num_logprobs = [-1 if p.logprobs is None else (vocab_size if p.logprobs == -1 else min(p.logprobs, vocab_size))
                    for p in rows]
    return StepPlan(
        slots=tuple(range(len(rows)) if slots is None else slots),
        rows=tuple(rows),
        greedy_rows=[b for b, p in enumerate(rows) if p.greedy],
        sampled_rows=sampled,
        penalties=any(has_penalties(p) for p in rows),
        logit_bias=any(p.logit_bias for p in rows),
        allowed_ids=any(p.allowed_token_ids is not None for p in rows),
        min_tokens=any(p.min_tokens > 0 for p in rows),
        min_p=any(rows[b].min_p > 0.0 for b in sampled),
        top_k=any(rows[b].top_k > 0 for b in sampled),
        top_p=any(rows[b].top_p < 1.0 for b in sampled),
        num_logprobs=num_logprobs,
        logprobs_width=max(num_logprobs, default=-1),
        bad_words=any(p.bad_words_token_ids for p in rows),
        dry=any(p.dry for p in rows),
        **{name: True for b in sampled for name in full_row_stages(rows[b])},
    )
