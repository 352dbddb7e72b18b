"""The kernel's work buffer: row tables, work lines and their encodings.

A launch reads one int64 buffer: a header (counts and maxima, see the kernel
docstring) and one line per item, whole blocks first, then tails. This module
builds it from lines, numpy-encoded items, or the same items for several
groups at once; it touches no device.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvtail_connector.ops import launcher as L
from kvtail_connector.ops.geometry import Row


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


def row_table(rows: list[Row]) -> np.ndarray:
    table = np.zeros((max(len(rows), 1), L.ROW_COLS), dtype=np.int64)
    for i, r in enumerate(rows):
        unit = row_unit(r)
        table[i] = (
            r.base,
            r.block_stride,
            r.slot_stride // unit,
            r.run // unit,
            r.n_slots,
            r.first_slot,
            unit,
            int(vectorizable(r)),
            r.slot_step,
        )
    return table


def work_header(
    n_whole: int, w_rows: int, w_chunks: int, n_tail: int, t_rows: int, t_chunks: int
) -> tuple[list[int], int]:
    """The kernel's work header (see the kernel docstring) and its work units."""
    units = n_whole * w_rows * w_chunks + n_tail * t_rows * t_chunks
    if units > L.MAX_UNITS:
        raise ValueError(
            f"items: {units} work units exceed one launch ({L.MAX_UNITS}); split the call"
        )
    return [n_whole, w_rows, w_chunks, n_tail, t_rows, t_chunks, 0, 0], units


class Line(NamedTuple):
    """One item and its kernel work line (see ``KVZeroer.line``)."""

    item: tuple[int, int, int]  # group, block, first slot
    work: tuple[int, int, int, int]  # block, first slot, first row, row count
    rows: int
    chunks: int


@dataclass(frozen=True)
class Encoded:
    """Items turned into kernel work lines (see :meth:`KVZeroer.encode`).

    Attributes:
        items: the live (group, block, first) items, for the torch path.
        whole, tails: ``[k, ITEM_COLS]`` work lines of whole blocks / tails.
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
        count=L.HEADER + L.ITEM_COLS * len(lines),
    )
    return work, units


def parts_work(parts: Sequence[Encoded]) -> tuple[np.ndarray, int]:
    """The kernel's work buffer (header + whole-block lines + tail lines)."""
    if len(parts) == 1:
        whole, tails = parts[0].whole, parts[0].tails
    else:
        whole = np.concatenate([p.whole for p in parts])
        tails = np.concatenate([p.tails for p in parts])
    n_whole = len(whole)
    header, units = work_header(
        n_whole,
        max(p.whole_rows for p in parts),
        max(p.whole_chunks for p in parts),
        len(tails),
        max(p.tail_rows for p in parts),
        max(p.tail_chunks for p in parts),
    )
    work = np.empty(L.HEADER + (n_whole + len(tails)) * L.ITEM_COLS, dtype=np.int64)
    work[: L.HEADER] = header
    body = work[L.HEADER :].reshape(-1, L.ITEM_COLS)
    body[:n_whole] = whole
    body[n_whole:] = tails
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
    work = np.empty((len(tail_starts), L.HEADER + n * L.ITEM_COLS), dtype=np.int64)
    work[:, : L.HEADER] = header
    body = work[:, L.HEADER :].reshape(len(tail_starts), n, L.ITEM_COLS)
    body[:, :, :2] = np.concatenate([whole, tails])
    body[:, : len(whole), 2] = whole_starts[:, None]
    body[:, : len(whole), 3] = w_count
    body[:, len(whole) :, 2] = tail_starts[:, None]
    body[:, len(whole) :, 3] = t_count
    return [(row, units) for row in work]
