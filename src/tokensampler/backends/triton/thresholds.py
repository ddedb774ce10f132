"""Sampled rows seen through order keys, and the sort-free top-k / top-p threshold search.

A float32 value maps to an int64 key with the same order (-0.0 and +0.0 equal), so "the ids whose
value is >= a threshold" is "the ids whose key is >= x". `search_threshold` finds the x of the
definition's top-k (counts) or top-p (float64 masses) by a multi-pivot bisection over the keys of
one row: no sort, ties at the border kept together. Used by `kernels.select_kernel` and, to rebuild
the processed scores, by `kernels.logprobs_kernel`.
"""

from __future__ import annotations

import triton.language as tl

import triton

NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
INT64_MIN = tl.constexpr(-(2**63))
INT64_MAX = tl.constexpr(2**63 - 1)


@triton.jit
def order_key(z):
    """int64 key ordered as the float32 values (not NaN); -0.0 and +0.0 get the same key."""
    z = tl.where(z == 0.0, 0.0, z)
    s = z.to(tl.int32, bitcast=True)
    return (s ^ ((s >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def key_to_value(key):
    """The float32 value of an `order_key` (inverse map)."""
    s = key.to(tl.int32)
    return (s ^ ((s >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def sampled_block(z_row_ptr, ids, in_range, pen_posinf, t_posinf, temperature, z_max, min_p, xk, xp,
                  HAS_MIN_P: tl.constexpr):
    """For a sampled row: post-temperature z, p = exp(z - z_max), order keys, and the kept mask of
    min-p and the top-k / top-p key thresholds `xk`, `xp` (INT64_MIN when off).
    (`saturate` and `order_key` are written out here: this runs once per block of every pass.)"""
    z = tl.load(z_row_ptr + ids, mask=in_range, other=NEG_INF)
    z = tl.where(pen_posinf, tl.where(z == POS_INF, 0.0, NEG_INF), z)
    zt = tl.div_rn(z, temperature)
    zt = tl.where(t_posinf, tl.where(zt == POS_INF, 0.0, NEG_INF), zt)
    p = tl.exp((zt - z_max).to(tl.float64)).to(tl.float32)
    bits = tl.where(zt == 0.0, 0.0, zt).to(tl.int32, bitcast=True)
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
    kept = (zt > NEG_INF) & (key >= xk) & (key >= xp)
    if HAS_MIN_P:
        kept = kept & (p >= min_p)
    return zt, p, key, kept


@triton.jit
def kept_summary(z_row_ptr, vocab, pen_posinf, t_posinf, temperature, z_max, min_p, xk, xp,
                 HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr):
    """(count, smallest key, float64 mass) of the kept ids of a sampled row."""
    count = tl.zeros([BLOCK], tl.int64)
    low = tl.full([BLOCK], INT64_MAX, tl.int64)
    mass = tl.zeros([BLOCK], tl.float64)
    for start in range(0, vocab, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        zt, p, key, kept = sampled_block(z_row_ptr, ids, ids < vocab, pen_posinf, t_posinf, temperature,
                                         z_max, min_p, xk, xp, HAS_MIN_P)
        count += kept.to(tl.int64)
        low = tl.minimum(low, tl.where(kept, key, INT64_MAX))
        mass += tl.where(kept, p.to(tl.float64), 0.0)
    return tl.sum(count), tl.min(low), tl.sum(mass)


@triton.jit
def search_threshold(z_row_ptr, vocab, pen_posinf, t_posinf, temperature, z_max, min_p, xk, lo, hi, count_lo,
                     max_count, max_mass, list_key_ptr, list_p_ptr, BY_MASS: tl.constexpr, HAS_MIN_P: tl.constexpr,
                     BLOCK: tl.constexpr, NPIV: tl.constexpr, CAP: tl.constexpr, LBLOCK: tl.constexpr):
    """The smallest key x in (lo, hi] with A(x) < limit, where A(x) is the number (or the float64
    mass) of kept ids whose key is > x. A falls as x grows, A(hi) < limit and A(lo) >= limit, so
    an id stays iff its key >= x. NPIV pivots per pass: 32 bits in <= 9 passes.

    A(hi) is carried from pass to pass (0 at first: hi is the max), so a pass only weighs the ids
    inside the window (lo, hi] against the pivots: A(pivot) = A(hi) + their share above the pivot.
    `count_lo` is the number of kept ids above lo. Once the window holds at most CAP ids, one more
    pass copies their (key, p) to the row's list and every later pass reads only the list."""
    above_hi_n = tl.full([], 0, tl.int64)
    above_hi_m = tl.full([], 0.0, tl.float64)
    listed = tl.full([], 0, tl.int32)
    n_list = tl.full([], 0, tl.int32)
    while hi - lo > 1:
        if listed == 0:
            if count_lo - above_hi_n <= CAP:
                for start in range(0, vocab, BLOCK):
                    ids = start + tl.arange(0, BLOCK)
                    zt, p, key, kept = sampled_block(z_row_ptr, ids, ids < vocab, pen_posinf, t_posinf,
                                                     temperature, z_max, min_p, xk, INT64_MIN, HAS_MIN_P)
                    window = kept & (key > lo) & (key <= hi)
                    if tl.max(window.to(tl.int32)) > 0:
                        where = n_list + tl.cumsum(window.to(tl.int32), axis=0) - 1
                        tl.store(list_key_ptr + where, key, mask=window & (where < CAP))
                        tl.store(list_p_ptr + where, p, mask=window & (where < CAP))
                        n_list += tl.sum(window.to(tl.int32))
                tl.debug_barrier()  # the list is read back by other threads of this program
                listed = (n_list <= CAP).to(tl.int32)  # never false (the count is exact): a guard
                n_list = tl.where(listed == 1, n_list, 0)
        step = (hi - lo + NPIV - 1) // NPIV
        pivots = tl.minimum(lo + step * (1 + tl.arange(0, NPIV)).to(tl.int64), hi)
        above_n = tl.zeros([NPIV], tl.int64)
        above_m = tl.zeros([NPIV], tl.float64)
        if listed == 0:
            for start in range(0, vocab, BLOCK):
                ids = start + tl.arange(0, BLOCK)
                zt, p, key, kept = sampled_block(z_row_ptr, ids, ids < vocab, pen_posinf, t_posinf, temperature,
                                                 z_max, min_p, xk, INT64_MIN, HAS_MIN_P)
                window = kept & (key > lo) & (key <= hi)
                if tl.max(window.to(tl.int32)) > 0:
                    hit = window[None, :] & (key[None, :] > pivots[:, None])
                    above_n += tl.sum(hit.to(tl.int64), axis=1)
                    if BY_MASS:
                        above_m += tl.sum(tl.where(hit, p.to(tl.float64)[None, :], 0.0), axis=1)
        else:
            for start in range(0, n_list, LBLOCK):
                idx = start + tl.arange(0, LBLOCK)
                in_list = idx < n_list
                key = tl.load(list_key_ptr + idx, mask=in_list, other=INT64_MIN)
                p = tl.load(list_p_ptr + idx, mask=in_list, other=0.0)
                window = in_list & (key > lo) & (key <= hi)
                hit = window[None, :] & (key[None, :] > pivots[:, None])
                above_n += tl.sum(hit.to(tl.int64), axis=1)
                if BY_MASS:
                    above_m += tl.sum(tl.where(hit, p.to(tl.float64)[None, :], 0.0), axis=1)
        above_n = above_hi_n + above_n
        above_m = above_hi_m + above_m
        if BY_MASS:
            ok = above_m < max_mass
        else:
            ok = above_n < max_count
        above_hi_n = tl.max(tl.where(ok, above_n, 0))
        above_hi_m = tl.max(tl.where(ok, above_m, 0.0))
        count_lo = tl.min(tl.where(ok, count_lo, above_n))
        hi = tl.min(tl.where(ok, pivots, hi))
        lo = tl.max(tl.where(ok, lo, pivots))
    return hi
