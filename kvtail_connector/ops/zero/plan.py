"""The kernel's work buffer and row table, packed as ``ops/zero/work_schema.py`` lays them out.

A launch reads one int64 buffer: a :class:`WorkHeader` and one
:class:`WorkItem` line per item, whole blocks first, then tails. This module
builds it from lines, numpy-encoded items, or the same items for several
groups at once, and the row table from rows; it touches no device.
"""

from __future__ import annotations

import functools
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvtail_connector.ops.geometry import Row
from kvtail_connector.ops.zero.work_schema import (
    HEADER_WORDS,
    ITEM_COLS,
    ITEM_COLUMN,
    MAX_UNITS,
    ROW_COLS,
    RowEntry,
    WorkHeader,
)


def row_unit(row: Row) -> int:
    return 4 if row.word_aligned else 1


def vectorizable(row: Row) -> bool:
    """16-byte stores are exact: aligned page and runs of whole 16-byte vectors."""
    return (
        row.slot_stride == row.run
        and row.base % 16 == 0
        and row.block_stride % 16 == 0
        and row.run % 16 == 0
    )


def row_entry(row: Row) -> RowEntry:
    """``row`` in the kernel's units (strides and runs in int32 words or bytes)."""
    unit = row_unit(row)
    return RowEntry(
        base=row.base,
        block_stride=row.block_stride,
        slot_stride=row.slot_stride // unit,
        run=row.run // unit,
        n_slots=row.n_slots,
        first_slot=row.first_slot,
        unit=unit,
        vectorized=int(vectorizable(row)),
        slot_step=row.slot_step,
    )


def row_table(rows: list[Row]) -> np.ndarray:
    """int64 ``[max(n_rows, 1), ROW_COLS]``: one :class:`RowEntry` per row."""
    table = np.zeros((max(len(rows), 1), ROW_COLS), dtype=np.int64)
    for i, r in enumerate(rows):
        table[i] = row_entry(r)
    return table


def work_header(
    n_whole: int, w_rows: int, w_chunks: int, n_tail: int, t_rows: int, t_chunks: int
) -> tuple[list[int], int]:
    """The kernel's work header, padded to ``HEADER_WORDS``, and its work units."""
    units = n_whole * w_rows * w_chunks + n_tail * t_rows * t_chunks
    if units > MAX_UNITS:
        raise ValueError(
            f"items: {units} work units exceed one launch ({MAX_UNITS}); split the call"
        )
    header = WorkHeader(
        n_whole=n_whole,
        rows_whole=w_rows,
        chunks_whole=w_chunks,
        n_tail=n_tail,
        rows_tail=t_rows,
        chunks_tail=t_chunks,
    )
    return [*header, *_HEADER_PADDING], units


_HEADER_PADDING = (0,) * (HEADER_WORDS - len(WorkHeader._fields))


class Line(NamedTuple):
    """One item and its kernel work line (see ``StepZeroer.line``)."""

    item: tuple[int, int, int]  # group, block, first slot
    # A WorkItem's columns (block, first slot, first row, row count), as a
    # plain tuple: built per item on the worker's completion path.
    work: tuple[int, int, int, int]
    rows: int
    chunks: int


@dataclass(frozen=True)
class Encoded:
    """Items turned into kernel work lines (see ``KVZeroer._encode``).

    Attributes:
        items: the live (group, block, first) items, for the torch path.
        whole, tails: ``[k, ITEM_COLS]`` :class:`WorkItem` lines of whole blocks / tails.
        whole_rows, whole_chunks, tail_rows, tail_chunks: the largest row
            count and chunk count among those lines (the kernel's header).
    """

    items: np.ndarray
    whole: np.ndarray
    tails: np.ndarray
    whole_rows: int
    whole_chunks: int
    tail_rows: int
    tail_chunks: int

    @property
    def num_items(self) -> int:
        return int(self.items.shape[0])


def line_work(lines: Sequence[Line]) -> tuple[np.ndarray, int]:
    """The kernel's work buffer for ``lines`` and its work units."""
    whole = [ln for ln in lines if ln.item[2] == 0]
    tails = [ln for ln in lines if ln.item[2] != 0] if whole else lines
    header, units = work_header(
        len(whole),
        max((ln.rows for ln in whole), default=0),
        max((ln.chunks for ln in whole), default=0),
        len(tails),
        max((ln.rows for ln in tails), default=0),
        max((ln.chunks for ln in tails), default=0),
    )
    rows = itertools.chain((header,), (ln.work for ln in whole), (ln.work for ln in tails))
    work = np.fromiter(
        itertools.chain.from_iterable(rows),
        dtype=np.int64,
        count=HEADER_WORDS + ITEM_COLS * len(lines),
    )
    return work, units


def fill_line_work(buf: np.ndarray, lines: Sequence[Line]) -> int:
    """:func:`line_work` written into ``buf`` (int64, at least ``HEADER_WORDS
    + ITEM_COLS * len(lines)`` long); returns the work units. Tails only (the
    completion path's usual case) skip the itertools packing."""
    n = len(lines)
    if n == 0 or any(ln.item[2] == 0 for ln in lines):
        work, units = line_work(lines)
        buf[: work.size] = work
        return units
    if n == 1:
        line = lines[0]
        rows, chunks = line.rows, line.chunks
        buf[HEADER_WORDS : HEADER_WORDS + ITEM_COLS] = line.work
    else:
        rows = max([ln.rows for ln in lines])
        chunks = max([ln.chunks for ln in lines])
        end = HEADER_WORDS + ITEM_COLS * n
        buf[HEADER_WORDS:end] = list(itertools.chain.from_iterable([ln.work for ln in lines]))
    header, units = work_header(0, 0, 0, n, rows, chunks)
    buf[:HEADER_WORDS] = header
    return units


# One WorkItem line as the kernel's int64 work buffer holds it (native order).
ITEM_STRUCT = struct.Struct(f"={ITEM_COLS}q")


def packed_line(line: Line) -> bytes:
    """:func:`packed_lines` of one line."""
    return ITEM_STRUCT.pack(*line.work)


def packed_lines(lines: Sequence[Line]) -> bytes:
    """The :class:`WorkItem` columns of ``lines`` as the work buffer holds
    them, for :func:`fill_packed_work` (built per load, where it arrives)."""
    return b"".join([ITEM_STRUCT.pack(*ln.work) for ln in lines])


def fill_packed_work(buf: memoryview, packed: bytes, n_tail: int, rows: int, chunks: int) -> int:
    """The work buffer of ``n_tail`` tail lines (no whole block) whose columns
    are ``packed`` (:func:`packed_lines`, joined) and whose largest row and
    chunk counts are ``rows`` and ``chunks``, written into ``buf`` (the bytes
    of an int64 buffer); returns the work units. What :func:`line_work` builds
    for the same lines, in two byte copies."""
    start = HEADER_WORDS * 8
    if len(packed) != n_tail * ITEM_COLS * 8:
        # The slot still holds an older step's lines past what is written:
        # a header counting them would zero other requests' slots.
        raise ValueError(f"packed: {len(packed)} bytes for {n_tail} work lines")
    header, units = _tail_header(n_tail, rows, chunks)
    buf[start : start + len(packed)] = packed
    buf[:start] = header
    return units


@functools.lru_cache(maxsize=4096)
def _tail_header(n_tail: int, rows: int, chunks: int) -> tuple[bytes, int]:
    """The packed work header of tail lines only, and its work units (a step
    repeats the few shapes of the last ones)."""
    header, units = work_header(0, 0, 0, n_tail, rows, chunks)
    return struct.pack(f"={HEADER_WORDS}q", *header), units


def encoded_work(encoded: Encoded) -> tuple[np.ndarray, int]:
    """The kernel's work buffer (header + whole-block lines + tail lines)."""
    whole, tails = encoded.whole, encoded.tails
    n_whole = len(whole)
    header, units = work_header(
        n_whole,
        encoded.whole_rows,
        encoded.whole_chunks,
        len(tails),
        encoded.tail_rows,
        encoded.tail_chunks,
    )
    work = np.empty(HEADER_WORDS + (n_whole + len(tails)) * ITEM_COLS, dtype=np.int64)
    work[:HEADER_WORDS] = header
    body = work[HEADER_WORDS:].reshape(-1, ITEM_COLS)
    body[:n_whole] = whole
    body[n_whole:] = tails
    return work, units


def tail_work(blocks_firsts: np.ndarray, count: int, chunks: int) -> tuple[np.ndarray, int]:
    """The work buffer of tails ``blocks_firsts`` (int64 ``[n, 2]``: block,
    first slot > 0) over rows ``[0, count)`` of a table, ``chunks`` chunks
    each at most; and its work units."""
    n = len(blocks_firsts)
    header, units = work_header(0, 0, 0, n, count, chunks)
    work = np.empty(HEADER_WORDS + n * ITEM_COLS, dtype=np.int64)
    work[:HEADER_WORDS] = header
    body = work[HEADER_WORDS:].reshape(n, ITEM_COLS)
    body[:, ITEM_COLUMN["block"]] = blocks_firsts[:, 0]
    body[:, ITEM_COLUMN["first_slot"]] = blocks_firsts[:, 1]
    body[:, ITEM_COLUMN["first_row"]] = 0
    body[:, ITEM_COLUMN["row_count"]] = count
    return work, units


def same_items_work(
    row_starts: tuple[np.ndarray, np.ndarray],
    blocks_firsts: Sequence[tuple[int, int]],
    any_slots: int,
    tail_facts: tuple[int, int],
    whole_facts: tuple[int, int],
) -> list[tuple[np.ndarray, int] | None]:
    """Per group, the work buffer zeroing ``blocks_firsts`` in groups of one
    geometry, whose tail and whole-block rows start at ``row_starts``."""
    (t_count, t_chunks), (w_count, w_chunks) = tail_facts, whole_facts
    bf = np.asarray(blocks_firsts, dtype=np.int64).reshape(-1, 2)
    whole = bf[(bf[:, 1] == 0) & (w_count > 0)]
    tails = bf[(bf[:, 1] > 0) & (bf[:, 1] < any_slots) & (t_count > 0)]
    n = len(whole) + len(tails)
    tail_starts, whole_starts = row_starts
    if n == 0:
        return [None] * len(tail_starts)
    header, units = work_header(
        len(whole),
        w_count if len(whole) else 0,
        w_chunks if len(whole) else 0,
        len(tails),
        t_count if len(tails) else 0,
        t_chunks if len(tails) else 0,
    )
    work = np.empty((len(tail_starts), HEADER_WORDS + n * ITEM_COLS), dtype=np.int64)
    work[:, :HEADER_WORDS] = header
    body = work[:, HEADER_WORDS:].reshape(len(tail_starts), n, ITEM_COLS)
    items = np.concatenate([whole, tails])
    body[:, :, ITEM_COLUMN["block"]] = items[:, 0]
    body[:, :, ITEM_COLUMN["first_slot"]] = items[:, 1]
    body[:, : len(whole), ITEM_COLUMN["first_row"]] = whole_starts[:, None]
    body[:, : len(whole), ITEM_COLUMN["row_count"]] = w_count
    body[:, len(whole) :, ITEM_COLUMN["first_row"]] = tail_starts[:, None]
    body[:, len(whole) :, ITEM_COLUMN["row_count"]] = t_count
    return [(row, units) for row in work]
