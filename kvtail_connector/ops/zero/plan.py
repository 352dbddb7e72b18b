"""The kernel's work buffer and row table, packed as ``ops/zero/work_schema.py`` lays them out.

A launch reads one int64 buffer: a :class:`WorkHeader` and one
:class:`WorkItem` line per item, whole blocks first, then tails. Work lines
are packed as bytes (:data:`ITEM_STRUCT`), whatever built them (numpy for
:meth:`KVZeroer.zero`, one ``struct.pack`` per item on the worker's paths),
and :func:`packed_work` puts a header before them. This module touches no
device.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
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

# One WorkItem line as the kernel's int64 work buffer holds it (native order).
ITEM_STRUCT = struct.Struct(f"={ITEM_COLS}q")
_HEADER_STRUCT = struct.Struct(f"={HEADER_WORDS}q")


class GroupRows(NamedTuple):
    """Where one cache group's rows for one kind of item (tails, or whole
    blocks) lie in a row table, and the most ``BLOCK`` chunks one needs."""

    start: int
    rows: int
    chunks: int


class WorkShape(NamedTuple):
    """A header's maxima for one kind of item: rows per item, chunks per row.
    A header may overstate them: the kernel skips the rows and chunks a line
    lacks, so one shape can serve lines of several groups."""

    rows: int
    chunks: int


NO_WORK = WorkShape(0, 0)


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


def row_span(row: Row) -> int:
    """Units (int32 words or bytes) the kernel stores for ``row`` at most."""
    return row.n_slots * row.run // row_unit(row)


def pack_line(block: int, first: int, rows: GroupRows) -> bytes:
    """One item's :class:`WorkItem` line, packed: ``first`` 0 zeroes the whole block."""
    return ITEM_STRUCT.pack(block, first, rows.start, rows.rows)


def packed_work(
    whole: bytes, tails: bytes, whole_shape: WorkShape, tail_shape: WorkShape
) -> tuple[bytes, int]:
    """The kernel's work buffer of packed lines, whole blocks then tails, under
    the given maxima, and its work units."""
    n_whole, n_tail = len(whole) // ITEM_STRUCT.size, len(tails) // ITEM_STRUCT.size
    whole_shape = whole_shape if n_whole else NO_WORK
    tail_shape = tail_shape if n_tail else NO_WORK
    units = n_whole * whole_shape.rows * whole_shape.chunks
    units += n_tail * tail_shape.rows * tail_shape.chunks
    if units > MAX_UNITS:
        raise ValueError(
            f"items: {units} work units exceed one launch ({MAX_UNITS}); split the call"
        )
    header = WorkHeader(
        n_whole=n_whole,
        rows_whole=whole_shape.rows,
        chunks_whole=whole_shape.chunks,
        n_tail=n_tail,
        rows_tail=tail_shape.rows,
        chunks_tail=tail_shape.chunks,
    )
    # The header's fields in column order (the schema's), padded to HEADER_WORDS.
    return _HEADER_STRUCT.pack(*header, *_HEADER_PADDING) + whole + tails, units


_HEADER_PADDING = (0,) * (HEADER_WORDS - len(WorkHeader._fields))


def items_work(
    items: np.ndarray,
    row_start: np.ndarray,
    row_count: np.ndarray,
    max_span: np.ndarray,
    num_groups: int,
    block: int,
) -> tuple[bytes, int]:
    """The work buffer of live ``(group, block, first)`` items (int64
    ``[n, 3]``), encoded by numpy, under their own maxima; and its work units.

    ``row_start``, ``row_count``, ``max_span``: per row range of the table,
    where it starts, its rows and their widest span in units; range ``g`` is
    group ``g``'s tail rows, ``num_groups + g`` its whole-block rows.
    ``block``: units one work unit stores (the launcher's ``BLOCK``).
    """
    is_whole = items[:, 2] == 0
    parts: list[tuple[bytes, WorkShape]] = []
    for whole in (True, False):
        chosen = items[is_whole if whole else ~is_whole]
        at = chosen[:, 0] + (num_groups if whole else 0)
        lines = np.empty((chosen.shape[0], ITEM_COLS), dtype=np.int64)
        lines[:, ITEM_COLUMN["block"]] = chosen[:, 1]
        lines[:, ITEM_COLUMN["first_slot"]] = chosen[:, 2]
        lines[:, ITEM_COLUMN["first_row"]] = row_start[at]
        lines[:, ITEM_COLUMN["row_count"]] = row_count[at]
        shape = NO_WORK
        if len(lines):
            chunks = -(-int(max_span[at].max()) // block)
            shape = WorkShape(int(row_count[at].max()), chunks)
        parts.append((lines.tobytes(), shape))
    (whole_lines, whole_shape), (tail_lines, tail_shape) = parts
    return packed_work(whole_lines, tail_lines, whole_shape, tail_shape)


def same_items_work(
    blocks_firsts: Sequence[tuple[int, int]], tails: GroupRows, whole: GroupRows, any_slots: int
) -> tuple[bytes, int]:
    """The work buffer zeroing ``(block, first slot)`` items in a group whose
    tail and whole-block rows are ``tails`` and ``whole`` and whose blocks
    have ``any_slots`` slots at most, and its work units (0: nothing to zero)."""
    whole_lines, tail_lines = [], []
    for block, first in blocks_firsts:
        if first >= any_slots:
            continue
        if first == 0 and whole.rows:
            whole_lines.append(pack_line(block, 0, whole))
        elif first and tails.rows:
            tail_lines.append(pack_line(block, first, tails))
    if not whole_lines and not tail_lines:
        return b"", 0
    return packed_work(
        b"".join(whole_lines),
        b"".join(tail_lines),
        WorkShape(whole.rows, whole.chunks),
        WorkShape(tails.rows, tails.chunks),
    )
