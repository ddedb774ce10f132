"""`SplitStep`: one sampling step on a vocabulary slice, every rank computing the same answer.

With `Sampler(..., group=G)` every rank of G passes its own logits slice `[B, Vp / W]`; rank r
owns the global ids `[r * Vp / W, (r + 1) * Vp / W)` and ids >= V (padding, possibly spanning
several ranks) are removed. The step follows the order of the definition, with a small all-gather
wherever a stage needs the whole row; it moves a few numbers per row, never the slice (but for
the rows of a full-row sampler, gathered whole):

    summaries   all-gather [B, 5 (+3)]: raw and processed row max and first id (+ sum-exp, #+inf)
    top-k       all-gather [S, min(k_max, Vp/W)]: each rank's top-k candidates (S sampled rows)
    top-p       `merge.bisection_rounds(P)` all-gathers [S, P (+1)]: float64 mass above P pivots
    winner      all-gather [S, 4 (+3)]: (z + g, global id, raw and processed value) of each rank's winner
    whole rows  all-gather [F, Vp / W] float32 (+ [F] float64 in the raw modes): the F sampled rows
                that turn a full-row sampler on, sampled whole on every rank (`full_rows.py`)
    logprobs    all-gather [B, 1 + 2 N]: count of ids ranked above the token, local top-N

S counts the sampled rows without a full-row sampler; the top-k, top-p and winner all-gathers run
only when S > 0, the whole rows only when F > 0: with F such rows each rank sends 4 F Vp / W bytes
more (and receives 4 F Vp (W - 1) / W), a step without them moves nothing more.
(The `Sampler`'s agreement on the call, before the step, is one more all-gather of int64 [4].)
Every rank runs the same code on the same gathered numbers, so every rank returns the same
tokens and log-probs, equal to the unsplit sampler on the concatenated logits; the math of each
merge is in `merge.py`, the full-row samplers (steps 7, 10.1-10.6: no merge, the rows gathered
whole and run through the torch step's own full-row route) in `full_rows.py`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...core import rng
from ...core.constants import NEG_INF, POS_INF
from ...core.order import KEY_NEG_INF, key_to_float, order_key, saturate_posinf
from ...core.output import LogprobsOutput, SamplerOutput
from ...core.params import SamplingParams
from ...core.plan import FULL_ROW_STAGES, StepPlan
from ...parallel.transport import Exchange
from ...state import SamplerState
from ..torch_step import stages
from . import merge as sel
from .full_rows import RowResults, full_row_split, sample_full_rows

DEFAULT_TOP_P_PIVOTS = 255
# top-p first bisects on each rank's 256 largest values (a top-k pass); the whole slice is sorted
# only in a step whose candidates together hold less than the top-p bound (flat rows)
DEFAULT_TOP_P_CANDIDATES = 256


def _f64(*columns: torch.Tensor) -> torch.Tensor:
    return torch.stack([c.to(torch.float64) for c in columns], dim=-1)


def _saturated_value(value: torch.Tensor, has_posinf: torch.Tensor) -> torch.Tensor:
    """The +inf rule on one value per row: 0 if it is +inf, -inf if another id is +inf."""
    return saturate_posinf(value[:, None], has_posinf)[:, 0]


def _processed_z(split: SplitStep, logits: torch.Tensor, index: torch.Tensor, plan: StepPlan,
                 token_bitmask: torch.Tensor | None = None):
    """Steps 1 and 3-5 on the slice: (raw z, processed z), float32 [B, width], padding at -inf.
    The edits are the torch step's own stages (`torch_step.stages.apply_edits`) on this rank's slice
    state: the token bitmask is read at this rank's bits (global ids offset..); bad words ban
    global ids, each removed on the rank that holds it."""
    z = stages.clean_logits(torch.empty(logits.shape, dtype=torch.float32, device=logits.device), logits,
                            split.padding if split.has_padding else None)
    edits = plan.edits(token_bitmask is not None)
    if not edits:  # nothing below changes z: the raw rows are the same tensor
        return z, z
    raw = z.clone()
    stages.apply_edits(z, stages.StageRows(split.state, index, plan.rows, token_bitmask), edits)
    return raw, z


def _top_p_threshold(split: SplitStep, zs: torch.Tensor, p: torch.Tensor, z_max: torch.Tensor,
                     top_p: torch.Tensor) -> torch.Tensor:
    """The smallest kept z whose float64 mass of strictly larger kept z is < top_p * total, found by
    bisection over the ordered float32 keys; `split.top_p_rounds` all-gathers of [S, P].

    Each rank first answers from its `split.top_p_candidates` largest values (`CandidateMass`: a
    top-k pass, no sort); a round in which some comparison needs more than the candidates give (the
    ranks' candidates together hold less than the bound, as in flat rows) is evaluated again, from
    then on, with every rank's whole slice sorted (`MassAbove`): the same threshold either way."""
    candidates = 0 < split.top_p_candidates < zs.shape[-1]
    table: sel.MassAbove | sel.CandidateMass = (sel.CandidateMass(zs, p, split.top_p_candidates) if candidates
                                                else sel.MassAbove(zs, p))
    lo = torch.full_like(z_max, KEY_NEG_INF, dtype=torch.int64)
    hi = order_key(z_max)
    bound, floors = None, None
    for round_index in range(split.top_p_rounds):
        pivots = sel.bisection_pivots(lo, hi, split.top_p_pivots)
        values = key_to_float(pivots)
        local = table.at(values)
        if round_index == 0:  # with the pivots' masses: the total, and the candidates' floor
            extra = [table.total()[:, None]] + ([table.floor.to(torch.float64)[:, None]] if candidates else [])
            gathered = split.exchange.all_gather(torch.cat([local, *extra], dim=-1))
            width = local.shape[-1]
            bound = top_p * gathered[..., width].sum(dim=0)
            floors = gathered[..., width + 1] if candidates else None
            mass = gathered[..., :width].sum(dim=0)
        else:
            mass = split.exchange.all_gather(local).sum(dim=0)
        below = sel.bisection_below(mass, bound, values, floors)
        if below is None:  # on every rank alike (gathered values): the exact masses from here on
            table, floors = sel.MassAbove(zs, p), None
            below = split.exchange.all_gather(table.at(values)).sum(dim=0) < bound[:, None]
        lo, hi = sel.bisection_step(lo, hi, pivots, below)
    return key_to_float(hi)


def _scores(zs: torch.Tensor, keys: torch.Tensor, global_ids: torch.Tensor) -> torch.Tensor:
    """`zs + g` at the kept ids (-inf elsewhere), g the Gumbel noise of (row key, global id): the
    noise is computed only where an id is kept (after top-k / top-p / min-p a few per row), or on
    the whole slice when most ids are kept. The same values either way."""
    kept = ~torch.isneginf(zs)
    if int(kept.sum()) * 4 > kept.numel():
        score = zs + rng.gumbel_from_bits(rng.random_bits(keys[:, None], global_ids[None, :]))
        return score.masked_fill_(~kept, NEG_INF)
    rows, columns = kept.nonzero(as_tuple=True)
    score = torch.full_like(zs, NEG_INF)
    score[rows, columns] = zs[rows, columns] + rng.gumbel_from_bits(rng.random_bits(keys[rows], global_ids[columns]))
    return score


def _min_p(split: SplitStep, zs: torch.Tensor, row_max: torch.Tensor, slots: torch.Tensor, k_max: int) -> None:
    """min-p, local: the row max is the gathered one."""
    zs.masked_fill_(torch.exp(zs - row_max[:, None]) < split.state.min_p[slots][:, None], NEG_INF)


def _top_k(split: SplitStep, zs: torch.Tensor, row_max: torch.Tensor, slots: torch.Tensor, k_max: int) -> None:
    """top-k: the k-th largest value merged from each rank's candidates (one all-gather)."""
    if k_max > 0:
        candidates = sel.local_top_values(zs, min(k_max, split.width))
        kth = sel.merge_kth_largest(split.exchange.all_gather(candidates), split.state.top_k[slots])
        zs.masked_fill_(zs < kth[:, None], NEG_INF)


def _top_p(split: SplitStep, zs: torch.Tensor, row_max: torch.Tensor, slots: torch.Tensor, k_max: int) -> None:
    """top-p: the threshold by bisection over the gathered masses (`_top_p_threshold`)."""
    top_p = split.state.top_p[slots].to(torch.float64)
    threshold = _top_p_threshold(split, zs, torch.exp(zs - row_max[:, None]), row_max, top_p)
    zs.masked_fill_((top_p < 1.0)[:, None] & (zs < threshold[:, None]), NEG_INF)


# the split's exact merge of each filter of the definition (`core.plan.FILTER_STAGES`; a filter
# added to the definition needs its merge here, or its place in SPLIT_WHOLE_ROWS:
# tests/split/test_distributed.py checks the names)
SPLIT_FILTERS = {"min_p": _min_p, "top_k": _top_k, "top_p": _top_p}
# the full-row stages have no merge: their rows are gathered whole and run the torch step's
# full-row route on every rank (`full_rows.py`)
SPLIT_WHOLE_ROWS = FULL_ROW_STAGES


def _filter(split: SplitStep, zs: torch.Tensor, row_max: torch.Tensor, slots: torch.Tensor, plan: StepPlan,
            k_max: int) -> torch.Tensor:
    """The plan's filters (min-p, top-k, top-p, in order, `SPLIT_FILTERS`) on the sampled rows `zs`
    [S, width], in place; `row_max` is their global max."""
    for name in plan.filters:
        if name in SPLIT_FILTERS:  # (the full-row stages' rows are not among these: `full_rows.py`)
            SPLIT_FILTERS[name](split, zs, row_max, slots, k_max)
    return zs


def run_split_step(split: SplitStep, logits: torch.Tensor, index: torch.Tensor, plan: StepPlan,
                   row_params: Sequence[SamplingParams], token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
    """Steps 1-12 on this rank's slice, every rank computing the same result.

    Parameters
    ----------
    split: the step (its state, exchange and layout).
    logits: [B, width], this rank's columns of the batch (fp32, fp16 or bf16).
    index: int64 [B], the slot of each row.
    plan: the step plan; row_params: the rows' parameters (host mirror).
    token_bitmask: int32 [B, W], the whole (global) mask of the call, or None.

    Returns
    -------
    SamplerOutput with global token ids, equal on every rank to the unsplit sampler's output on
    the concatenated logits."""
    st, ex, offset = split.state, split.exchange, split.offset
    raw, z = _processed_z(split, logits, index, plan, token_bitmask)

    # summaries of the raw and processed rows: max and its first id (+ sum-exp, #+inf for log-probs)
    mode = split.logprobs_mode if plan.wants_logprobs else None
    z_max_local, z_id_local = sel.local_max_and_id(z, offset)
    raw_max_local, raw_id_local = (z_max_local, z_id_local) if raw is z else sel.local_max_and_id(raw, offset)
    raw_at_z = raw.gather(-1, (z_id_local - offset)[:, None]).squeeze(-1)
    columns = [_f64(raw_id_local, z_id_local, raw_at_z, raw_max_local, z_max_local)]
    if mode == "raw_logprobs":
        columns.append(sel.local_sumexp(raw))
    elif mode == "processed_logprobs":
        columns.append(sel.local_sumexp(z))
    g1 = ex.all_gather(torch.cat(columns, dim=-1))
    raw_max, raw_token = sel.merge_max_lowest_id(g1[..., 3], g1[..., 0].to(torch.int64))
    z_max, greedy_token = sel.merge_max_lowest_id(g1[..., 4], g1[..., 1].to(torch.int64))
    raw_posinf, z_posinf = raw_max == POS_INF, z_max == POS_INF
    valid = z_max > NEG_INF
    tokens = torch.where(valid, greedy_token, raw_token)
    if bool(z_posinf.any()):  # (a host read: the split step reads gathered numbers on the host anyway)
        z = saturate_posinf(z, z_posinf)
    z_max_sat = torch.where(z_posinf, torch.zeros_like(z_max), z_max).to(torch.float32)
    greedy_owner = sel.owner_of(g1[..., 1].to(torch.int64), greedy_token)
    raw_at_token = torch.where(valid, sel.pick_rank(g1[..., 2], greedy_owner), raw_max)
    final_at_token = torch.where(valid, z_max_sat.to(torch.float64), torch.full_like(z_max, NEG_INF))
    final, lse = z, None
    if mode in ("raw_logprobs", "processed_logprobs"):
        lse = torch.stack(sel.merge_logsumexp(g1[..., 5:8]))  # processed: greedy rows; sampled rows below

    full_rows, plain_rows = full_row_split(plan.sampled_rows, row_params)
    if plan.sampled_rows and mode is not None and mode.startswith("processed"):
        final = z.clone()
    if full_rows:  # steps 7, 10.1-10.6: the whole rows gathered, the torch step's full-row route (`full_rows.py`)
        results = RowResults(tokens, valid, raw_at_token, final_at_token, final if final is not z else None, lse)
        sample_full_rows(split, z, raw, index, full_rows, row_params, z_max_sat, raw_max, raw_token, results, mode)
    if plain_rows:
        rows = torch.tensor(plain_rows, dtype=torch.int64, device=split.device)
        slots = index[rows]
        temperature = st.temperature[slots]
        zs = z[rows] / temperature[:, None]
        row_max = z_max_sat[rows] / temperature  # division by T > 0 keeps the order: the new max
        # every kept id underflows to -inf at the division: no id left, the raw greedy id, invalid
        emptied = valid[rows] & torch.isneginf(row_max)
        valid[rows] &= ~emptied
        tokens[rows] = torch.where(emptied, raw_token[rows], tokens[rows])
        raw_at_token[rows] = torch.where(emptied, raw_max[rows], raw_at_token[rows])
        final_at_token[rows] = torch.where(emptied, NEG_INF, final_at_token[rows])
        if bool((row_max == POS_INF).any()):
            zs = saturate_posinf(zs, row_max == POS_INF)
        row_max = torch.where(row_max == POS_INF, torch.zeros_like(row_max), row_max)
        row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)  # bad rows
        zs = _filter(split, zs, row_max, slots, plan, max(row_params[b].top_k for b in plain_rows))
        # the Gumbel winner, noise keyed by the global id
        keys = rng.row_key(st.seed[slots], st.position[slots], st.stream[slots])
        score = _scores(zs, keys, split.global_ids)
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
        if final is not z:
            final[rows] = zs
        if mode == "processed_logprobs":
            lse[:, rows] = torch.stack(sel.merge_logsumexp(g2[..., 4:7]))

    out = SamplerOutput(tokens, valid, None)
    if mode is not None:
        if mode.startswith("raw"):
            keys, token_key = saturate_posinf(raw, raw_posinf), _saturated_value(raw_at_token, raw_posinf)
        else:
            keys, token_key = final, final_at_token
        out.logprobs = _logprobs(split, keys, token_key, lse, plan)
    return out


def _logprobs(split: SplitStep, keys: torch.Tensor, token_key: torch.Tensor, lse: torch.Tensor | None,
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


class SplitStep:
    """The split step of one `Sampler`'s slice state: `run(logits, plan, record) -> SamplerOutput`,
    the same on every rank of the exchange. `top_p_pivots`: pivots per bisection round;
    `top_p_candidates`: the largest values per row and rank top-p bisects on before it sorts the
    slice (0: always sort). Neither changes a token."""

    capturable = False  # its agreement and its bisection read gathered numbers on the host

    def __init__(self, state: SamplerState, logprobs_mode: str, exchange: Exchange,
                 top_p_pivots: int = DEFAULT_TOP_P_PIVOTS,
                 top_p_candidates: int = DEFAULT_TOP_P_CANDIDATES) -> None:
        layout = state.layout
        self.state = state
        self.logprobs_mode = logprobs_mode
        self.exchange = exchange
        self.device = state.device
        self.vocab_size = layout.vocab_size
        self.width = layout.columns
        self.offset = layout.offset
        self.real_width = layout.real_width
        self.top_p_pivots = top_p_pivots
        self.top_p_rounds = sel.bisection_rounds(top_p_pivots)
        self.top_p_candidates = top_p_candidates
        self.global_ids = layout.global_ids(self.device)
        self.padding = self.global_ids >= self.vocab_size
        self.has_padding = layout.real_width < layout.columns  # some of this rank's columns are padding

    def run(self, logits: torch.Tensor, plan: StepPlan, record: torch.Tensor | None = None,
            token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """Sample this rank's slice `logits` [B, width] for the slots of `plan`; rows where the bool
        [B] `record` is False are sampled but neither counted nor advanced. `token_bitmask`: the
        call's whole int32 [B, W] mask (this rank reads the bits of its columns), or None."""
        index = torch.tensor(plan.slots, dtype=torch.int64, device=self.device)
        out = run_split_step(self, logits, index, plan, plan.rows, token_bitmask)
        self.state.record_tokens(index, out.token_ids, record)
        return out
