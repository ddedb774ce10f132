"""Log-probabilities of a step: the sampled token's value and rank, and the top-N ids (step 2/12).

Values are `log_softmax` (or the scores themselves, in the `*_logits` modes) over `[0, V)`; ranks
and the top-N order are taken on the scores, value then lower id, so rounding to logprobs never
creates or breaks a tie. Nothing of the row's size is written:

- **normaliser and rank, one pass.** `log_softmax` is needed only at the token and the top-N ids:
  `(x - max) - log(S)`, `S = sum exp(x - max)`. One compiled reduction per row gives `S` and the
  rank (ids with a score >= the token's). `S` is summed in the order of ATen's CPU `log_softmax`
  (one float32 accumulator per vector lane, sequential over the row, the tail added to the first
  lanes, then the lanes folded in halves), so the values stay within a few float32 ulps of
  `torch.log_softmax` (a float64 sum would be *more* accurate and differ from it by up to ~1e-5:
  ATen's float32 lanes drop tiny terms). The lead's bound, tested: |diff| <= 1e-6 + 1e-6 |value|.
- **top-N from chunk maxima.** The row is cut into chunks of `CHUNK` ids; the N chunks first by
  (chunk max desc, chunk index asc) hold the N ids first by (score desc, id asc) (each chunk's best
  id ranks ahead of every other id of the chunk). One max pass, then `topk` twice on small int64
  keys that encode (value desc, id asc) exactly (`order_keys`): over the chunk maxima, and over the
  N x CHUNK gathered scores. Exact, ties at the N-th value included.

Without torch.compile, or where ATen's lane width is unknown, the values come from
`torch.log_softmax` of the rows (exact) and the rank from one compare-and-count.
Inputs here are float32 scores without NaN or +inf (the caller's `masking` rules); -inf = removed.
"""

from __future__ import annotations

import torch

from .. import compile as ts_compile
from ..output import LogprobsOutput

NEG_INF = float("-inf")
CHUNK = 64  # ids per chunk of the top-N search (V / CHUNK chunk maxima per row)
_ATEN_LANES = {"AVX512": 16, "AVX2": 8}  # float32 lanes of ATen's Vectorized<float> per capability


def aten_lanes() -> int:
    """float32 lanes of the vector unit ATen's CPU `log_softmax` runs on and inductor compiles for;
    0 when they are unknown or differ (then the exact eager path is used)."""
    lanes = _ATEN_LANES.get(torch.backends.cpu.get_cpu_capability(), 0)
    if lanes and ts_compile.enabled():
        try:
            from torch._inductor.cpu_vec_isa import pick_vec_isa
            isa = pick_vec_isa()
            if not isa or isa.nelements(torch.float32) != lanes:
                return 0
        except Exception:  # noqa: BLE001 - a private API: without it, stay exact
            return 0
    return lanes


def log_softmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """log_softmax per row; a row with every id at -inf stays at -inf (instead of NaN)."""
    values = torch.log_softmax(scores, dim=-1)
    all_removed = scores.amax(dim=-1, keepdim=True) == NEG_INF
    return values.masked_fill_(all_removed, NEG_INF) if bool(all_removed.any()) else values


def _lane_sums_and_counts(x3: torch.Tensor, row_max: torch.Tensor, threshold: torch.Tensor):
    """x3: float32 [R, n, L]. Per lane: sequential float32 sum of exp(x - max) (no cascade: the
    reduction length is unbacked) and the count of x >= threshold. Both [R, L]."""
    sums = torch.exp(x3 - row_max[:, None, None]).sum(dim=1)
    counts = (x3 >= threshold[:, None, None]).sum(dim=1, dtype=torch.int32)
    return sums, counts


def _lane_counts(x3: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return (x3 >= threshold[:, None, None]).sum(dim=(1, 2), dtype=torch.int32)


def _fold_lanes(lanes: torch.Tensor) -> torch.Tensor:
    """ATen's `vec_reduce_all` for a sum: fold the lanes in halves (lane i + lane i + half)."""
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = lanes[..., :half] + lanes[..., half:]
    return lanes[..., 0]


def normaliser_and_ranks(scores: torch.Tensor, row_max: torch.Tensor, token_scores: torch.Tensor,
                         lanes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores: float32 [R, V] (rows may be strided, the last dim contiguous); row_max, token_scores:
    float32 [R]; lanes: `aten_lanes()` (> 0, V >= lanes). Returns (log S float32 [R] with
    S = sum exp(scores - row_max) summed in ATen's log_softmax order; rank int64 [R]: the number of
    ids with score >= token score). Rows whose max is -inf get a NaN log S (the caller masks them)."""
    rows, vocab = scores.shape
    main = vocab - vocab % lanes
    x3 = scores[:, :main].unflatten(-1, (main // lanes, lanes))
    torch._dynamo.decorators.mark_unbacked(x3, 1)  # a fixed-order sum: no cascade summation
    fn = ts_compile.maybe_compiled("logprob_lanes", _lane_sums_and_counts)
    sums, counts = fn(x3, row_max, token_scores)
    ranks = counts.sum(dim=-1, dtype=torch.int64)
    if main < vocab:  # ATen adds the tail vector into the first lanes
        tail = scores[:, main:]
        sums = sums.clone()
        sums[:, :vocab - main] += torch.exp(tail - row_max[:, None])
        ranks += (tail >= token_scores[:, None]).sum(dim=-1)
    return torch.log(_fold_lanes(sums)), ranks


def ranks_of(scores: torch.Tensor, token_scores: torch.Tensor) -> torch.Tensor:
    """int64 [R]: ids with score >= token score (compiled count when available)."""
    if ts_compile.enabled() and scores.shape[1] >= CHUNK:
        main = scores.shape[1] - scores.shape[1] % CHUNK
        x3 = scores[:, :main].unflatten(-1, (main // CHUNK, CHUNK))
        ranks = ts_compile.maybe_compiled("logprob_counts", _lane_counts)(x3, token_scores).to(torch.int64)
        return ranks + (scores[:, main:] >= token_scores[:, None]).sum(dim=-1)
    return (scores >= token_scores[:, None]).sum(dim=-1, dtype=torch.int32).to(torch.int64)


def chunk_maxima(scores: torch.Tensor) -> torch.Tensor:
    """float32 [R, ceil(V / CHUNK)]: the max of each run of CHUNK ids (the last run may be shorter)."""
    rows, vocab = scores.shape
    main = vocab - vocab % CHUNK
    maxima = scores[:, :main].unflatten(-1, (main // CHUNK, CHUNK)).amax(dim=-1)
    if main < vocab:
        maxima = torch.cat([maxima, scores[:, main:].amax(dim=-1, keepdim=True)], dim=-1)
    return maxima


def top_n_ids(scores: torch.Tensor, num: torch.Tensor, width: int,
              maxima: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [R, width]: per row the ids of the `num[r]` largest scores ordered by score descending
    then id ascending (a stable descending sort's first `num[r]`); positions >= num[r] are -1.
    `maxima`: `chunk_maxima(scores)` if already computed. Requires num <= V."""
    rows, vocab = scores.shape
    position = torch.arange(width, device=scores.device)[None, :]
    if width * CHUNK * 4 > vocab:  # wide top-N or a small vocabulary: sort the rows
        ids = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :width]
        return ids.masked_fill_(position >= num[:, None], -1)
    if maxima is None:
        maxima = chunk_maxima(scores)
    # the first `width` chunks by (max desc, index asc), then put back in index (= id) order
    chunk_index = torch.arange(maxima.shape[1], device=scores.device)
    chunks = torch.topk(order_keys(maxima, chunk_index), min(width, maxima.shape[1]), dim=-1).indices
    chunks = torch.sort(chunks, dim=-1).values
    ids = (chunks[:, :, None] * CHUNK + torch.arange(CHUNK, device=scores.device)).flatten(1)
    outside = ids >= vocab  # past the end of a short last chunk: value -inf, after every real id
    values = scores.gather(-1, ids.clamp(max=vocab - 1)).masked_fill_(outside, NEG_INF)
    order = torch.topk(order_keys(values, ids), width, dim=-1).indices
    return ids.gather(-1, order).masked_fill_(position >= num[:, None], -1)


def order_keys(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys, larger = earlier in the order (value desc, id asc), distinct for distinct ids:
    the float32 value as an order-preserving int32 (-0.0 counted as 0.0) above `2^32 - 1 - id`.
    values: float32 [R, K] without NaN; ids: int64 broadcastable to [R, K], 0 <= id < 2^32."""
    bits = (values + 0.0).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    return ordered * (1 << 32) + ((1 << 32) - 1 - ids)


def gather_logprobs(scores: torch.Tensor, tokens: torch.Tensor, num_logprobs: torch.Tensor, width: int,
                    normalise: bool, maxima: torch.Tensor | None = None) -> LogprobsOutput:
    """scores: float32 [B, V] without NaN or +inf (-inf = removed); tokens: int64 [B];
    num_logprobs: int64 [B] (N per row, <= V; rows that asked fewer are padded with id -1 / -inf);
    width: N of the output; normalise: values are log_softmax of the scores (else the scores);
    maxima: `chunk_maxima(scores)` if the caller has it."""
    rows, vocab = scores.shape
    token_scores = scores.gather(-1, tokens[:, None]).squeeze(-1)
    if width > 0:
        top_ids = top_n_ids(scores, num_logprobs, width, maxima)
        padding = top_ids < 0
        top_scores = scores.gather(-1, top_ids.clamp(min=0))
    else:
        top_ids = torch.empty((rows, 0), dtype=torch.int64, device=scores.device)
        padding = torch.empty((rows, 0), dtype=torch.bool, device=scores.device)
        top_scores = torch.empty((rows, 0), dtype=torch.float32, device=scores.device)
    lanes = aten_lanes()
    if not normalise:
        ranks = ranks_of(scores, token_scores)
        token_values, top_values = token_scores, top_scores
    elif lanes and ts_compile.enabled() and vocab >= lanes:
        row_max = maxima.amax(dim=-1) if maxima is not None else scores.amax(dim=-1)
        log_sum, ranks = normaliser_and_ranks(scores, row_max, token_scores, lanes)
        # ATen's order of operations: (x - max) - log S; a row with every id removed stays -inf
        shift = torch.where(row_max == NEG_INF, float("inf"), row_max)
        token_values = (token_scores - shift) - log_sum.masked_fill(row_max == NEG_INF, 0.0)
        top_values = (top_scores - shift[:, None]) - log_sum.masked_fill(row_max == NEG_INF, 0.0)[:, None]
    else:
        values = log_softmax_rows(scores)
        ranks = ranks_of(scores, token_scores)
        token_values = values.gather(-1, tokens[:, None]).squeeze(-1)
        top_values = values.gather(-1, top_ids.clamp(min=0))
    return LogprobsOutput(token_values, ranks, top_ids, top_values.masked_fill(padding, NEG_INF))
