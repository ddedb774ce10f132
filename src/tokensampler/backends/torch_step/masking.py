"""The helpers of steps 1 and 3 that set removed ids of float32 `z` to `-inf`: NaN and padding, the
call's token bitmask (the bit unpacking and the table lookup), the bad words matched on the device.
The stages themselves (which rows, in which order) are `stages.py`."""

from __future__ import annotations

import sys
from typing import Callable

import torch

from ...core.constants import NEG_INF
from ...core.order import saturate_posinf as _saturate
from . import native
from .host import numpy_module


def prepare_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 copy of `logits[:, :vocab_size]` (padding dropped) with NaN set to -inf."""
    z = logits[:, :vocab_size].to(torch.float32, copy=True)
    return z.masked_fill_(torch.isnan(z), NEG_INF)


def prepare_logits_into(out: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """`prepare_logits` written into `out` (float32 [B, V]): no allocation, one in-place NaN pass."""
    source = logits[:, :out.shape[1]]
    if source.dtype == torch.float32:  # one pass: read, replace NaN, write
        return torch.nan_to_num(source, nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF, out=out)
    out.copy_(source)
    return out.nan_to_num_(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)


def saturate_posinf(z: torch.Tensor) -> torch.Tensor:
    """The +inf rule (`core.order.saturate_posinf`) in place on clean float32 rows `z` [B, V]."""
    return _saturate(z, out=z)


def bitmask_removed(bitmask: torch.Tensor, start: int, width: int, *, invert: bool = True) -> torch.Tensor:
    """Which of the ids [start, start + width) a token bitmask removes (step 3).

    Parameters
    ----------
    bitmask: int32 [B, W] in xgrammar's layout: bit j (least significant first) of word w allows id
        32 w + j (the int32 holds the bit pattern: bit 31 is the sign bit).
    start, width: the ids asked (a row block's vocabulary, or a split rank's columns); ids beyond
        the mask's 32 W bits count as removed (the caller's padding).

    invert: False returns the allowed ids instead (True where the bit is 1; ids beyond the mask False).

    Returns
    -------
    bool [B, width], True where the bit is 0. On a little-endian CPU the words are read as bytes
    and unpacked by numpy (one byte per id, no int32 temporary of the row's size); elsewhere by
    shifts in torch."""
    words = bitmask.shape[1]
    first = start // 32
    if bitmask.device.type == "cpu" and sys.byteorder == "little" and numpy_module() is not None:
        lead = start - 32 * first
        return _unpacked(bitmask, first, -(-(start + width) // 32), invert)[:, lead:lead + width]
    ids = torch.arange(start, start + width, device=bitmask.device)
    word = bitmask[:, (ids // 32).clamp_max(words - 1)]
    bit = (word >> (ids % 32).to(torch.int32)) & 1
    removed = (bit == 0) | (ids >= 32 * words)[None, :]
    return removed if invert else ~removed


def _words(bitmask: torch.Tensor, first: int, stop_word: int) -> torch.Tensor:
    """int32 [B, stop_word - first], contiguous: words [first, stop_word), zeros beyond the mask."""
    batch, words = bitmask.shape
    part = bitmask[:, first:min(stop_word, words)]
    if stop_word > words:
        part = torch.cat([part, torch.zeros((batch, stop_word - words), dtype=torch.int32)], dim=1)
    return part.contiguous()


def _unpacked(bitmask: torch.Tensor, first: int, stop_word: int, invert: bool) -> torch.Tensor:
    """bool [B, 32 (stop_word - first)], contiguous: the bits of words [first, stop_word) of a CPU
    bitmask, one byte per id (numpy's unpackbits on the little-endian bytes), inverted if asked;
    words beyond the mask read as 0 (every id removed)."""
    np = numpy_module()
    packed = _words(bitmask, first, stop_word).view(torch.uint8).numpy()
    bits = np.unpackbits(np.invert(packed) if invert else packed, axis=1, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)


_MIN_TABLE = None
SPREAD_ELEMENTS = 1 << 19  # floats of the table lookup's buffer (2 MiB): 3 rows at V = 152k


def _min_table():
    """float32 [256, 8]: entry (v, j) is +inf if bit j of byte v is set, else -inf (a byte of the
    mask as eight `minimum` operands: min(z, +inf) = z, min(z, -inf) = -inf, +inf included)."""
    global _MIN_TABLE
    if _MIN_TABLE is None:
        np = numpy_module()
        bits = (np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1
        _MIN_TABLE = np.where(bits != 0, np.inf, -np.inf).astype(np.float32)
    return _MIN_TABLE


def remove_by_bitmask(z: torch.Tensor, bitmask: torch.Tensor, start: int = 0,
                      buffer: Callable[[int], torch.Tensor] | None = None, compiled: bool = False) -> torch.Tensor:
    """Set every id of `z` (float32 [B, width], column c = id start + c, no NaN) whose bit in
    `bitmask` (int32 [B, W]) is 0 to -inf, in place; ids beyond the mask's 32 W bits too.

    On a little-endian CPU each byte of a row's mask is looked up in a [256, 8] table of +-inf and
    `z = minimum(z, that)`: min(z, +inf) = z, min(z, -inf) = -inf (+inf included), no bool mask
    of the row's size (torch's masked_fill with one measured ~3x slower on the bench's rows). With
    `buffer` (a callable giving a reused float32 buffer of >= n elements) the block's rows are
    looked up at once by torch (`index_select`, parallel); without, row by row by numpy into one
    row's buffer. Rows whose bits are all ones are skipped. Elsewhere: `masked_fill`. `compiled`
    (the sampler compiles): the C++ pass (`native.bitmask_op`) where it is built, the same values."""
    width = z.shape[1]
    op = native.bitmask_op() if compiled and _native_layout(z, bitmask) else None
    if op is not None:
        op(z, bitmask, start)
        return z
    if (z.device.type != "cpu" or sys.byteorder != "little" or z.dtype != torch.float32 or z.stride(1) != 1
            or numpy_module() is None):
        return z.masked_fill_(bitmask_removed(bitmask, start, width).to(z.device), NEG_INF)
    np = numpy_module()

    first, lead = start // 8, start % 8  # the row's column 0 is bit `lead` of byte `first`
    count = -(-(lead + width) // 8)
    words = _words(bitmask, first // 4, -(-(first + count) // 4))
    packed = words.view(torch.uint8)[:, first % 4:first % 4 + count]
    masked = _constrained_rows(packed.numpy(), lead, width)
    if not masked.size:
        return z
    table = _min_table()
    if buffer is not None and lead == 0 and masked.size == z.shape[0]:
        step = max(1, SPREAD_ELEMENTS // (count * 8))  # rows looked up at once: a bounded buffer
        spread = buffer(step * count * 8)[:step * count * 8]
        table_t, indices = torch.from_numpy(table), packed.to(torch.int64)
        for r in range(0, z.shape[0], step):
            rows = slice(r, min(r + step, z.shape[0]))
            part = spread[:(rows.stop - r) * count * 8].view(-1, 8)
            torch.index_select(table_t, 0, indices[rows].reshape(-1), out=part)
            torch.minimum(z[rows], part.view(rows.stop - r, count * 8)[:, :width], out=z[rows])
        return z
    rows = z.numpy()
    row_bytes = packed.numpy()
    spread = np.empty((count, 8), dtype=np.float32)
    row_bits = spread.reshape(-1)[lead:lead + width]
    for r in masked.tolist():
        np.take(table, row_bytes[r], axis=0, out=spread)
        np.minimum(rows[r], row_bits, out=rows[r])
    return z


def _native_layout(z: torch.Tensor, bitmask: torch.Tensor) -> bool:
    return (native.rows_layout(z, torch.float32) and native.rows_layout(bitmask, torch.int32)
            and bitmask.shape[0] == z.shape[0])


def _constrained_rows(packed, lead: int, width: int):
    """The rows (numpy indices) of `packed` (uint8 [B, bytes]; a row's column 0 is bit `lead` of
    byte 0) with a 0 bit among its `width` ids: the rows the mask changes."""
    np = numpy_module()

    stop = lead + width
    inner_lo, inner_hi = -(-lead // 8), stop // 8  # bytes entirely inside the ids
    changed = np.zeros(packed.shape[0], dtype=bool)
    if inner_hi > inner_lo:
        changed |= (packed[:, inner_lo:inner_hi] != 0xFF).any(axis=1)
    for byte in {0, inner_hi} - set(range(inner_lo, inner_hi)):  # the partial bytes at either end
        low, high = max(lead - 8 * byte, 0), min(stop - 8 * byte, 8)
        if byte < packed.shape[1] and high > low:
            needed = ((1 << high) - 1) & ~((1 << low) - 1)
            changed |= (packed[:, byte] & needed) != needed
    return np.flatnonzero(changed)


def banned_tokens(bad_words: torch.Tensor, recent_tokens: torch.Tensor | None) -> torch.Tensor:
    """The ids the bad words remove this step (vLLM's rule), per row: no host sync.

    Parameters
    ----------
    bad_words: int64 [B, words, L], each row's bad words right-aligned (-1 = no constraint).
    recent_tokens: int64 [B, L - 1], each row's latest output tokens right-aligned (-2 = none), or
        None when every word is one token long.

    Returns
    -------
    int64 [B, words]: the last token of each word whose other tokens end the output, else -1."""
    prefix, last = bad_words[:, :, :-1], bad_words[:, :, -1]
    if prefix.shape[2]:
        matched = ((prefix == -1) | (prefix == recent_tokens[:, None, :])).all(dim=-1)
    else:
        matched = torch.ones_like(last, dtype=torch.bool)
    return torch.where(matched, last, torch.full_like(last, -1))


def banned_cells(banned: torch.Tensor, start: int = 0, width: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row index, column) int64 of the banned ids (`banned_tokens`) that fall in the columns
    [start, start + width) (column = id - start), or None when there is none (reads the count)."""
    columns = banned - start
    hit = columns >= 0 if width is None else (columns >= 0) & (columns < width)
    rows, words = torch.nonzero(hit, as_tuple=True)
    if rows.numel() == 0:
        return None
    return rows, columns[rows, words]
