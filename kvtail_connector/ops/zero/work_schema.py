"""The zeroing kernel's int64 inputs, column by column: the one definition.

A launch reads two int64 tables:

- the *work buffer*: :class:`WorkHeader` (padded to :data:`HEADER_WORDS`),
  then one :class:`WorkItem` line per item, whole-block items first, then
  tails;
- the *row table*: one :class:`RowEntry` per row (one region of one kernel
  page of a manager block), built once per zeroer.

The field order of each NamedTuple is its column order. ``ops/zero/plan.py`` packs
by these names, and the launcher hands the kernel every column as a
``tl.constexpr`` (:func:`kernel_columns`), so the kernel file holds no copy
of this layout. Triton-free: importing it loads no compiler.
"""

from __future__ import annotations

from typing import NamedTuple


class WorkHeader(NamedTuple):
    """The work buffer's first words: counts of each item kind and their maxima.

    Work unit ``w`` of a kind is (item fastest, then row, then chunk), so a
    kind has ``n * rows * chunks`` units, the maxima over its items.
    """

    n_whole: int  # whole-block items (first slot 0)
    rows_whole: int  # most rows any whole-block item has
    chunks_whole: int  # most BLOCK-sized chunks any of its rows needs
    n_tail: int  # tail items, after the whole-block ones
    rows_tail: int
    chunks_tail: int


# Header words before the first item: padded so that an item line, and a work
# buffer staged after another (8 + 4k words), starts 32-byte aligned.
HEADER_WORDS = 8


class WorkItem(NamedTuple):
    """One item's line of the work buffer: which block, from which slot, which rows."""

    block: int  # manager block id
    first_slot: int  # first block-local slot to zero (across the block's kernel pages)
    first_row: int  # index of the item's first row in the row table
    row_count: int  # consecutive rows from there


class RowEntry(NamedTuple):
    """One row of the row table, in the kernel's units.

    The row serves block-local slots ``first_slot + k * slot_step`` for
    ``0 <= k < n_slots``; the k-th one, in block ``b``, starts at byte
    ``base + b * block_stride + k * slot_stride * unit`` and is
    ``run * unit`` bytes long.
    """

    base: int  # byte address of block 0's first served slot
    block_stride: int  # bytes between manager blocks
    slot_stride: int  # units between served slots
    run: int  # units one slot spans
    n_slots: int  # slots the row serves
    first_slot: int  # block-local slot of the first one
    unit: int  # 4: int32 stores, 1: byte stores
    vectorized: int  # 1: 16-byte aligned runs of whole 16-byte vectors (16-byte stores)
    slot_step: int  # block-local slots between served slots


ITEM_COLS = len(WorkItem._fields)
ROW_COLS = len(RowEntry._fields)
# Column index by field name, for code that packs whole columns (numpy).
ITEM_COLUMN = {name: i for i, name in enumerate(WorkItem._fields)}
ROW_COLUMN = {name: i for i, name in enumerate(RowEntry._fields)}
# Work units are counted in int32 inside the kernel.
MAX_UNITS = 2**31 - 1


def kernel_columns() -> dict[str, int]:
    """Every offset and width the kernel reads, as its constexpr arguments.

    ``HEADER_<FIELD>`` / ``ITEM_<FIELD>`` / ``ROW_<FIELD>`` for each field (upper
    case), and ``HEADER_WORDS``, ``ITEM_COLS``, ``ROW_COLS``.
    """
    columns = {"HEADER_WORDS": HEADER_WORDS, "ITEM_COLS": ITEM_COLS, "ROW_COLS": ROW_COLS}
    for prefix, table in (("HEADER", WorkHeader), ("ITEM", WorkItem), ("ROW", RowEntry)):
        for index, field in enumerate(table._fields):
            columns[f"{prefix}_{field.upper()}"] = index
    return columns
