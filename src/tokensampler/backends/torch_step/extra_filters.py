"""The full-row samplers in torch: dynamic temperature (step 7) and steps 10.1-10.6 of docs/semantics.md
(top-n-sigma, typical-p, epsilon, eta, XTC, Mirostat), for the sampled rows whose parameters turn one on.

Their kept sets are not a threshold of `z / T` (typical-p, XTC) or need quantities of the whole kept
set (entropy, standard deviation), so these rows take a route of their own, `draw_rows`:

1. `T_dyn` per row from the entropy of `softmax(z)` over its kept ids (`dynamic_temperature`); a
   row whose `T_dyn` is 0, or whose ids all underflow at `z / T_dyn`, is greedy from there;
2. min-p, top-k and top-p as the torch step computes them (`stages.filter_and_draw` with the
   exact threshold, on `T_dyn`), which divides the rows in place;
3. the six filters, one row at a time, on the row's kept values in the canonical order (`z`
   descending, lower id first), every quantity float64 and every sum a sequential float64 sum in
   that order (`_sequential_sum`: a cumulative sum, which adds one term after the other); Mirostat
   reads the slot's mu (`SamplerState.mirostat`);
4. the Gumbel argmax of step 11 over the kept ids, with the definition's exact noise; a Mirostat
   row leaves the surprise of its token in the state (`surprise`), which step 13
   (`SamplerState.record_tokens`) turns into the new mu.

Each row is computed as its own 1-d vector laid out as the definition orders it, so that every
element goes through the same torch kernels as in `reference.py` (a vectorised float64 `exp`
treats a block's tail elements with another code path): the route is exact, bit for bit, on the
same device. Sorting a row is accepted here: these rows are the ones that asked for these samplers.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

import torch

from ...core import rng
from ...core.constants import NEG_INF
from ...core.params import SamplingParams
from ...core.plan import full_row_stages
from ...state import SamplerState
from ...state.slots import MU
from . import stages
from .argmax import first_argmax
from .config import DEFAULT, TorchStepConfig


def needed(params: Sequence[SamplingParams]) -> bool:
    """Whether some of these rows runs a full-row stage (`core.plan.FULL_ROW_STAGES`)."""
    return any(full_row_stages(p) for p in params)


# ------------------------------------------------------------------ the float64 quantities of one row
def _sequential_sum(terms: torch.Tensor) -> torch.Tensor:
    """float64 0-d: the terms added one after the other, in their order (a cumulative sum's end)."""
    return torch.cumsum(terms, 0)[-1]


def _ordered(row: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The kept ids of one row (float32 [V], bool [V]) in the canonical order: z descending, the
    lower id first among equal values (a stable sort of the ascending ids)."""
    ids = kept.nonzero().squeeze(-1)
    return ids[torch.sort(row[ids], descending=True, stable=True).indices]


def _weights(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e, S, H) of values x (float64, canonical order, x[0] the max): e = exp(x - max), S their
    sequential sum, H = -sum q log q over q = e / S > 0."""
    e = torch.exp(x - x[0])
    total = _sequential_sum(e)
    q = e / total
    entropy = -_sequential_sum(torch.where(q > 0, q * torch.log(q), torch.zeros_like(q)))
    return e, total, entropy


def dynamic_temperature(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Step 7's float32 T_dyn of one row (z after step 5, float32 [V]): T_min + (T_max - T_min)
    (H / log n)^exponent over its n kept ids; the request's T when n = 1."""
    ids = _ordered(row, row > NEG_INF)
    n = ids.numel()
    if n == 1:
        return torch.tensor(p.temperature, dtype=torch.float32, device=row.device)
    _, _, entropy = _weights(row[ids].to(torch.float64))
    t_min = max(0.0, p.temperature - p.dynatemp_range)
    t_max = p.temperature + p.dynatemp_range
    return (t_min + (t_max - t_min) * (entropy / math.log(n)) ** p.dynatemp_exponent).to(torch.float32)


# ------------------------------------------------------------------ steps 10.1-10.5 on one row
def _top_n_sigma(x: torch.Tensor, n_sigma: float) -> torch.Tensor:
    """10.1: keep x >= max - n sigma (population standard deviation of x)."""
    count = x.numel()
    mean = _sequential_sum(x) / count
    deviation = x - mean
    sigma = torch.sqrt(_sequential_sum(deviation * deviation) / count)
    return x >= x[0] - n_sigma * sigma


def _typical(x: torch.Tensor, mass: float) -> torch.Tensor:
    """10.2: by |-log q - H| ascending (ties in the canonical order), keep while the mass before the
    first id of the score's tie is < mass * S: ids of equal score stay or go together."""
    e, total, entropy = _weights(x)
    score = torch.abs(-torch.log(e / total) - entropy)
    order = torch.sort(score, stable=True).indices
    sorted_score = score[order]
    cumulative = torch.cumsum(e[order], 0)
    before = torch.cat([cumulative.new_zeros(1), cumulative[:-1]])
    place = torch.arange(x.numel(), device=x.device)
    starts = torch.ones_like(sorted_score, dtype=torch.bool)
    starts[1:] = sorted_score[1:] != sorted_score[:-1]
    first = torch.cummax(torch.where(starts, place, 0), 0).values  # each place's tie start
    keep = torch.empty_like(starts)
    keep[order] = before[first] < mass * total
    return keep


def _cutoff(x: torch.Tensor, cutoff: float, eta: bool) -> torch.Tensor:
    """10.3 (epsilon) / 10.4 (eta, bound min(c, sqrt(c) exp(-H))): keep q >= bound, and the maxima."""
    e, total, entropy = _weights(x)
    bound = torch.minimum(torch.tensor(cutoff, dtype=torch.float64, device=x.device),
                          math.sqrt(cutoff) * torch.exp(-entropy)) if eta else cutoff
    return (e / total >= bound) | (x == x[0])


def _xtc(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """10.5 once the coin said yes: with a >= 2 ids of q >= threshold (a prefix of the canonical
    order), the first a - 1 of them go."""
    e, total, _ = _weights(x)
    above = int((e / total >= threshold).sum())
    keep = torch.ones_like(x, dtype=torch.bool)
    if above >= 2:
        keep[:above - 1] = False
    return keep


def _mirostat(x: torch.Tensor, mu: float) -> torch.Tensor:
    """10.6: keep the ids of surprise -log2 q <= mu; if none, the ids tied at the maximum."""
    e = torch.exp(x - x[0])
    keep = -torch.log2(e / _sequential_sum(e)) <= mu
    return keep if bool(keep.any()) else x == x[0]


def surprise(row: torch.Tensor, ids: torch.Tensor, token: int) -> torch.Tensor:
    """float64 0-d: -log2 q'_t, q' the softmax of one row's values (float32 [V]) over its kept `ids`
    (canonical order), t = `token` (one of them): the surprise step 13 updates Mirostat's mu with."""
    x = row[ids].to(torch.float64)
    e = torch.exp(x - x[0])
    q = e / _sequential_sum(e)
    return -torch.log2(q[int((ids == token).nonzero())])


def record_surprise(state: SamplerState, slots: torch.Tensor, final: torch.Tensor, tokens: torch.Tensor,
                    rows: Sequence[int]) -> None:
    """Leave in the state the surprise of `tokens[b]` among the kept ids of `final[b]` (z / T, -inf
    elsewhere) for the rows `rows` (speculative verification: the emitted token, not the drawn one)."""
    for b in rows:
        ids = _ordered(final[b], final[b] > NEG_INF)
        state.mirostat_surprise[slots[b]] = surprise(final[b], ids, int(tokens[b]))


def filter_row(row: torch.Tensor, kept: torch.Tensor, p: SamplingParams, coin: float, mu: float = 0.0
               ) -> torch.Tensor:
    """Steps 10.1-10.6 on one row (z / T float32 [V], its kept ids bool [V] after step 10), each
    filter on what the previous left; coin: the row's XTC coin; mu: its Mirostat mu. Returns the
    kept ids, canonical order."""
    ids = _ordered(row, kept)
    steps = []
    if p.top_n_sigma is not None:
        steps.append(lambda x: _top_n_sigma(x, p.top_n_sigma))
    if p.typical_p < 1.0:
        steps.append(lambda x: _typical(x, p.typical_p))
    if p.epsilon_cutoff > 0:
        steps.append(lambda x: _cutoff(x, p.epsilon_cutoff, eta=False))
    if p.eta_cutoff > 0:
        steps.append(lambda x: _cutoff(x, p.eta_cutoff, eta=True))
    if p.xtc_probability > 0 and coin < p.xtc_probability:
        steps.append(lambda x: _xtc(x, p.xtc_threshold))
    if p.mirostat_tau is not None:
        steps.append(lambda x: _mirostat(x, mu))
    for keep_of in steps:
        ids = ids[keep_of(row[ids].to(torch.float64))]
    return ids


def _gumbel_argmax(row: torch.Tensor, ids: torch.Tensor, key: torch.Tensor) -> int:
    """Step 11 over the ids of one row: the largest fl(z + g), the lowest id on ties."""
    scores = row[ids] + rng.gumbel_from_bits(rng.random_bits(key, ids))
    return int(ids[scores == scores.max()].min())


# ------------------------------------------------------------------ the route
def draw_rows(z: torch.Tensor, z_max: torch.Tensor, slots: torch.Tensor, params: Sequence[SamplingParams],
              rows: Sequence[int], state: SamplerState, config: TorchStepConfig = DEFAULT,
              compiled: bool = False) -> tuple[torch.Tensor, list[bool]]:
    """Steps 7-11 for the sampled rows `rows` of z (float32 [R, V] after step 5, +inf rule applied;
    z_max [R] its finite row maxima; slots int64 [R]; params one per row of z), none of them left
    empty by the request's T. Each row of z is overwritten with its final z (z / T_dyn over the kept
    ids, -inf elsewhere; unchanged where the row turned greedy).

    Returns (tokens int64 [len(rows)], greedy): greedy[i] is True where T_dyn made row i greedy
    (its token is the first maximum of z)."""
    rows = list(rows)
    zs, row_max, row_slots = z[rows], z_max[rows], slots[rows]
    row_params = [params[r] for r in rows]
    temperature = state.temperature[row_slots].clone()
    for i, p in enumerate(row_params):
        if p.dynatemp_range > 0:
            temperature[i] = dynamic_temperature(zs[i], p)
    greedy = ((temperature == 0) | torch.isneginf(row_max / temperature)).tolist()
    tokens = torch.zeros(len(rows), dtype=torch.int64, device=z.device)
    flat = [i for i, g in enumerate(greedy) if g]
    if flat:
        tokens[flat] = first_argmax(zs[flat])
    sampled = [i for i, g in enumerate(greedy) if not g]
    if sampled:
        tokens[sampled] = _filter_and_draw(zs, row_max, row_slots, row_params, temperature, sampled, state,
                                           config, compiled)
    z[rows] = zs
    return tokens, greedy


def _filter_and_draw(zs: torch.Tensor, row_max: torch.Tensor, row_slots: torch.Tensor,
                     row_params: list[SamplingParams], temperature: torch.Tensor, sampled: list[int],
                     state: SamplerState, config: TorchStepConfig, compiled: bool) -> torch.Tensor:
    """Steps 7 (division by T_dyn) to 11 for the rows `sampled` of zs, written back into zs as their
    final z. Returns their tokens."""
    part = zs[sampled]
    cols = stages.filter_columns(state, row_slots[sampled], [row_params[i] for i in sampled], config,
                                 compiled=compiled)
    cols = replace(cols, temperature=temperature[sampled])
    drawn, tau = stages.filter_and_draw(part, row_max[sampled], cols, exact_threshold=True)
    kept = (part >= tau[:, None]) & (part > NEG_INF)
    st = state
    for j, i in enumerate(sampled):
        p = row_params[i]
        if full_row_stages(p) in ((), ("dynatemp",)):
            continue  # no step 10.1-10.6: the threshold's draw is the token
        s = row_slots[i]
        coin = float(rng.xtc_coin(st.seed[s], st.position[s], st.stream[s])) if p.xtc_probability > 0 else 1.0
        mirostat = p.mirostat_tau is not None
        ids = filter_row(part[j], kept[j], p, coin, float(st.mirostat[s, MU]) if mirostat else 0.0)
        kept[j] = False
        kept[j, ids] = True
        drawn[j] = token = _gumbel_argmax(part[j], ids, cols.keys[j])
        if mirostat:  # step 13 turns it into the new mu (`SamplerState.record_tokens`)
            st.mirostat_surprise[s] = surprise(part[j], ids, token)
    zs[sampled] = part.masked_fill_(~kept, NEG_INF)
    return drawn
