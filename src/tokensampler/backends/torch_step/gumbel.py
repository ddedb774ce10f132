"""The Gumbel argmax of step 11, computing exact noise only where a token can still win.

The exact score of id i is `fl(z_i + g_i)` with `g_i = rng.gumbel(...)` (float64 logs rounded to
float32). Computing it for every id costs a 32-bit hash and two float64 logs per element, so the
fast path works in two stages:

1. an approximate score `a_i = fl(z_i + g~_i)`, with `g~` from the same hash (int32 arithmetic,
   bit-identical to `rng.random_bits`) and float32 logs, whose error `|g~ - g|` is below
   `NOISE_ERROR` for every one of the 2^24 possible u (checked exhaustively in the tests);
2. the exact score, only for the ids with `a_i >= max_j a_j - margin`, where the margin covers
   twice the worst difference between an approximate and an exact score; the winner is the
   largest exact score, lowest id on ties. The true winner always passes stage 1, so the token
   is exactly the definition's.

Ids are given either densely (a row block of `z`) or as candidate lists (`values`, `ids`), which
the sampler gathers for rows whose kept-and-winnable set is small.
"""

from __future__ import annotations

import torch

from ...core import rng
from ...core.constants import NEG_INF
from . import compile_cache
from .config import DEFAULT

NOISE_ERROR = 1e-4  # bound on |g~ - g| (the measured worst case is ~2e-6)


def approx_gumbel(bits: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """float32 g~ within NOISE_ERROR of `rng.gumbel_from_bits` for the same 32 bits (int32 words).

    u = (k + 0.5) / 2^24 with k = bits >>> 8; -log(u) is taken as log(u) for u < 1/2 and as
    log1p(-(1 - u)) above, where both u and 1 - u are exact in float32. in_place=True reuses the
    temporaries (large eager lists); the default form fuses under torch.compile. (Constants are
    literals: a loaded precompiled function cannot guard on a module's float globals.)
    """
    k = rng.uniform_index_words(bits).to(torch.float32)
    if in_place:
        low = torch.log((k + 0.5).mul_(0.5**24))
        high = torch.log1p(((2.0**24 - k).sub_(0.5)).mul_(-0.5**24))
        return torch.where(k < 2**23, low, high).neg_().log_().neg_()
    low = torch.log((k + 0.5) * 0.5**24)
    high = torch.log1p(((2.0**24 - k) - 0.5) * -0.5**24)
    return -torch.log(-torch.where(k < 2**23, low, high))


def approx_scores(key32: torch.Tensor, ids: torch.Tensor, z: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """fl(z + g~) over a block (key32 int32 [R, 1], ids int32 [W], z float32 [R, W], threshold
    float32 [R, 1]), -inf where z < threshold or z = -inf. Written without in-place ops so that
    `compile_cache.maybe_compiled` can fuse it into one loop; the eager path uses the same function."""
    g = approx_gumbel(rng.hash32_words(key32 ^ ids))
    removed = (z < threshold) | (z == NEG_INF)
    return torch.where(removed, NEG_INF, z + g)


compile_cache.register("approx_scores", approx_scores, rows=(0, 2, 3))  # ids: the block's columns


def exact_scores(values: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """fl(z + g) with the definition's noise, for 1-d lists (values float32, keys int64, ids int64)."""
    return values + rng.gumbel_from_bits(rng.random_bits(keys, ids))


def margin(best: torch.Tensor) -> torch.Tensor:
    """Twice the worst |approximate - exact| score near `best` (noise error plus float32 rounding)."""
    return 2 * NOISE_ERROR + best.abs() * 2.0**-20 + 2.0**-16


def _winners(rows: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, keys: torch.Tensor,
             num_rows: int) -> torch.Tensor:
    """Per row, the id with the largest exact score among the listed (row, id) candidates, lowest
    id on ties; rows without a candidate get 0."""
    scores = exact_scores(values, keys[rows], ids)
    best = torch.full((num_rows,), NEG_INF, dtype=torch.float32, device=values.device)
    best.scatter_reduce_(0, rows, scores, "amax")
    big = torch.iinfo(torch.int64).max
    pick = torch.where(scores == best[rows], ids, torch.full_like(ids, big))
    token = torch.full((num_rows,), big, dtype=torch.int64, device=values.device)
    token.scatter_reduce_(0, rows, pick, "amin")
    return token.masked_fill_(token == big, 0)


def gumbel_argmax_candidates(values: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Step 11 on candidate lists: the kept id with the largest z + g, lowest id on ties.

    Parameters
    ----------
    values: float32 [R, m], z of the candidates (-inf = not kept).
    ids: int64 [R, m], their ids.
    keys: int64 [R], the rows' noise keys (`rng.row_key`).

    Returns
    -------
    int64 [R]: each row's winner (exact noise is computed only within the margin of the best
    approximate score)."""
    bits = rng.hash32_words(rng.to_int32_words(keys)[:, None] ^ ids.to(torch.int32), in_place=True)
    approx = approx_gumbel(bits, in_place=True).add_(values)
    approx.masked_fill_(torch.isneginf(values), NEG_INF)
    best = approx.amax(dim=-1, keepdim=True)
    rows, cols = torch.nonzero(approx >= best - margin(best), as_tuple=True)
    return _winners(rows, ids[rows, cols], values[rows, cols], keys, values.shape[0])


def gumbel_argmax_dense(z: torch.Tensor, threshold: torch.Tensor, keys: torch.Tensor,
                        block: int = DEFAULT.dense_block, compiled: bool = False) -> torch.Tensor:
    """z: float32 [R, V] (-inf = removed); threshold: float32 [R], ids with z < threshold are not
    kept; keys: int64 [R]. Returns int64 [R], the Gumbel argmax over each row's kept ids.

    One pass over column blocks keeps a running best approximate score and the ids within the
    margin of it; a final filter against the row's overall best leaves the exact candidates.
    compiled: each block's approximate scores in one compiled loop (the sampler's choice).
    """
    scores_of = compile_cache.maybe_compiled("approx_scores", approx_scores, compiled)
    num_rows, vocab = z.shape
    key32 = rng.to_int32_words(keys)[:, None]
    threshold = threshold[:, None].contiguous()
    cols_per_block = max(1, block // max(num_rows, 1))
    running = torch.full((num_rows, 1), NEG_INF, dtype=torch.float32, device=z.device)
    found_rows, found_ids, found_approx = [], [], []
    for start in range(0, vocab, cols_per_block):
        zb = z[:, start:start + cols_per_block].contiguous()  # a fresh small block: one compiled graph
        ids = torch.arange(start, start + zb.shape[1], dtype=torch.int32, device=z.device)
        approx = scores_of(key32, ids, zb, threshold)
        running = torch.maximum(running, approx.amax(dim=-1, keepdim=True))
        rows, cols = torch.nonzero(approx >= running - margin(running), as_tuple=True)
        found_rows.append(rows)
        found_ids.append(cols + start)
        found_approx.append(approx[rows, cols])
    rows = torch.cat(found_rows)
    ids = torch.cat(found_ids)
    approx = torch.cat(found_approx)
    keep = approx >= (running - margin(running)).squeeze(-1)[rows]
    rows, ids = rows[keep], ids[keep]
    return _winners(rows, ids, z[rows, ids], keys, num_rows)
