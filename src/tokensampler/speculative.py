"""Speculative decoding verification: K drafted tokens checked against the target's logits.

`Sampler.sample_speculative` checks its arguments and calls one of the two verifications here
(docs/speculative.md is the full description):

- `verify_match`: at each position the canonical token of docs/semantics.md (the token plain
  `Sampler.sample` would give there), emitted while the draft equals it. It is K+1 runs of the
  backend step `Backends.choose` picks (torch, Triton kernels or the vocabulary split) with a
  device-side record mask (the rows still matching), so the kernel path needs no host sync.
- `verify_rejection`: Leviathan/Chen speculative sampling. Each draft x is accepted with
  probability min(1, p(x) / q(x)), p the definition's filtered target distribution (the kept set
  of steps 1-10 and the softmax of z / T over it), q the draft's (one-hot on x without draft
  probabilities); at the first rejection a token is drawn from the normalised residual
  max(p - q, 0); after K acceptances the bonus token is the canonical one. p is built by
  `target_rows` from the torch step's own stages (`backends/torch_step/stages.py`: every edit the plan
  needs, bad words and a token bitmask included, then the filters; rows with the full-row samplers
  through `backends/torch_step/extra_filters.py`, as the torch step runs them), on the logits'
  device, one position at a time; the bonus position runs the ordinary backend step.

Both advance the state one position at a time: position j is computed from the slot's history
with the tokens emitted before it in this call already counted (step 13 after every emitted token),
and with Mirostat's mu after them: rejection mode updates mu with the surprise of the token it
emits (accepted draft or residual token) among position j's kept ids.

Noise streams: the acceptance uniforms and the residual's Gumbel noise use streams of their own
(`accept_stream`, `residual_stream`): the request's stream with the top bit set (accept), or the
top two bits set (residual). A request's own streams (choice i of an n > 1 request) are below
2^30, so the three families never meet, and neither depends on the canonical noise of the plain
path, of match mode, or of a draft model sampled with tokensampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backends import Backends
from .backends.torch_step import extra_filters, masking, stages
from .backends.torch_step.argmax import first_argmax
from .backends.torch_step.config import DEFAULT, TorchStepConfig
from .backends.torch_step.indexing import nonzero_ids
from .backends.torch_step.logprobs import gather_logprobs
from .core import rng
from .core.constants import NEG_INF
from .core.order import saturate_posinf
from .core.output import LogprobsOutput, SpeculativeOutput
from .core.plan import StepPlan
from .state import SamplerState

SPECULATIVE_MODES = ("match", "rejection")
STREAM_LIMIT = 2**30  # a request's stream must be below this for rejection mode (higher ones are reserved)
ACCEPT_STREAM_BITS = 0x8000_0000  # stream of the acceptance uniforms: the request's stream | these bits
RESIDUAL_STREAM_BITS = 0xC000_0000  # stream of the residual's Gumbel noise: the request's stream | these bits


def accept_stream(stream: torch.Tensor) -> torch.Tensor:
    """The noise stream of the acceptance uniforms of requests on `stream` (int64, < 2^30)."""
    return stream | ACCEPT_STREAM_BITS


def residual_stream(stream: torch.Tensor) -> torch.Tensor:
    """The noise stream of the residual distribution's Gumbel noise of requests on `stream`."""
    return stream | RESIDUAL_STREAM_BITS


# ------------------------------------------------------------------ the target at one position
@dataclass
class TargetRows:
    """The target at one position, for every row of a batch (docs/semantics.md steps 1-11).

    tokens: int64 [B], the canonical token (what `Sampler.sample` returns there).
    valid: bool [B], False for a row with no id left (its token is the raw greedy id).
    sampled: bool [B], valid rows with temperature > 0 (they have a distribution `final` holds).
    final: float32 [B, V], the final z: on sampled rows z / T over the kept set and -inf
      elsewhere; on greedy rows z after penalties; on rows with no id left, -inf.
    raw: float32 [B, V], the raw z of step 1 with the +inf rule (the raw logprobs' scores); None
      unless asked for (`keep_raw`).
    """

    tokens: torch.Tensor
    valid: torch.Tensor
    sampled: torch.Tensor
    final: torch.Tensor
    raw: torch.Tensor | None


def target_rows(state: SamplerState, logits: torch.Tensor, index: torch.Tensor, plan: StepPlan,
                config: TorchStepConfig = DEFAULT, keep_raw: bool = False,
                token_bitmask: torch.Tensor | None = None, compiled: bool = False) -> TargetRows:
    """Steps 1-11 for the rows of `logits` at their slots' current state, keeping the final z.

    Parameters
    ----------
    state: the sampler's state (unsplit layout); each row reads its slot's parameters, history
        (penalties, bad words, min_tokens: the tokens recorded so far, drafts accepted in this call
        included), seed, position and stream.
    logits: [B, Vp], fp32/fp16/bf16, on the state's device.
    index: int64 [B], the slot of each row (`plan.slots` on the device).
    plan: the step plan of these rows.
    config: the torch step's tunables (the thresholds come from `stages.filter_and_draw`).
    keep_raw: also return the raw scores (a copy of the rows).
    token_bitmask: int32 [B, W >= ceil(V / 32)], this position's token bitmask (xgrammar's layout), or None.
    compiled: the torch step's compiled full-row passes (the sampler's choice).

    Returns
    -------
    TargetRows: the canonical tokens, the kept sets as the final z (the exact thresholds of the
    definition, `exact_threshold=True`), and the raw scores. Nothing is recorded. Every edit of the
    plan (and the bitmask) is the torch step's own stage (`backends/torch_step/stages.py`).
    """
    st = state
    vocab = st.width
    rows = list(plan.rows)
    z = stages.clean_logits(torch.empty((len(rows), vocab), dtype=torch.float32, device=logits.device), logits)
    raw = saturate_posinf(z.clone()) if keep_raw else None
    edits = plan.edits(token_bitmask is not None)
    stages.apply_edits(z, stages.StageRows(st, index, rows, token_bitmask), edits)
    masking.saturate_posinf(z)
    z_max = z.amax(dim=-1)
    valid = z_max > NEG_INF
    valid_host = valid.tolist()
    tokens = torch.zeros(len(rows), dtype=torch.int64, device=z.device)
    greedy = [b for b, p in enumerate(rows) if p.greedy and valid_host[b]]
    if greedy:
        tokens[greedy] = first_argmax(z[greedy])
    sampled = [b for b, p in enumerate(rows) if not p.greedy and valid_host[b]]
    gone: list[int] = []
    if sampled:  # step 7 may underflow a whole row to -inf: no id left
        dead = torch.isneginf(z_max[sampled] / st.temperature[index[sampled]]).tolist()
        gone = [b for b, d in zip(sampled, dead) if d]
        if gone:
            valid[gone] = False
            z[gone] = NEG_INF
            sampled = [b for b, d in zip(sampled, dead) if not d]
    if sampled and extra_filters.needed([rows[b] for b in sampled]):  # steps 7, 10.1-10.5 (full-row route)
        tokens[sampled], turned_greedy = extra_filters.draw_rows(z, z_max, index, rows, sampled, st, config, compiled)
        sampled = [b for b, g in zip(sampled, turned_greedy) if not g]  # T_dyn = 0: a greedy target
    elif sampled:
        everyone = len(sampled) == len(rows)
        zs = z if everyone else z[sampled]
        cols = stages.filter_columns(st, index[sampled], [rows[b] for b in sampled], config, compiled=compiled)
        drawn, tau = stages.filter_and_draw(zs, z_max if everyone else z_max[sampled], cols, exact_threshold=True)
        zs.masked_fill_(zs < tau[:, None], NEG_INF)
        if not everyone:
            z[sampled] = zs
        tokens[sampled] = drawn
    if gone or not all(valid_host):  # no id left: the raw greedy id
        raw_z = raw if raw is not None else masking.prepare_logits(logits, vocab)
        tokens = torch.where(valid, tokens, first_argmax(raw_z))
    is_sampled = torch.zeros_like(valid)
    if sampled:
        is_sampled[sampled] = True
    return TargetRows(tokens, valid, is_sampled, z, raw)


def target_probs(final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax of the final z over the kept ids, as (z_max, total): p_i = exp(z_i - z_max) / total.

    Parameters
    ----------
    final: float32 [R, V], -inf = removed (`TargetRows.final`).

    Returns
    -------
    (z_max float32 [R], total float64 [R]): each row's max (0 for a row with no kept id) and the
    float64 sum of the float32 `exp(z_i - z_max)` over its kept ids, in id order (1 for a row with
    no kept id). Only the kept ids are read after one mask pass, and each row is summed on its own,
    so a row's total does not depend on the other rows."""
    z_max = final.amax(dim=-1)
    z_max = torch.where(torch.isneginf(z_max), torch.zeros_like(z_max), z_max)
    flat = nonzero_ids((final > NEG_INF).view(-1))  # row-major: each row's kept ids, ascending
    rows = flat // final.shape[1]
    e = torch.exp(final.view(-1)[flat] - z_max[rows]).to(torch.float64)
    counts = torch.bincount(rows, minlength=final.shape[0]).tolist()
    total = torch.stack([part.sum() for part in torch.split(e, counts)]) if final.shape[0] else e.new_zeros(0)
    return z_max, torch.where(total > 0, total, torch.ones_like(total))


def _probs_at(final: torch.Tensor, z_max: torch.Tensor, total: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float64 [R]: p at one id per row (int64 [R]; 0 at a removed id)."""
    z = final.gather(1, ids[:, None]).squeeze(1)
    return torch.exp(z - z_max).to(torch.float64) / total


# ------------------------------------------------------------------ outputs, position by position
class _Collected:
    """The [B, K+1] outputs, filled one position at a time (-1 / padding where nothing is emitted)."""

    def __init__(self, batch: int, positions: int, plan: StepPlan, device: torch.device) -> None:
        self.tokens = torch.full((batch, positions), -1, dtype=torch.int64, device=device)
        self.valid = torch.ones((batch, positions), dtype=torch.bool, device=device)
        self.logprobs = LogprobsOutput.empty((batch, positions), plan.logprobs_width, device) \
            if plan.wants_logprobs else None

    def put(self, j: int, emitted: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
            logprobs: LogprobsOutput | None) -> None:
        """Position j: `tokens` (int64 [B]) where `emitted` (bool [B]), -1 elsewhere."""
        self.tokens[:, j] = torch.where(emitted, tokens, -1)
        self.valid[:, j] = valid | ~emitted
        if self.logprobs is not None and logprobs is not None:
            out = self.logprobs
            out.token_logprobs[:, j] = logprobs.token_logprobs.masked_fill(~emitted, 0.0)
            out.token_ranks[:, j] = logprobs.token_ranks.masked_fill(~emitted, 0)
            out.top_token_ids[:, j] = logprobs.top_token_ids.masked_fill(~emitted[:, None], -1)
            out.top_logprobs[:, j] = logprobs.top_logprobs.masked_fill(~emitted[:, None], NEG_INF)

    def result(self) -> SpeculativeOutput:
        num = (self.tokens >= 0).sum(dim=1)
        return SpeculativeOutput(self.tokens, num, self.valid, self.logprobs)


def _records(alive: torch.Tensor, record: torch.Tensor | None) -> torch.Tensor:
    return alive if record is None else alive & record


# ------------------------------------------------------------------ match mode
def verify_match(backends: Backends, target_logits: torch.Tensor, draft_token_ids: torch.Tensor, plan: StepPlan,
                 record: torch.Tensor | None = None, token_bitmask: torch.Tensor | None = None) -> SpeculativeOutput:
    """Match mode: the canonical token at each position, emitted while the draft equals it.

    Parameters
    ----------
    backends: the sampler's backends; each position runs `backends.choose(...)`'s step.
    target_logits: [B, K+1, Vp] (on a split, this rank's slice [B, K+1, Vp / world]), fp32/fp16/bf16.
    draft_token_ids: int64 [B, K] on the sampler's device, each in [-1, V) (-1: no draft from there).
    plan: the step plan of the rows (checked by the `Sampler`).
    record: optional bool [B]; rows where it is False are verified but their state is left as it was.
    token_bitmask: optional int32 [B, K+1, W] (xgrammar's layout, checked by the `Sampler`): position
        j's step removes every id whose bit in `token_bitmask[:, j]` is 0.

    Returns
    -------
    SpeculativeOutput: tokens int64 [B, K+1] (-1 after the last emitted), num_emitted int64 [B],
    valid bool [B, K+1], logprobs per position. Position j of a row is sampled with the tokens
    emitted before it counted into its history: exactly `Sampler.sample` stepped one position at a
    time. The state of every recorded row advances by its emitted tokens.
    """
    batch, positions = target_logits.shape[:2]
    device = draft_token_ids.device
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    out = _Collected(batch, positions, plan, device)
    for j in range(positions):
        logits = target_logits[:, j]
        step = backends.choose(logits, plan)
        mask = None if token_bitmask is None else token_bitmask[:, j]
        result = step.run(logits, plan, _records(alive, record), mask)
        tokens = result.token_ids.clone()  # a backend may reuse its output buffers
        out.put(j, alive, tokens, result.valid, result.logprobs)
        if j == positions - 1:
            break
        alive = alive & (tokens == draft_token_ids[:, j])
        if not step.capturable and not bool(alive.any()):  # the step synchronises anyway: stop early
            break
    return out.result()


# ------------------------------------------------------------------ rejection mode
def _clean_probs(q: torch.Tensor) -> torch.Tensor:
    """Draft probabilities as float64, NaN, infinities and negative entries counted as 0."""
    q = q.to(torch.float64)
    return torch.where(torch.isfinite(q) & (q > 0), q, torch.zeros_like(q))


def _residual_tokens(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, keys: torch.Tensor
                     ) -> torch.Tensor:
    """int64 [R]: the Gumbel argmax of log r + g over the residual r = max(p - q, 0) (p, q float64
    [R, V]; q None: one-hot on `drafts`), g the float32 noise of `keys` (int64 [R], the residual
    stream's row keys) at each id. A row whose residual is empty (p <= q everywhere, possible only
    by rounding) draws from p itself with the same noise."""
    if q is None:
        residual = p.scatter(1, drafts[:, None], 0.0)  # max(p - onehot, 0): p without the draft
    else:
        residual = (p - q).clamp_(min=0.0)
    empty = residual.sum(dim=-1) <= 0
    if bool(empty.any()):
        residual[empty] = p[empty]
    rows, ids = torch.nonzero(residual > 0, as_tuple=True)
    g = rng.gumbel_from_bits(rng.random_bits(keys[rows], ids)).to(torch.float64)
    scores = torch.full_like(residual, NEG_INF)
    scores[rows, ids] = torch.log(residual[rows, ids]) + g
    return scores.argmax(dim=-1)


def _position_logprobs(rows: TargetRows, tokens: torch.Tensor, plan: StepPlan, logprobs_mode: str,
                       compiled: bool = False) -> LogprobsOutput | None:
    """Steps 2 / 12 at the emitted tokens of one position (rows that asked), as the torch step does."""
    if not plan.wants_logprobs:
        return None
    device = tokens.device
    width = max(plan.logprobs_width, 0)
    out = LogprobsOutput.empty((tokens.shape[0],), width, device)
    asked = [b for b, n in enumerate(plan.num_logprobs) if n >= 0]
    scores = rows.raw if logprobs_mode.startswith("raw") else rows.final
    num = torch.tensor([plan.num_logprobs[b] for b in asked], dtype=torch.int64, device=device)
    part = gather_logprobs(scores[asked], tokens[asked], num, width, logprobs_mode.endswith("logprobs"),
                           compiled=compiled)
    out.token_logprobs[asked] = part.token_logprobs
    out.token_ranks[asked] = part.token_ranks
    out.top_token_ids[asked] = part.top_token_ids
    out.top_logprobs[asked] = part.top_logprobs
    return out


def verify_rejection(backends: Backends, target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                     draft_probs: torch.Tensor | None, plan: StepPlan, record: torch.Tensor | None = None,
                     token_bitmask: torch.Tensor | None = None) -> SpeculativeOutput:
    """Rejection mode (Leviathan et al. 2023, Chen et al. 2023) with counter-based noise.

    Parameters
    ----------
    backends: the sampler's backends (unsplit): its state, logprobs mode and torch-step tunables;
        the bonus position runs the step `backends.choose` picks.
    target_logits: [B, K+1, Vp], fp32/fp16/bf16, on the state's device.
    draft_token_ids: int64 [B, K] on the device, each in [-1, V) (-1: no draft from there on).
    draft_probs: None (one-hot drafts) or float [B, K, Vp] on the device: the draft distribution q
        at each drafted position (columns >= V are ignored; negative and NaN entries count as 0).
    plan: the rows' step plan; record: optional bool [B] (False: verified, state left as it was).
    token_bitmask: optional int32 [B, K+1, W] (xgrammar's layout): position j's target removes every
        id whose bit in `token_bitmask[:, j]` is 0 (p is 0 there: such a draft is never accepted,
        the residual never draws it).

    Returns
    -------
    SpeculativeOutput, as `verify_match`. At a drafted position of a sampled row the draft x is
    accepted iff u * q(x) < p(x), u = U(seed, position, x, accept_stream(stream)); on rejection the
    token is the Gumbel argmax of log max(p - q, 0) with the noise of `residual_stream(stream)`. Greedy
    rows (and rows with no id left) accept while the draft equals their canonical token and emit
    that token at the first mismatch. An undrafted position (j = K, or a -1 draft) emits the
    canonical token (at j = K from the ordinary step). Drafts of -1 are never read as ids (their
    gathers use id 0 and are masked).
    """
    batch, positions = target_logits.shape[:2]
    device = target_logits.device
    index = torch.tensor(plan.slots, dtype=torch.int64, device=device)
    st = backends.state
    logprobs_mode, config, compiled = backends.logprobs_mode, backends.torch_step.config, backends.torch_step.compiled
    vocab = st.width
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    out = _Collected(batch, positions, plan, device)
    any_sampled = bool(plan.sampled_rows)
    raw_scores = plan.wants_logprobs and logprobs_mode.startswith("raw")
    for j in range(positions - 1):
        mask = None if token_bitmask is None else token_bitmask[:, j]
        rows = target_rows(st, target_logits[:, j], index, plan, config, keep_raw=raw_scores, token_bitmask=mask,
                           compiled=compiled)
        drafts = draft_token_ids[:, j]
        verify = alive & (drafts >= 0)
        safe = drafts.clamp(min=0)
        emit = rows.tokens.clone()  # the canonical token: undrafted positions, greedy corrections
        accept = verify & ~rows.sampled & (drafts == rows.tokens)
        if any_sampled:
            checked = verify & rows.sampled
            z_max, total = target_probs(rows.final)
            p_draft = _probs_at(rows.final, z_max, total, safe)
            q_draft = torch.ones_like(p_draft)
            if draft_probs is not None:
                q_draft = _clean_probs(draft_probs[:, j].gather(1, safe[:, None]).squeeze(1))
            u = rng.U(st.seed[index], st.position[index], safe, accept_stream(st.stream[index]))
            passed = u * q_draft < p_draft
            accept = torch.where(checked, passed, accept)
            rejected = (checked & ~passed).nonzero().squeeze(1)
            if rejected.numel():
                s = index[rejected]
                keys = rng.row_key(st.seed[s], st.position[s], residual_stream(st.stream[s]))
                p = torch.exp(rows.final[rejected] - z_max[rejected, None]).to(torch.float64) / total[rejected, None]
                q = None if draft_probs is None else _clean_probs(draft_probs[rejected, j, :vocab])
                emit[rejected] = _residual_tokens(p, q, safe[rejected], keys)
        emit = torch.where(accept, drafts, emit)
        safe_emit = torch.where(alive, emit, 0)
        out.put(j, alive, safe_emit, rows.valid, _position_logprobs(rows, safe_emit, plan, logprobs_mode, compiled))
        if plan.mirostat:  # Mirostat's mu moves with the emitted token's surprise (step 13, at record_tokens)
            miro = [b for b in (alive & rows.sampled).nonzero().squeeze(1).tolist()
                    if plan.rows[b].mirostat_tau is not None]
            extra_filters.record_surprise(st, index, rows.final, safe_emit, miro)
        st.record_tokens(index, safe_emit, _records(alive, record))
        alive = accept
        if not bool(alive.any()):
            return out.result()
    # the bonus position: the canonical token, from the ordinary step (it records the alive rows)
    logits = target_logits[:, positions - 1]
    mask = None if token_bitmask is None else token_bitmask[:, positions - 1]
    result = backends.choose(logits, plan).run(logits, plan, _records(alive, record), mask)
    out.put(positions - 1, alive, result.token_ids.clone(), result.valid, result.logprobs)
    return out.result()
