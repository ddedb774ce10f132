"""Sparse indexing on a CPU: finding the hits of a mask, reading and writing scattered (row, id) cells.

`nonzero_ids`: the masks a step scans (winnable ids, seen ids) hit about one id in a hundred: most
64-bit words of such a mask are zero, so the scan looks at words first and at the bytes of the few
words that are not (measured ~1.6x faster than `torch.nonzero` on the bench's masks).
`read_at`/`write_at`: z[rows, ids] through `take`/flat indexing when z is contiguous (faster than
two-tensor advanced indexing).
"""

from __future__ import annotations

import torch


WORD_SCAN_MIN = 1 << 20  # below this many entries torch.nonzero is as fast (measured)


def nonzero_ids(row: torch.Tensor, expected_hits: int | None = None) -> torch.Tensor:
    """int64 ids of the non-zero entries of a contiguous 1-D tensor, ascending. Scans 64-bit words
    first (a row of a few hundred hits among ~10^5 ids: most words are zero), then the bytes of the
    words that are not. With `expected_hits` (the caller's count) a short or not-so-sparse tensor
    (more than ~1 word in 7 holding a hit) goes to `torch.nonzero`, faster there."""
    per_word = 8 // max(row.element_size(), 1)
    if expected_hits is not None and (row.numel() < WORD_SCAN_MIN or expected_hits * per_word * 7 > row.numel()):
        return torch.nonzero(row).squeeze(-1)
    aligned = row.storage_offset() * row.element_size() % 8 == 0
    if per_word < 1 or not aligned or not row.is_contiguous() or row.device.type != "cpu":
        return torch.nonzero(row).squeeze(-1)
    body = row.numel() // per_word * per_word
    words = row[:body].view(torch.int64)
    hit = torch.nonzero(words).squeeze(-1)
    lanes = row[:body].view(-1, per_word)[hit]
    word, lane = torch.nonzero(lanes, as_tuple=True)
    tail = torch.nonzero(row[body:]).squeeze(-1) + body
    return torch.cat([hit[word] * per_word + lane, tail])


def read_at(z: torch.Tensor, row_index: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """z[row_index, ids] (`take` on a contiguous z: faster than advanced indexing)."""
    if z.is_contiguous():
        return z.view(-1).take(row_index * z.shape[1] + ids)
    return z[row_index, ids]


def write_at(z: torch.Tensor, row_index: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> None:
    """z[row_index, ids] = values, in place."""
    if z.is_contiguous():
        z.view(-1)[row_index * z.shape[1] + ids] = values
    else:
        z[row_index, ids] = values
