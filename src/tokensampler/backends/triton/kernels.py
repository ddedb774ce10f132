"""The sampling step of docs/semantics.md as three Triton kernels, sort-free.

1. `prepare_kernel`, grid (B, splits): float32 logits, padding/NaN removal, allowed ids, the call's
   token bitmask (one int32 word per 32 ids), bad words (each row's words matched against its
   slot's latest output tokens, the banned ids compared per block), stop ids below min_tokens,
   logit bias and the penalties, written once to a scratch row `z`; per split the
   max and first argmax of the raw logits and of `z` (greedy and invalid rows need nothing else).
2. `select_kernel`, grid (B,): per row, the +inf rule, temperature, min-p, then the top-k and top-p
   thresholds by a multi-pivot bisection over the float32 order keys (`thresholds.py`: counts in
   int64, masses in float64 over the kept ids: the reference's sets exactly), the Gumbel argmax with the noise of
   `rng.py` computed in the kernel, and the history update (count, position, output length, and
   the latest output tokens the bad words read).
3. `logprobs_kernel`, grid (B,), only when a row asks: log-sum-exp, the token's value and rank,
   and the top-N (N <= 20) by value then lower id, on the raw or the processed scores.

Floating-point choices that make the result equal to `reference.py`: divisions are
correctly rounded (`tl.div_rn`), launches disable mul-add fusion, `p = exp(z - z_max)` is the
float32 rounding of a float64 exp (see docs/kernels.md for the one place this can differ).
"""

from __future__ import annotations

import triton.language as tl

import triton

from ...core import rng as _rng
from .noise import gumbel_noise, row_key
from .thresholds import (
    INT64_MAX,
    INT64_MIN,
    NEG_INF,
    POS_INF,
    kept_summary,
    key_to_value,
    order_key,
    sampled_block,
    search_threshold,
)

GUMBEL_MIN = tl.constexpr(_rng.GUMBEL_MIN)
GUMBEL_MAX = tl.constexpr(_rng.GUMBEL_MAX)
ID_BIG = tl.constexpr(2**31 - 1)

STATUS_INVALID = tl.constexpr(0)
STATUS_GREEDY = tl.constexpr(1)
STATUS_SAMPLED = tl.constexpr(2)


@triton.jit
def combine_argmax(values, ids):
    """(max, lowest id holding it) of per-lane maxima `values` and their first ids."""
    best = tl.max(values)
    return best, tl.min(tl.where(values == best, ids, ID_BIG))


# ---------------------------------------------------------------------------------------- kernels
@triton.jit
def banned_ids(words_ptr, recent_ptr, slot, num_words, length, WPAD: tl.constexpr, LPAD: tl.constexpr):
    """The ids the slot's bad words ban this step, int64 [WPAD] (-1 = none): a word (right-aligned
    in `length` columns, -1 = no constraint) bans its last token when every other token equals the
    slot's latest output token in the same column (`recent`, `length - 1` columns, -2 = none)."""
    w = tl.arange(0, WPAD)
    j = tl.arange(0, LPAD)
    depth = length - 1
    word_row = words_ptr + slot * num_words * length + w * length
    used = w < num_words
    prefix = tl.load(word_row[:, None] + j[None, :], mask=used[:, None] & (j < depth)[None, :], other=-1)
    recent = tl.load(recent_ptr + slot * depth + j, mask=j < depth, other=-2)
    matched = tl.min(((prefix == -1) | (prefix == recent[None, :])).to(tl.int32), axis=1) != 0
    last = tl.load(word_row + depth, mask=used, other=-1)
    return tl.where(matched, last, -1)


@triton.jit
def prepare_kernel(logits_ptr, logits_stride, slot_ptr, z_ptr, fstat_ptr, istat_ptr,
                   prompt_ptr, counts_ptr, bias_ptr, allowed_ptr, stop_ptr, output_len_ptr, min_tokens_ptr,
                   repetition_ptr, frequency_ptr, presence_ptr, bitmask_ptr, bitmask_stride,
                   words_ptr, recent_ptr, num_words, word_length, vocab, chunk,
                   HAS_ALLOWED: tl.constexpr, HAS_STOP: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_PENALTIES: tl.constexpr, HAS_BITMASK: tl.constexpr, HAS_BAD_WORDS: tl.constexpr,
                   WPAD: tl.constexpr, LPAD: tl.constexpr, BLOCK: tl.constexpr, NSPLIT: tl.constexpr):
    """Steps 1, 3, 4, 5 for ids [split*chunk, (split+1)*chunk) of row b; writes z and the split's
    (raw max, z max) and their first argmax."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(slot_ptr + row)
    logits_row = logits_ptr + row.to(tl.int64) * logits_stride
    state_row = slot * vocab
    z_row = z_ptr + row.to(tl.int64) * vocab
    begin = split * chunk
    end = tl.minimum(begin + chunk, vocab)
    if HAS_BITMASK:
        bitmask_row = bitmask_ptr + row.to(tl.int64) * bitmask_stride
    if HAS_BAD_WORDS:
        banned = banned_ids(words_ptr, recent_ptr, slot, num_words, word_length, WPAD, LPAD)
    if HAS_STOP:
        below_min_tokens = tl.load(output_len_ptr + slot) < tl.load(min_tokens_ptr + slot)
    if HAS_PENALTIES:
        repetition = tl.load(repetition_ptr + slot)
        frequency = tl.load(frequency_ptr + slot)
        presence = tl.load(presence_ptr + slot)
    raw_max = tl.full([BLOCK], NEG_INF, tl.float32)
    raw_arg = begin + tl.arange(0, BLOCK)
    z_max = tl.full([BLOCK], NEG_INF, tl.float32)
    z_arg = begin + tl.arange(0, BLOCK)
    for start in range(begin, end, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        in_range = ids < end
        x = tl.load(logits_row + ids, mask=in_range, other=NEG_INF).to(tl.float32)
        x = tl.where(x != x, NEG_INF, x)
        z = x
        if HAS_ALLOWED:
            z = tl.where(tl.load(allowed_ptr + state_row + ids, mask=in_range, other=0) != 0, z, NEG_INF)
        if HAS_BITMASK:  # bit (id % 32) of word (id // 32); the arithmetic shift is harmless with the & 1
            word = tl.load(bitmask_row + (ids >> 5), mask=in_range, other=0)
            z = tl.where(((word >> (ids & 31)) & 1) != 0, z, NEG_INF)
        if HAS_BAD_WORDS:
            hit = tl.max((ids.to(tl.int64)[:, None] == banned[None, :]).to(tl.int32), axis=1) != 0
            z = tl.where(hit, NEG_INF, z)
        if HAS_STOP:
            stop = tl.load(stop_ptr + state_row + ids, mask=in_range, other=0) != 0
            z = tl.where(stop & below_min_tokens, NEG_INF, z)
        if HAS_BIAS:
            z = z + tl.load(bias_ptr + state_row + ids, mask=in_range, other=0.0)
        if HAS_PENALTIES:
            count = tl.load(counts_ptr + state_row + ids, mask=in_range, other=0)
            in_output = count > 0
            seen = (tl.load(prompt_ptr + state_row + ids, mask=in_range, other=0) != 0) | in_output
            z = tl.where(seen, tl.where(z > 0, tl.div_rn(z, repetition), z * repetition), z)
            z = z - frequency * count.to(tl.float32)
            z = z - presence * in_output.to(tl.float32)
        tl.store(z_row + ids, z, mask=in_range)
        better = x > raw_max
        raw_max = tl.where(better, x, raw_max)
        raw_arg = tl.where(better, ids, raw_arg)
        better = z > z_max
        z_max = tl.where(better, z, z_max)
        z_arg = tl.where(better, ids, z_arg)
    raw_best, raw_best_id = combine_argmax(raw_max, raw_arg)
    z_best, z_best_id = combine_argmax(z_max, z_arg)
    stat = (row * NSPLIT + split) * 2
    tl.store(fstat_ptr + stat, raw_best)
    tl.store(fstat_ptr + stat + 1, z_best)
    tl.store(istat_ptr + stat, raw_best_id.to(tl.int64))
    tl.store(istat_ptr + stat + 1, z_best_id.to(tl.int64))


@triton.jit
def select_kernel(z_ptr, slot_ptr, fstat_ptr, istat_ptr,
                  temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, position_ptr, stream_ptr,
                  counts_ptr, output_len_ptr, record_ptr, token_ptr, valid_ptr, info_f_ptr, info_i_ptr,
                  list_key_ptr, list_p_ptr, recent_ptr, depth, vocab,
                  HAS_MIN_P: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_RECORD: tl.constexpr,
                  HAS_RECENT: tl.constexpr, DPAD: tl.constexpr,
                  BLOCK: tl.constexpr, NSPLIT: tl.constexpr, NPIV: tl.constexpr, CAP: tl.constexpr,
                  LBLOCK: tl.constexpr):
    """Steps 6-11 and 13 for row b: the token, its validity, the row facts the logprobs need."""
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    z_row = z_ptr + row.to(tl.int64) * vocab
    list_key = list_key_ptr + row.to(tl.int64) * CAP
    list_p = list_p_ptr + row.to(tl.int64) * CAP
    splits = (row * NSPLIT + tl.arange(0, NSPLIT)) * 2
    raw_max, raw_arg = combine_argmax(tl.load(fstat_ptr + splits), tl.load(istat_ptr + splits))
    z_max_pen, z_arg = combine_argmax(tl.load(fstat_ptr + splits + 1), tl.load(istat_ptr + splits + 1))
    temperature = tl.load(temperature_ptr + slot)
    pen_posinf = z_max_pen == POS_INF
    safe_temperature = tl.where(temperature > 0.0, temperature, 1.0)
    z_max = tl.div_rn(tl.where(pen_posinf, 0.0, z_max_pen), safe_temperature)
    t_posinf = z_max == POS_INF
    z_max = tl.where(t_posinf, 0.0, z_max)
    status = tl.where(z_max_pen == NEG_INF, STATUS_INVALID,
                      tl.where(temperature == 0.0, STATUS_GREEDY, STATUS_SAMPLED))
    # a row whose every z / T underflows to -inf has no id left after temperature
    status = tl.where((status == STATUS_SAMPLED) & (z_max == NEG_INF), STATUS_INVALID, status)
    token = tl.where(status == STATUS_INVALID, raw_arg, z_arg).to(tl.int64)
    min_p = tl.full([], 0.0, tl.float32)
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + slot)
    xk = tl.full([], INT64_MIN, tl.int64)
    xp = tl.full([], INT64_MIN, tl.int64)
    if status == STATUS_SAMPLED:
        max_key = order_key(z_max)
        if HAS_TOP_K:
            top_k = tl.load(top_k_ptr + slot)
            if top_k > 0:
                n_kept, low_key, _ = kept_summary(z_row, vocab, pen_posinf, t_posinf, safe_temperature, z_max,
                                                  min_p, xk, xp, HAS_MIN_P, BLOCK)
                if n_kept > top_k:
                    xk = search_threshold(z_row, vocab, pen_posinf, t_posinf, safe_temperature, z_max, min_p, xk,
                                          low_key - 1, max_key, n_kept, top_k, 0.0, list_key, list_p, False,
                                          HAS_MIN_P, BLOCK, NPIV, CAP, LBLOCK)
        if HAS_TOP_P:
            top_p = tl.load(top_p_ptr + slot).to(tl.float64)
            if top_p < 1.0:
                n_kept, low_key, total = kept_summary(z_row, vocab, pen_posinf, t_posinf, safe_temperature, z_max,
                                                      min_p, xk, xp, HAS_MIN_P, BLOCK)
                xp = search_threshold(z_row, vocab, pen_posinf, t_posinf, safe_temperature, z_max, min_p, xk,
                                      low_key - 1, max_key, n_kept, 0, top_p * total, list_key, list_p, True,
                                      HAS_MIN_P, BLOCK, NPIV, CAP, LBLOCK)
        # 11. Gumbel argmax over the kept ids; a block whose best z + GUMBEL_MAX cannot reach the
        # row's best z + GUMBEL_MIN (the max is always kept) cannot hold the winner: no noise there.
        noise_key = row_key(tl.load(seed_ptr + slot), tl.load(position_ptr + slot), tl.load(stream_ptr + slot))
        floor = z_max + GUMBEL_MIN
        best = tl.full([BLOCK], NEG_INF, tl.float32)
        best_id = tl.arange(0, BLOCK)
        for start in range(0, vocab, BLOCK):
            ids = start + tl.arange(0, BLOCK)
            zt, p, key, kept = sampled_block(z_row, ids, ids < vocab, pen_posinf, t_posinf, safe_temperature,
                                             z_max, min_p, xk, xp, HAS_MIN_P)
            if tl.max(tl.where(kept, zt, NEG_INF)) + GUMBEL_MAX >= floor:
                score = tl.where(kept, zt + gumbel_noise(noise_key, ids), NEG_INF)
                better = score > best
                best = tl.where(better, score, best)
                best_id = tl.where(better, ids, best_id)
        _, sampled = combine_argmax(best, best_id)
        token = sampled.to(tl.int64)
    tl.store(token_ptr + row, token)
    tl.store(valid_ptr + row, status != STATUS_INVALID)
    tl.store(info_f_ptr + row * 4, safe_temperature)
    tl.store(info_f_ptr + row * 4 + 1, z_max)
    tl.store(info_f_ptr + row * 4 + 2, min_p)
    flags = pen_posinf.to(tl.int64) + 2 * t_posinf.to(tl.int64) + 4 * (raw_max == POS_INF).to(tl.int64)
    tl.store(info_i_ptr + row * 4, status.to(tl.int64))
    tl.store(info_i_ptr + row * 4 + 1, flags)
    tl.store(info_i_ptr + row * 4 + 2, xk)
    tl.store(info_i_ptr + row * 4 + 3, xp)
    # 13. history: the token is counted, the position and the output length advance (by 0 for the
    # rows whose `record` is False: same launches either way)
    step = 1
    if HAS_RECORD:
        step = (tl.load(record_ptr + row) != 0).to(tl.int32)
    count_at = counts_ptr + slot * vocab + token
    tl.store(count_at, tl.load(count_at) + step)
    tl.store(position_ptr + slot, tl.load(position_ptr + slot) + step)
    tl.store(output_len_ptr + slot, tl.load(output_len_ptr + slot) + step)
    if HAS_RECENT:  # the latest output tokens shift by one, the token enters last (if recorded)
        j = tl.arange(0, DPAD)
        recent_row = recent_ptr + slot * depth
        old = tl.load(recent_row + j, mask=j < depth, other=-2)
        after = tl.load(recent_row + j + 1, mask=j < depth - 1, other=-2)
        shifted = tl.where(j == depth - 1, token, after)
        if HAS_RECORD:
            shifted = tl.where(step != 0, shifted, old)
        tl.debug_barrier()  # every lane has read before any lane writes
        tl.store(recent_row + j, shifted, mask=j < depth)


@triton.jit
def row_scores(logits_row, z_row, ids, in_range, status, flags, temperature, z_max, min_p, xk, xp,
               PROCESSED: tl.constexpr, HAS_MIN_P: tl.constexpr):
    """The scores logprobs are taken on: the raw logits (+inf rule) or the processed z (-inf = removed)."""
    if PROCESSED:
        if status == STATUS_SAMPLED:
            zt, p, key, kept = sampled_block(z_row, ids, in_range, (flags & 1) != 0, (flags & 2) != 0,
                                             temperature, z_max, min_p, xk, xp, HAS_MIN_P)
            scores = tl.where(kept, zt, NEG_INF)
        else:
            z = tl.load(z_row + ids, mask=in_range, other=NEG_INF)
            z = tl.where((flags & 1) != 0, tl.where(z == POS_INF, 0.0, NEG_INF), z)
            scores = tl.where(status == STATUS_GREEDY, z, NEG_INF)
    else:
        x = tl.load(logits_row + ids, mask=in_range, other=NEG_INF).to(tl.float32)
        x = tl.where(x != x, NEG_INF, x)
        scores = tl.where((flags & 4) != 0, tl.where(x == POS_INF, 0.0, NEG_INF), x)
    return scores


@triton.jit
def logprobs_kernel(logits_ptr, logits_stride, z_ptr, token_ptr, num_ptr, info_f_ptr, info_i_ptr,
                    token_lp_ptr, rank_ptr, top_id_ptr, top_lp_ptr, vocab, top_stride,
                    PROCESSED: tl.constexpr, AS_LOGPROBS: tl.constexpr, HAS_MIN_P: tl.constexpr,
                    WIDTH: tl.constexpr, WPAD: tl.constexpr, BLOCK: tl.constexpr):
    """Steps 2/12 for row b: the token's value and rank, and its top-`num` ids (<= WIDTH) by
    value then lower id, values as log_softmax (AS_LOGPROBS) or the scores themselves."""
    row = tl.program_id(0)
    num = tl.load(num_ptr + row)
    logits_row = logits_ptr + row.to(tl.int64) * logits_stride
    z_row = z_ptr + row.to(tl.int64) * vocab
    status = tl.load(info_i_ptr + row * 4)
    flags = tl.load(info_i_ptr + row * 4 + 1)
    xk = tl.load(info_i_ptr + row * 4 + 2)
    xp = tl.load(info_i_ptr + row * 4 + 3)
    temperature = tl.load(info_f_ptr + row * 4)
    z_max = tl.load(info_f_ptr + row * 4 + 1)
    min_p = tl.load(info_f_ptr + row * 4 + 2)
    slots = tl.arange(0, WPAD)
    top_ids = tl.full([WPAD], -1, tl.int64)
    top_values = tl.full([WPAD], NEG_INF, tl.float32)
    token_value = tl.full([], 0.0, tl.float32)
    rank = tl.full([], 0, tl.int64)
    if num >= 0:
        token = tl.load(token_ptr + row)
        pair = token + tl.arange(0, 2)
        token_score = tl.max(row_scores(logits_row, z_row, pair, pair == token, status, flags, temperature,
                                        z_max, min_p, xk, xp, PROCESSED, HAS_MIN_P))
        # pass 1: the max score; pass 2: the sum of exp, the rank, the top-WIDTH keys
        lane_max = tl.full([BLOCK], NEG_INF, tl.float32)
        for start in range(0, vocab, BLOCK):
            ids = start + tl.arange(0, BLOCK)
            s = row_scores(logits_row, z_row, ids, ids < vocab, status, flags, temperature, z_max, min_p, xk, xp,
                           PROCESSED, HAS_MIN_P)
            lane_max = tl.maximum(lane_max, s)
        m = tl.max(lane_max)
        shift = tl.where(m == NEG_INF, 0.0, m)
        lane_sum = tl.zeros([BLOCK], tl.float32)
        lane_rank = tl.zeros([BLOCK], tl.int64)
        running = tl.where(slots < WIDTH, INT64_MIN, INT64_MAX)  # slots >= WIDTH never leave
        for start in range(0, vocab, BLOCK):
            ids = start + tl.arange(0, BLOCK)
            in_range = ids < vocab
            s = row_scores(logits_row, z_row, ids, in_range, status, flags, temperature, z_max, min_p, xk, xp,
                           PROCESSED, HAS_MIN_P)
            lane_sum += tl.exp(s - shift)
            lane_rank += (in_range & (s >= token_score)).to(tl.int64)
            if WIDTH > 0:
                # ids by (score desc, id asc) as one int64 key; `running` holds the best WIDTH keys
                # seen so far (unordered); a key enters only if it beats the worst of them, so most
                # blocks cost one max after the first few
                combined = tl.where(in_range, (order_key(s) << 32) | (0xFFFFFFFF - ids.to(tl.int64)), INT64_MIN)
                worst = tl.min(running)
                best_left = tl.max(combined)
                while best_left > worst:
                    slot = tl.min(tl.where(running == worst, slots, WPAD))
                    running = tl.where(slots == slot, best_left, running)
                    combined = tl.where(combined == best_left, INT64_MIN, combined)
                    worst = tl.min(running)
                    best_left = tl.max(combined)
        # (s - shift) - log(total), as log_softmax: s - (shift + log(total)) loses log(total) to the
        # float32 rounding of a large shift
        log_total = tl.log(tl.sum(lane_sum))
        if AS_LOGPROBS:
            token_value = tl.where(m == NEG_INF, token_score, (token_score - shift) - log_total)
        else:
            token_value = token_score
        rank = tl.sum(lane_rank)
        if WIDTH > 0:
            # order `running` (distinct keys; unused slots hold INT64_MIN / INT64_MAX, ties by slot)
            r_i = running[:, None]
            r_j = running[None, :]
            before = (r_j > r_i) | ((r_j == r_i) & (slots[None, :] < slots[:, None]))
            place = tl.sum(before.to(tl.int32), axis=1) - (WPAD - WIDTH)
            ordered = tl.max(tl.where(place[:, None] == slots[None, :], r_i, INT64_MIN), axis=0)
            scores = key_to_value(ordered >> 32)
            if AS_LOGPROBS:
                scores = tl.where(m == NEG_INF, scores, (scores - shift) - log_total)
            chosen = (slots < num) & (ordered != INT64_MIN)
            top_ids = tl.where(chosen, 0xFFFFFFFF - (ordered & 0xFFFFFFFF), -1)
            top_values = tl.where(chosen, scores, NEG_INF)
    tl.store(token_lp_ptr + row, token_value)
    tl.store(rank_ptr + row, rank)
    if WIDTH > 0:
        tl.store(top_id_ptr + row * top_stride + slots, top_ids, mask=slots < WIDTH)
        tl.store(top_lp_ptr + row * top_stride + slots, top_values, mask=slots < WIDTH)
