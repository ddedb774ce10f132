"""DRY (docs/semantics.md 5.1) in torch: the repeat length of every token a row's history would
extend, and the penalised values at those ids (`stages.dry_cells` writes them).

For a row whose window `h` holds its last n history tokens (`SamplerState.dry_history`), read
newest first (`rev[i]` = the token i places back), the repeat length at distance k (1 <= k < n) is
the longest m with rev[0:m] == rev[k:k + m] and k + m <= n, capped by the tokens after the nearest
sequence breaker; the token rev[k - 1], which followed that earlier occurrence, gets the largest
such length. Vectorised over the rows and the distances: only the distances whose token equals the
newest one can have m >= 1, and their matches are extended a chunk of positions at a time (chunks
doubling up to `MAX_CHUNK`), each a gather and a compare, until every match has ended, so a
step costs about (number of candidate distances) x (longest match) compares, and never a
[n, n] table. Padding (shorter windows, positions past the window) holds distinct negative values,
so it never matches a token or another padding position.

The penalty `m * b^e` is computed on the host as `reference.apply_dry` computes it
(`core.dry.dry_penalty`: in double, rounded to float32, as llama.cpp stores it), and subtracted on
the device as a float64 difference rounded once to float32 (llama.cpp's float32 `logit -= penalty`):
the values are the reference's bit for bit.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from ...core.dry import dry_penalty, dry_window, single_token_breakers
from ...core.params import SamplingParams

MAX_CHUNK = 256  # the most positions a match is extended by per round
FIRST_CHUNK = 8


def _padding(rows: int, columns: int, start: int, device: torch.device) -> torch.Tensor:
    """Distinct negative values (-2 - position) for positions start .. start + columns - 1."""
    return (-2 - torch.arange(start, start + columns, device=device)).expand(rows, columns)


def newest_first(history: torch.Tensor, windows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rev int64 [R, N + MAX_CHUNK + 1], n int64 [R]): each row's last `windows[r]` real tokens of
    `history` (int32 [R, D], right-aligned, -1 = none), newest first, padded after its n tokens."""
    real = (history >= 0).sum(dim=1)
    n = torch.minimum(real, torch.as_tensor(list(windows), dtype=torch.int64, device=history.device))
    width = int(n.max()) if n.numel() else 0
    rows = history.shape[0]
    rev = history.flip(1)[:, :width].to(torch.int64)
    position = torch.arange(width, device=history.device)
    rev = torch.where(position[None, :] < n[:, None], rev, _padding(rows, width, 0, history.device))
    return torch.cat([rev, _padding(rows, MAX_CHUNK + 1, width, history.device)], dim=1), n


def breaker_limits(rev: torch.Tensor, n: torch.Tensor, breakers: Sequence[Sequence[Sequence[int]]]) -> torch.Tensor:
    """The cap of each row's match lengths (int64 [R]): the number of tokens after the breaker whose
    head is nearest the end (the longest such breaker when several have their head there), or n
    without one. `breakers[r]`: row r's (head, *tail) sequences. One-token breakers (a tokenizer's
    every token that contains a breaker string: hundreds of them) are found by one membership test
    per row; longer ones by comparing each offset of a small table."""
    rows = rev.shape[0]
    big = torch.iinfo(torch.int64).max
    width = int(n.max()) if rows else 0
    if width == 0 or not any(breakers):
        return n.clone()
    position = torch.arange(width, device=rev.device)
    window = rev[:, :width]
    nearest = torch.full((rows,), big, dtype=torch.int64, device=rev.device)
    tail = torch.zeros((rows,), dtype=torch.int64, device=rev.device)
    for r, row_breakers in enumerate(breakers):
        singles = one_token_breakers(tuple(map(tuple, row_breakers)))
        if singles.numel():
            hit = torch.isin(window[r], singles.to(rev.device))
            nearest[r] = torch.where(hit, position, big).amin()
    sequences = [[seq for seq in b if len(seq) > 1] for b in breakers]
    count = max(len(b) for b in sequences)
    if count:
        longest = max(len(seq) for b in sequences for seq in b)
        table = torch.full((rows, count, longest), -1, dtype=torch.int64)  # -1 = no token at this offset
        tails = torch.full((rows, count), -1, dtype=torch.int64)  # len - 1; -1 = no breaker
        for r, row_sequences in enumerate(sequences):
            for j, seq in enumerate(row_sequences):
                table[r, j, :len(seq)] = torch.tensor(seq, dtype=torch.int64)
                tails[r, j] = len(seq) - 1
        table, tails = table.to(rev.device), tails.to(rev.device)
        # the head at i (tokens back from the newest), the tail's tokens at i - 1, i - 2, ...
        before = torch.cat([torch.full((rows, longest), -2, dtype=torch.int64, device=rev.device), window], dim=1)
        match = torch.ones((rows, count, width), dtype=torch.bool, device=rev.device)
        for o in range(longest):
            token = table[:, :, o, None]
            match &= (token == -1) | (before[:, None, longest - o:longest - o + width] == token)
        match &= tails[:, :, None] >= 0
        first = torch.where(match, position, big).amin(dim=2)  # [R, count]
        first_sequence = first.amin(dim=1)
        longest_tail = torch.where(first == first_sequence[:, None], tails, 0).amax(dim=1)
        tail = torch.where(first_sequence <= nearest, longest_tail, tail)  # a one-token breaker's tail: 0
        nearest = torch.minimum(nearest, first_sequence)
    return torch.where(nearest < big, nearest - tail, n)


@functools.lru_cache(maxsize=256)
def one_token_breakers(breakers: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """The one-token breakers of a row's breakers, int64 on the CPU (cached per breaker list)."""
    return torch.tensor(sorted({seq[0] for seq in breakers if len(seq) == 1}), dtype=torch.int64)


def repeat_lengths(rev: torch.Tensor, n: torch.Tensor, limit: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row int64 [P], k int64 [P], length int64 [P]): every distance k in [1, n - 1] of a row whose
    match has length >= 1, and its length min(m, limit[row]). While a match goes on, length + k <= n
    (rev[n] is padding), so every index read is inside rev."""
    width = rev.shape[1] - MAX_CHUNK - 1
    if width < 2:
        empty = torch.empty(0, dtype=torch.int64, device=rev.device)
        return empty, empty, empty
    same = rev[:, 1:width] == rev[:, :1]  # rev[k] == rev[0]: a match of length >= 1 at k
    row, k = same.nonzero(as_tuple=True)
    k = k + 1
    length = torch.ones_like(k)
    done_row, done_k, done_length = [], [], []
    flat = rev.reshape(-1)
    chunk = FIRST_CHUNK
    while row.numel():
        offsets = torch.arange(chunk, device=rev.device)
        start = (row * rev.shape[1] + length)[:, None] + offsets  # rev[length + o] and rev[length + k + o]
        here, there = flat.take(start), flat.take(start + k[:, None])
        mismatch = here != there
        first = torch.where(mismatch, offsets, chunk).amin(dim=1)
        length = length + first
        active = (first == chunk) & (length < limit[row])
        finished = ~active
        done_row.append(row[finished])
        done_k.append(k[finished])
        done_length.append(length[finished])
        row, k, length = row[active], k[active], length[active]
        chunk = min(2 * chunk, MAX_CHUNK)
    if not done_row:
        return row, k, length
    row, k, length = torch.cat(done_row), torch.cat(done_k), torch.cat(done_length)
    return row, k, torch.minimum(length, limit[row])


def penalised_cells(z: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams], history: torch.Tensor,
                    offset: int, real_width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Step 5.1 for `rows` of z (float32 [B, width], steps 1-5 done), without writing.

    Parameters
    ----------
    rows: the rows of z with DRY on; params: their parameters (one per row of `rows`).
    history: int32 [len(rows), D], each row's DRY history (`SamplerState.dry_history` at its slot).
    offset, real_width: z's column 0 is global id `offset`; ids outside [offset, offset +
        real_width) are not z's (a vocabulary split's other ranks).

    Returns
    -------
    (row_index int64 [H], column int64 [H], value float32 [H]): z - m * b^e at every penalised id,
    None when no id is penalised.
    """
    windows = [dry_window(p.dry_penalty_last_n, history.shape[1]) for p in params]
    rev, n = newest_first(history, windows)
    limit = breaker_limits(rev, n, [p.dry_sequence_breakers for p in params])
    member, k, length = repeat_lengths(rev, n, limit)
    allowed = torch.as_tensor([p.dry_allowed_length for p in params], dtype=torch.int64, device=z.device)
    kept = length >= allowed[member]
    member, length = member[kept], length[kept]
    token = rev[member, k[kept] - 1] - offset
    mine = (token >= 0) & (token < real_width)
    member, length, token = member[mine], length[mine], token[mine]
    if member.numel() == 0:
        return None
    key = member * real_width + token  # the largest length per (row, id)
    unique, inverse = torch.unique(key, return_inverse=True)
    longest = torch.zeros(unique.numel(), dtype=torch.int64, device=z.device).scatter_reduce_(
        0, inverse, length, reduce="amax", include_self=False)
    singles = [single_token_breakers(p.dry_sequence_breakers) for p in params]
    cells = [(r, t, L) for r, t, L in zip((unique // real_width).tolist(), (unique % real_width).tolist(),
                                          longest.tolist()) if t + offset not in singles[r]]
    if not cells:  # only one-token breakers would be penalised: they never are
        return None
    member = torch.as_tensor([r for r, _, _ in cells], dtype=torch.int64, device=z.device)
    token = torch.as_tensor([t for _, t, _ in cells], dtype=torch.int64, device=z.device)
    penalties = [dry_penalty(params[r].dry_multiplier, params[r].dry_base, params[r].dry_allowed_length, L)
                 for r, _, L in cells]
    row_index = torch.as_tensor(list(rows), dtype=torch.int64, device=z.device)[member]
    before = z[row_index, token].to(torch.float64)
    values = (before - torch.tensor(penalties, dtype=torch.float64, device=z.device)).to(torch.float32)
    return row_index, token, values.masked_fill_(values.isnan(), float("-inf"))  # +inf - inf: removed

