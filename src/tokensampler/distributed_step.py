"""One sampling step on a vocabulary slice: the order of the definition, with a small all-gather
wherever a step needs the whole row (see `distributed.py` for the list and its sizes).

Every rank runs the same code on the same gathered numbers, so every rank computes the same
tokens and log-probs; the math of each merge is in `ops/distributed_select.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from . import rng
from .ops import distributed_select as sel
from .ops import penalties
from .output import LogprobsOutput, SamplerOutput
from .params import SamplingParams

if TYPE_CHECKING:
    from .distributed import VocabSplit
    from .sampler import StepPlan

NEG_INF = float("-inf")


def _f64(*columns: torch.Tensor) -> torch.Tensor:
    return torch.stack([c.to(torch.float64) for c in columns], dim=-1)


def _saturated_value(value: torch.Tensor, has_posinf: torch.Tensor) -> torch.Tensor:
    """The +inf rule on one value per row: 0 if it is +inf, -inf if another id is +inf."""
    replaced = torch.where(value == float("inf"), torch.zeros_like(value), torch.full_like(value, NEG_INF))
    return torch.where(has_posinf, replaced, value)


def _processed_z(split: VocabSplit, logits: torch.Tensor, index: torch.Tensor, plan: StepPlan):
    """Steps 1 and 3-5 on the slice: (raw z, processed z), float32 [B, width], padding at -inf."""
    st = split.state
    z = logits.to(torch.float32, copy=True)
    z.masked_fill_(torch.isnan(z) | split.padding[None, :], NEG_INF)
    raw = z.clone()
    if plan.allowed_ids:
        z.masked_fill_(~st.allowed_mask[index], NEG_INF)
    if plan.min_tokens and st.stop_mask is not None:
        below = st.output_len[index] < st.min_tokens[index]
        z.masked_fill_(st.stop_mask[index] & below[:, None], NEG_INF)
    if plan.logit_bias:
        z = z + st.logit_bias[index]
    if plan.penalties:
        z = penalties.apply_penalties(z, st.prompt_mask[index], st.output_counts[index],
                                      st.repetition[index], st.frequency[index], st.presence[index])
    return raw, z


def _top_p_threshold(split: VocabSplit, zs: torch.Tensor, p: torch.Tensor, z_max: torch.Tensor,
                     top_p: torch.Tensor) -> torch.Tensor:
    """The smallest kept z whose float64 mass of strictly larger kept z is < top_p * total, found by
    bisection over the ordered float32 keys; `split.top_p_rounds` all-gathers of [S, P]."""
    table = sel.MassAbove(zs, p)
    lo = torch.full_like(z_max, sel.KEY_NEG_INF, dtype=torch.int64)
    hi = sel.ordered_key(z_max)
    bound = None
    for round_index in range(split.top_p_rounds):
        pivots = sel.bisection_pivots(lo, hi, split.top_p_pivots)
        local = table.at(sel.key_to_float(pivots))
        if round_index == 0:
            local = torch.cat([local, table.total()[:, None]], dim=-1)
        mass = split.exchange.all_gather(local).sum(dim=0)
        if round_index == 0:
            bound = top_p * mass[:, -1]
            mass = mass[:, :-1]
        lo, hi = sel.bisection_step(lo, hi, pivots, mass < bound[:, None])
    return sel.key_to_float(hi)


def _filter(split: VocabSplit, zs: torch.Tensor, row_max: torch.Tensor, slots: torch.Tensor, plan: StepPlan,
            k_max: int) -> torch.Tensor:
    """min-p (local: the row max is known), top-k (one all-gather of each rank's candidates) and
    top-p (bisection) on the sampled rows `zs` [S, width], in place; `row_max` is their global max."""
    st = split.state
    if plan.min_p:
        zs.masked_fill_(torch.exp(zs - row_max[:, None]) < st.min_p[slots][:, None], NEG_INF)
    if plan.top_k and k_max > 0:
        candidates = sel.local_top_values(zs, min(k_max, split.width))
        kth = sel.merge_kth_largest(split.exchange.all_gather(candidates), st.top_k[slots])
        zs.masked_fill_(zs < kth[:, None], NEG_INF)
    if plan.top_p:
        top_p = st.top_p[slots].to(torch.float64)
        threshold = _top_p_threshold(split, zs, torch.exp(zs - row_max[:, None]), row_max, top_p)
        zs.masked_fill_((top_p < 1.0)[:, None] & (zs < threshold[:, None]), NEG_INF)
    return zs


def run_split_step(split: VocabSplit, logits: torch.Tensor, index: torch.Tensor, plan: StepPlan,
                   row_params: Sequence[SamplingParams]) -> SamplerOutput:
    """Sample the rows of `logits` (this rank's slice, [B, width]) for slots `index`, whose
    parameters (host mirror) are `row_params`."""
    st, ex, offset = split.state, split.exchange, split.offset
    raw, z = _processed_z(split, logits, index, plan)

    # summaries of the raw and processed rows: max and its first id (+ sum-exp, #+inf for log-probs)
    mode = split.sampler.logprobs_mode if plan.wants_logprobs else None
    z_max_local, z_id_local = sel.local_max_and_id(z, offset)
    raw_max_local, raw_id_local = sel.local_max_and_id(raw, offset)
    raw_at_z = raw.gather(-1, (z_id_local - offset)[:, None]).squeeze(-1)
    columns = [_f64(raw_id_local, z_id_local, raw_at_z, raw_max_local, z_max_local)]
    if mode == "raw_logprobs":
        columns.append(sel.local_sumexp(raw))
    elif mode == "processed_logprobs":
        columns.append(sel.local_sumexp(z))
    g1 = ex.all_gather(torch.cat(columns, dim=-1))
    raw_max, raw_token = sel.merge_max_lowest_id(g1[..., 3], g1[..., 0].to(torch.int64))
    z_max, greedy_token = sel.merge_max_lowest_id(g1[..., 4], g1[..., 1].to(torch.int64))
    raw_posinf, z_posinf = raw_max == float("inf"), z_max == float("inf")
    valid = z_max > NEG_INF
    tokens = torch.where(valid, greedy_token, raw_token)
    z = sel.saturate_with(z, z_posinf)
    z_max_sat = torch.where(z_posinf, torch.zeros_like(z_max), z_max).to(torch.float32)
    greedy_owner = sel.owner_of(g1[..., 1].to(torch.int64), greedy_token)
    raw_at_token = torch.where(valid, sel.pick_rank(g1[..., 2], greedy_owner), raw_max)
    final_at_token = torch.where(valid, z_max_sat.to(torch.float64), torch.full_like(z_max, NEG_INF))
    final, lse = z, None
    if mode in ("raw_logprobs", "processed_logprobs"):
        lse = torch.stack(sel.merge_logsumexp(g1[..., 5:8]))  # processed: greedy rows; sampled rows below

    if plan.sampled_rows:
        rows = torch.tensor(plan.sampled_rows, dtype=torch.int64, device=split.device)
        slots = index[rows]
        temperature = st.temperature[slots]
        zs = z[rows] / temperature[:, None]
        row_max = z_max_sat[rows] / temperature  # division by T > 0 keeps the order: the new max
        zs = sel.saturate_with(zs, row_max == float("inf"))
        row_max = torch.where(row_max == float("inf"), torch.zeros_like(row_max), row_max)
        row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)  # bad rows
        zs = _filter(split, zs, row_max, slots, plan, max(row_params[b].top_k for b in plan.sampled_rows))
        # the Gumbel winner, noise keyed by the global id
        keys = rng.row_key(st.seed[slots], st.position[slots], st.stream[slots])[:, None]
        score = zs + rng.gumbel_from_bits(rng.random_bits(keys, split.global_ids[None, :]))
        score.masked_fill_(torch.isneginf(zs), NEG_INF)
        best_local, best_id_local = sel.local_max_and_id(score, offset)
        column = (best_id_local - offset)[:, None]
        winners = [_f64(best_local, best_id_local, raw[rows].gather(-1, column).squeeze(-1),
                        zs.gather(-1, column).squeeze(-1))]
        if mode == "processed_logprobs":
            winners.append(sel.local_sumexp(zs))
        g2 = ex.all_gather(torch.cat(winners, dim=-1))
        winner = sel.merge_max_lowest_id(g2[..., 0], g2[..., 1].to(torch.int64))[1]
        owner = sel.owner_of(g2[..., 1].to(torch.int64), winner)
        ok = valid[rows]
        tokens[rows] = torch.where(ok, winner, tokens[rows])
        raw_at_token[rows] = torch.where(ok, sel.pick_rank(g2[..., 2], owner), raw_at_token[rows])
        final_at_token[rows] = torch.where(ok, sel.pick_rank(g2[..., 3], owner), final_at_token[rows])
        if mode is not None and mode.startswith("processed"):
            final = z.clone()
            final[rows] = zs
        if mode == "processed_logprobs":
            lse[:, rows] = torch.stack(sel.merge_logsumexp(g2[..., 4:7]))

    out = SamplerOutput(tokens, valid, None)
    if mode is not None:
        if mode.startswith("raw"):
            keys, token_key = sel.saturate_with(raw, raw_posinf), _saturated_value(raw_at_token, raw_posinf)
        else:
            keys, token_key = final, final_at_token
        out.logprobs = _logprobs(split, keys, token_key, lse, plan)
    return out


def _logprobs(split: VocabSplit, keys: torch.Tensor, token_key: torch.Tensor, lse: torch.Tensor | None,
              plan: StepPlan) -> LogprobsOutput:
    """The token's value and rank, and the top-N, from one all-gather of [B, 1 + 2 c] per rank.

    keys: this rank's scores [B, width] (padding at -inf, never counted); token_key: float64 [B],
    the sampled token's score; lse: float64 [2, B], `merge_logsumexp`'s (shift, log_total), in the
    *_logprobs modes, None in the *_logits modes.
    """
    device = keys.device
    width = max(plan.logprobs_width, 0)
    real = ~split.padding
    above = ((keys.to(torch.float64) >= token_key[:, None]) & real[None, :]).sum(dim=-1)
    count = min(width, split.width)
    top_keys, top_ids = sel.local_top_n(keys, split.real_width, split.offset, count)
    gathered = split.exchange.all_gather(torch.cat([above[:, None].to(torch.float64),
                                                    top_keys.to(torch.float64), top_ids.to(torch.float64)], -1))
    ranks = gathered[..., 0].sum(dim=0).to(torch.int64)
    take = min(width, split.vocab_size)
    merged_keys, merged_ids = sel.merge_top_n(gathered[..., 1:1 + count], gathered[..., 1 + count:].to(torch.int64),
                                              take)

    def value(key: torch.Tensor) -> torch.Tensor:
        return key.to(torch.float32) if lse is None else sel.log_softmax_from(key, lse[0], lse[1])

    batch = keys.shape[0]
    top_ids = torch.full((batch, width), -1, dtype=torch.int64, device=device)
    top_values = torch.full((batch, width), NEG_INF, dtype=torch.float32, device=device)
    top_ids[:, :take] = merged_ids
    top_values[:, :take] = value(merged_keys)
    num = torch.tensor([max(n, 0) for n in plan.num_logprobs], dtype=torch.int64, device=device)
    padding = torch.arange(width, device=device)[None, :] >= num[:, None]
    asked = torch.tensor([n >= 0 for n in plan.num_logprobs], dtype=torch.bool, device=device)
    return LogprobsOutput(value(token_key).masked_fill(~asked, 0.0), ranks.masked_fill(~asked, 0),
                          top_ids.masked_fill(padding, -1), top_values.masked_fill(padding, NEG_INF))


def record_split_tokens(split: VocabSplit, index: torch.Tensor, tokens: torch.Tensor,
                        mask: torch.Tensor | None = None) -> None:
    """Count each token on the rank that owns it; every rank advances positions (no host sync).
    mask: optional bool [B]; rows where it is False get + 0 (counted nowhere, not advanced)."""
    st = split.state
    ones = torch.ones_like(index) if mask is None else mask.to(device=index.device, dtype=torch.int64)
    local = tokens - split.offset
    mine = (local >= 0) & (local < split.real_width)
    st.output_counts.index_put_((index, local.clamp(0, split.width - 1)), (mine.to(torch.int64) * ones).to(torch.int32),
                                accumulate=True)
    st.position.index_add_(0, index, ones)
    st.output_len.index_add_(0, index, ones)
