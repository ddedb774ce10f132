"""Log-probabilities of a step: the sampled token's value and rank, and the top-N ids (step 2/12).

Values are `log_softmax` (or the scores themselves, in the `*_logits` modes) over `[0, V)`; ranks
and the top-N order are taken on the scores, value then lower id, so rounding to logprobs never
creates or breaks a tie. Nothing of the row's size is written:

- **row stats while the rows are in cache** (`row_stats`): chunk maxima (runs of `CHUNK` ids)
  and the row max from one max pass; the normaliser `S = sum exp(x - max)` from one compiled pass.
  `log_softmax` is needed only at the token and the top-N ids: `(x - max) - log(S)`. `S` is summed
  in the order of ATen's CPU `log_softmax` (one float32 accumulator per vector lane, sequential
  over the row, the tail added to the first lanes, then the lanes folded in halves), so the values
  stay within a few float32 ulps of `torch.log_softmax` (a float64 sum would be *more* accurate and
  differ from it by up to ~1e-5: ATen's float32 lanes drop tiny terms). Tested bound:
  |diff| <= 1e-6 + 1e-6 |value| (docs/semantics.md).
- **top-N from chunk maxima.** The N chunks first by (chunk max desc, chunk index asc) hold the N
  ids first by (score desc, id asc) (each chunk's best id ranks ahead of every other id of the
  chunk): `topk` twice on small int64 keys that encode (value desc, id asc) exactly
  (`core.order.value_id_keys`), over the chunk maxima and over the N x CHUNK gathered scores. Exact, ties at the
  N-th value included.
- **rank** (ids with a score >= the token's): counted in the chunks whose max reaches the token's
  score (`ranks_from_chunks`), a full-row count when too many do.

After the stats, the scores are only gathered (`ScoreRows`: clean float32 scores, or raw logits
rows cleaned in what is gathered). Without torch.compile, or where ATen's lane width is unknown,
the values come from `torch.log_softmax` of the rows (exact). Clean scores: float32 without NaN
or +inf (the caller's `masking` rules); -inf = removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.constants import NEG_INF
from ...core.order import value_id_keys
from ...core.output import LogprobsOutput
from . import compile_cache, torch_private

CHUNK = 64  # ids per chunk of the top-N search (V / CHUNK chunk maxima per row)
RANK_CHUNKS = 256  # most chunks a rank is counted in before a full-row count
_ATEN_LANES = {"AVX512": 16, "AVX2": 8}  # float32 lanes of ATen's Vectorized<float> per capability


def aten_lanes() -> int:
    """float32 lanes of the vector unit ATen's CPU `log_softmax` runs on and inductor compiles for;
    0 when they are unknown or differ (then the exact eager path is used)."""
    lanes = _ATEN_LANES.get(torch.backends.cpu.get_cpu_capability(), 0)
    if lanes and torch_private.vector_lanes() != lanes:
        return 0
    return lanes


def log_softmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """log_softmax per row; a row with every id at -inf stays at -inf (instead of NaN)."""
    values = torch.log_softmax(scores, dim=-1)
    all_removed = scores.amax(dim=-1, keepdim=True) == NEG_INF
    return values.masked_fill_(all_removed, NEG_INF) if bool(all_removed.any()) else values


class ScoreRows:
    """The scores of some rows, read by gathers: either clean float32 scores, or the raw logits rows
    themselves (any float dtype, NaN = removed: cleaned in what is gathered), so that the raw modes
    need no float32 copy of the rows. `full()` is the clean float32 [R, V] (a copy if raw)."""

    def __init__(self, scores: torch.Tensor, clean: bool = True) -> None:
        self.scores, self.clean = scores, clean
        self._full = scores if clean else None

    @property
    def shape(self) -> torch.Size:
        return self.scores.shape

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        values = self.scores.gather(-1, ids)
        if self.clean:
            return values
        values = values.to(torch.float32)
        return values.masked_fill_(torch.isnan(values), NEG_INF)

    def full(self) -> torch.Tensor:
        if self._full is None:
            full = self.scores.to(torch.float32, copy=True)
            self._full = full.masked_fill_(torch.isnan(full), NEG_INF)
        return self._full


def _as_rows(scores) -> ScoreRows:
    return scores if isinstance(scores, ScoreRows) else ScoreRows(scores)


@dataclass
class RowStats:
    """Per-row facts of clean float32 scores [R, V], from passes over the rows while they are in
    cache: chunk maxima float32 [R, ceil(V / CHUNK)], row max float32 [R], and log S float32 [R]
    (the normaliser in ATen's order, NaN where the row max is -inf; None if not asked/not compiled)."""
    maxima: torch.Tensor
    row_max: torch.Tensor
    log_sum: torch.Tensor | None


def fast_normaliser(vocab: int, compiled: bool) -> int:
    """ATen's lane count when the compiled normaliser applies (`compiled`, the sampler's choice;
    known lanes; its compiled function not fallen back to eager), else 0."""
    lanes = aten_lanes() if compiled and not compile_cache.runs_eagerly("logprob_lanes") else 0
    return lanes if vocab >= lanes else 0


def row_stats(scores: torch.Tensor, normalise: bool, compiled: bool = False) -> RowStats:
    """scores: clean float32 [R, V] (no NaN; +inf rows are the caller's to exclude). compiled: the
    normaliser from one compiled pass where it applies (`fast_normaliser`)."""
    maxima = chunk_maxima(scores)
    row_max = maxima.amax(dim=-1)
    lanes = fast_normaliser(scores.shape[1], compiled) if normalise else 0
    return RowStats(maxima, row_max, normaliser(scores, row_max, lanes) if lanes else None)


def _lane_sums(x3: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """x3: float32 [R, n, L] -> [R, L]: per lane, the sequential float32 sum of exp(x - max) (no
    cascade summation: the caller marks the reduction length unbacked)."""
    return torch.exp(x3 - row_max[:, None, None]).sum(dim=1)


def _counts(x3: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return (x3 >= threshold[:, None, None]).sum(dim=(1, 2), dtype=torch.int32)


compile_cache.register("logprob_lanes", _lane_sums, unbacked=((0, 1),))  # dim 1 unbacked: a fixed-order sum
compile_cache.register("logprob_counts", _counts)


def _fold_lanes(lanes: torch.Tensor) -> torch.Tensor:
    """ATen's `vec_reduce_all` for a sum: fold the lanes in halves (lane i + lane i + half)."""
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = lanes[..., :half] + lanes[..., half:]
    return lanes[..., 0]


def normaliser(scores: torch.Tensor, row_max: torch.Tensor, lanes: int) -> torch.Tensor:
    """scores: float32 [R, V] (rows may be strided, the last dim contiguous); row_max: float32 [R];
    lanes: `fast_normaliser(V, True)` (> 0). Returns log S float32 [R], S = sum exp(scores - row_max)
    summed in ATen's log_softmax order. Rows whose max is -inf get NaN (the caller masks them)."""
    rows, vocab = scores.shape
    main = vocab - vocab % lanes
    x3 = scores[:, :main].unflatten(-1, (main // lanes, lanes))
    # x3's dim 1 unbacked: a fixed-order sum (no cascade summation)
    sums = compile_cache.maybe_compiled("logprob_lanes", _lane_sums, True)(x3, row_max)
    if main < vocab:  # ATen adds the tail vector into the first lanes
        sums = sums.clone()
        sums[:, :vocab - main] += torch.exp(scores[:, main:] - row_max[:, None])
    return torch.log(_fold_lanes(sums))


def ranks_of(scores: torch.Tensor, token_scores: torch.Tensor, compiled: bool = False) -> torch.Tensor:
    """int64 [R]: ids with score >= token score, over clean float32 scores (a compiled count when
    `compiled`, the sampler's choice)."""
    if compiled and scores.shape[1] >= CHUNK:
        main = scores.shape[1] - scores.shape[1] % CHUNK
        x3 = scores[:, :main].unflatten(-1, (main // CHUNK, CHUNK))
        ranks = compile_cache.maybe_compiled("logprob_counts", _counts, True)(x3, token_scores).to(torch.int64)
        return ranks + (scores[:, main:] >= token_scores[:, None]).sum(dim=-1)
    return (scores >= token_scores[:, None]).sum(dim=-1, dtype=torch.int32).to(torch.int64)


def ranks_from_chunks(rows: ScoreRows, maxima: torch.Tensor, token_scores: torch.Tensor,
                      compiled: bool = False) -> torch.Tensor:
    """int64 [R]: ids with score >= token score, counted only in the chunks whose max reaches it
    (`topk` of the maxima, as many as the row with the most); a full count if that is over
    RANK_CHUNKS chunks (a token far down its row; compiled when `compiled`)."""
    vocab = rows.shape[1]
    reach = int((maxima >= token_scores[:, None]).sum(dim=-1).max())
    if reach > RANK_CHUNKS:
        return ranks_of(rows.full(), token_scores, compiled)
    chunks = torch.topk(maxima, reach, dim=-1).indices  # every chunk with max >= token score
    ids = (chunks[:, :, None] * CHUNK + torch.arange(CHUNK, device=maxima.device)).flatten(1)
    hits = (rows.gather(ids.clamp(max=vocab - 1)) >= token_scores[:, None]) & (ids < vocab)
    return hits.sum(dim=-1, dtype=torch.int32).to(torch.int64)


def chunk_maxima(scores: torch.Tensor) -> torch.Tensor:
    """float32 [R, ceil(V / CHUNK)]: the max of each run of CHUNK ids (the last run may be shorter)."""
    rows, vocab = scores.shape
    main = vocab - vocab % CHUNK
    maxima = scores[:, :main].unflatten(-1, (main // CHUNK, CHUNK)).amax(dim=-1)
    if main < vocab:
        maxima = torch.cat([maxima, scores[:, main:].amax(dim=-1, keepdim=True)], dim=-1)
    return maxima


def top_n_ids(scores, num: torch.Tensor, width: int, maxima: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [R, width]: per row the ids of the `num[r]` largest scores ordered by score descending
    then id ascending (a stable descending sort's first `num[r]`); positions >= num[r] are -1.
    scores: clean float32 [R, V] or a `ScoreRows`; `maxima`: its `chunk_maxima` if already
    computed. Requires num <= V."""
    rows = _as_rows(scores)
    vocab = rows.shape[1]
    position = torch.arange(width, device=rows.scores.device)[None, :]
    if width * CHUNK * 4 > vocab:  # wide top-N or a small vocabulary: sort the rows
        ids = torch.sort(rows.full(), dim=-1, descending=True, stable=True).indices[:, :width]
        return ids.masked_fill_(position >= num[:, None], -1)
    if maxima is None:
        maxima = chunk_maxima(rows.full())
    # the first `width` chunks by (max desc, index asc), then put back in index (= id) order
    chunk_index = torch.arange(maxima.shape[1], device=maxima.device)
    chunks = torch.topk(value_id_keys(maxima, chunk_index), min(width, maxima.shape[1]), dim=-1).indices
    chunks = torch.sort(chunks, dim=-1).values
    ids = (chunks[:, :, None] * CHUNK + torch.arange(CHUNK, device=maxima.device)).flatten(1)
    outside = ids >= vocab  # past the end of a short last chunk: value -inf, after every real id
    values = rows.gather(ids.clamp(max=vocab - 1)).masked_fill_(outside, NEG_INF)
    order = torch.topk(value_id_keys(values, ids), width, dim=-1).indices
    return ids.gather(-1, order).masked_fill_(position >= num[:, None], -1)


def gather_logprobs(scores, tokens: torch.Tensor, num_logprobs: torch.Tensor, width: int,
                    normalise: bool, stats: RowStats | None = None, compiled: bool = False) -> LogprobsOutput:
    """Steps 2 / 12: the sampled token's value and rank and each row's top-N, read by gathers.

    Parameters
    ----------
    scores: clean float32 [B, V] (no NaN or +inf; -inf = removed), or a `ScoreRows`.
    tokens: int64 [B], the sampled ids.
    num_logprobs: int64 [B], N per row (<= V).
    width: the output's N (the batch's largest); shorter rows are padded with id -1 / value -inf.
    normalise: values are log_softmax of the scores (else the scores themselves).
    stats: `row_stats` of these scores, if the caller has them.
    compiled: the full-row passes compiled (the sampler's choice; the same ids and ranks either way).

    Returns
    -------
    LogprobsOutput: token_logprobs float32 [B], token_ranks int64 [B] (1-based, ids with a score
    >= the token's), top_token_ids int64 [B, width] and top_logprobs float32 [B, width], ordered by
    score descending then id ascending."""
    rows = _as_rows(scores)
    batch, vocab = rows.shape
    device = rows.scores.device
    if stats is None:
        stats = row_stats(rows.full(), normalise, compiled)
    token_scores = rows.gather(tokens[:, None]).squeeze(-1)
    if width > 0:
        top_ids = top_n_ids(rows, num_logprobs, width, stats.maxima)
        padding = top_ids < 0
        top_scores = rows.gather(top_ids.clamp(min=0))
    else:
        top_ids = torch.empty((batch, 0), dtype=torch.int64, device=device)
        padding = torch.empty((batch, 0), dtype=torch.bool, device=device)
        top_scores = torch.empty((batch, 0), dtype=torch.float32, device=device)
    ranks = ranks_from_chunks(rows, stats.maxima, token_scores, compiled)
    if not normalise:
        token_values, top_values = token_scores, top_scores
    elif stats.log_sum is not None:
        # ATen's order of operations: (x - max) - log S; a row with every id removed stays -inf
        removed = stats.row_max == NEG_INF
        shift = stats.row_max.masked_fill(removed, float("inf"))
        log_sum = stats.log_sum.masked_fill(removed, 0.0)
        token_values = (token_scores - shift) - log_sum
        top_values = (top_scores - shift[:, None]) - log_sum[:, None]
    else:
        values = log_softmax_rows(rows.full())
        token_values = values.gather(-1, tokens[:, None]).squeeze(-1)
        top_values = values.gather(-1, top_ids.clamp(min=0))
    return LogprobsOutput(token_values, ranks, top_ids, top_values.masked_fill(padding, NEG_INF))
