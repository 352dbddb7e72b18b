"""The kernel's tables have one layout: what the packers write, the schema's names read.

- Work buffers packed by every encoder (``KVZeroer.zero``'s numpy encoding,
  the worker's lines packed one by one, the per-layer encoding of
  ``KVZeroer.stage``) decode, by the names of ``ops/zero/work_schema.py``, to
  values worked out here by hand.
- The kernel, given its columns by the launcher, zeroes exactly what the
  reference does on a case where every column of every table matters (a
  column read from the wrong place zeroes other bytes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtail_connector.ops import KVZeroer, PageRegion, RegionCache, reference_zero_kv_blocks
from kvtail_connector.ops.geometry import Row
from kvtail_connector.ops.zero.launcher import COLUMNS, kernel
from kvtail_connector.ops.zero.plan import (
    WorkShape,
    pack_line,
    packed_work,
    row_table,
    same_items_work,
)
from kvtail_connector.ops.zero.work_schema import (
    HEADER_WORDS,
    ITEM_COLS,
    ROW_COLS,
    RowEntry,
    WorkHeader,
    WorkItem,
    kernel_columns,
)
from tests.helpers.layouts import make_backing, rebase
from tests.ops.test_zero_kv_blocks import INTERPRET, _diff

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")


def _decode(work: bytes | np.ndarray) -> tuple[WorkHeader, list[WorkItem]]:
    if isinstance(work, bytes):
        work = np.frombuffer(work, dtype=np.int64)
    header = WorkHeader(*map(int, work[: len(WorkHeader._fields)]))
    assert not work[len(WorkHeader._fields) : HEADER_WORDS].any()  # padding
    body = work[HEADER_WORDS:].reshape(-1, ITEM_COLS)
    return header, [WorkItem(*map(int, line)) for line in body]


def test_kernel_takes_every_column_of_the_schema_and_nothing_else():
    params = kernel().arg_names
    assert params[:3] == ["work_ptr", "rows_ptr", "BLOCK"]
    assert sorted(params[3:]) == sorted(kernel_columns())
    assert len(WorkHeader._fields) <= HEADER_WORDS
    assert COLUMNS["ROW_VECTORIZED"] == RowEntry._fields.index("vectorized")


def test_row_table_decodes_to_the_kernel_units():
    word = Row(base=1024, block_stride=4096, slot_stride=48, run=32, n_slots=5, first_slot=3)
    byte = Row(
        base=1001, block_stride=600, slot_stride=7, run=5, n_slots=4, first_slot=1, slot_step=2
    )
    table = row_table([word, byte])
    assert table.shape == (2, ROW_COLS)
    assert RowEntry(*map(int, table[0])) == RowEntry(
        base=1024, block_stride=4096, slot_stride=12, run=8, n_slots=5, first_slot=3,
        unit=4, vectorized=0, slot_step=1,
    )  # fmt: skip
    assert RowEntry(*map(int, table[1])) == RowEntry(
        base=1001, block_stride=600, slot_stride=7, run=5, n_slots=4, first_slot=1,
        unit=1, vectorized=0, slot_step=2,
    )  # fmt: skip
    vec = Row(base=2048, block_stride=8192, slot_stride=64, run=64, n_slots=16, first_slot=0)
    assert RowEntry(*map(int, row_table([vec])[0])).vectorized == 1


def _zeroer(implementation: str = "triton") -> KVZeroer:
    # Group g (one layer each): 2 heads x 4 slots x 8 fp16 per page, head-major:
    # per page, 2 tail rows (one per head) and 1 whole-block row (the page).
    backing = make_backing(
        "LBHNC", num_layers=2, num_pages=8, heads=2, slots=4, content=8, dtype=torch.float16
    )
    return KVZeroer([([v], 2) for v in backing.views], implementation=implementation)


@needs_interpreter
def test_every_encoder_packs_the_schema_columns():
    zeroer = _zeroer()
    # Rows per group: tails of group 0 at 0..3 (2 pages x 2 heads), of group 1
    # at 4..7; whole blocks of group 0 at 8 (one merged span), of group 1 at 9.
    want_header = WorkHeader(
        n_whole=1, rows_whole=1, chunks_whole=1, n_tail=2, rows_tail=4, chunks_tail=1
    )

    def want_items(group):
        whole_row, tail_row = (8, 0) if group == 0 else (9, 4)
        return [
            WorkItem(block=2, first_slot=0, first_row=whole_row, row_count=1),
            WorkItem(block=3, first_slot=5, first_row=tail_row, row_count=4),
            WorkItem(block=1, first_slot=2, first_row=tail_row, row_count=4),
        ]

    items = [(1, 3, 5), (1, 2, 0), (1, 1, 2)]  # the whole block goes first
    ran: list[bytes] = []
    assert zeroer._launcher is not None
    zeroer._launcher.run = lambda work, units: ran.append(work)  # the buffer, not the launch
    zeroer.zero(np.array(items))
    (by_numpy,) = ran

    whole = b"".join(pack_line(b, f, zeroer.rows_for(g, f)) for g, b, f in items if f == 0)
    tails = b"".join(pack_line(b, f, zeroer.rows_for(g, f)) for g, b, f in items if f)
    widest = WorkShape(rows=4, chunks=1), WorkShape(rows=1, chunks=1)  # tails, whole
    by_line, _ = packed_work(whole, tails, widest[1], widest[0])
    assert _decode(by_numpy) == _decode(by_line) == (want_header, want_items(1))

    # The per-layer encoding: each group reads a table of its own, its tail
    # rows from row 0 and its whole-block rows after them.
    tail_rows, whole_rows = zeroer.rows_for(0, 5), zeroer.rows_for(0, 0)
    own_tails, own_whole = tail_rows._replace(start=0), whole_rows._replace(start=4)
    staged, _ = same_items_work([(3, 5), (2, 0), (1, 2)], own_tails, own_whole, 8)
    header, lines = _decode(staged)
    assert header == want_header
    assert lines == [
        WorkItem(block=2, first_slot=0, first_row=4, row_count=1),
        WorkItem(block=3, first_slot=5, first_row=0, row_count=4),
        WorkItem(block=1, first_slot=2, first_row=0, row_count=4),
    ]


def _mixed_caches(raw_b, views_a):
    """Group 0: head-major fp16 pages seen with one of two heads (slot stride
    != run, pages of 2 per block); group 1: byte regions, one over every
    other slot (unit 1, slot step 2)."""
    half = [v[:, :1] for v in views_a]
    page = torch.as_strided(raw_b, (6, 64), (64, 1), 16)
    region = RegionCache(
        page,
        8,
        (
            PageRegion(offset=0, slot_bytes=3),
            PageRegion(offset=30, slot_bytes=5, slot_stride=7, first_slot=1, slot_step=2),
        ),
    )
    return half + [views_a[0]], [region]


@needs_interpreter
def test_kernel_matches_the_reference_where_every_column_matters():
    a = make_backing(
        "LBNHC", num_layers=2, num_pages=8, heads=2, slots=8, content=1024, dtype=torch.float16
    )
    gen = torch.Generator().manual_seed(7)
    raw_b = torch.randint(1, 255, (6 * 64 + 32,), dtype=torch.uint8, generator=gen)
    expected_a, expected_b = a.raw.clone(), raw_b.clone()
    group0, group1 = _mixed_caches(raw_b, a.views)
    zeroer = KVZeroer([(group0, 2), (group1, 1)], implementation="triton")

    # The case exercises every row column: both units, both store widths,
    # slot strides unlike runs, first slots past 0, slot steps past 1, and
    # more than one chunk per row.
    assert zeroer._launcher is not None
    rows = [RowEntry(*map(int, r)) for r in zeroer._launcher.rows.cpu().numpy()]
    assert {r.unit for r in rows} == {1, 4} and {r.vectorized for r in rows} == {0, 1}
    assert any(r.slot_stride != r.run for r in rows) and any(r.slot_step == 2 for r in rows)
    assert any(r.first_slot > 0 for r in rows) and any(r.n_slots > 1 for r in rows)
    assert any(r.run * r.n_slots > 2048 for r in rows)  # BLOCK units: several chunks

    items = [(0, 1, 0), (0, 3, 11), (0, 2, 5), (1, 4, 0), (1, 2, 3), (1, 0, 6)]
    zeroer.zero(np.array(items))

    ref0, ref1 = _mixed_caches(expected_b, rebase(a.views, expected_a))
    reference_zero_kv_blocks(ref0, [1], [(3, 11), (2, 5)], pages_per_block=2)
    reference_zero_kv_blocks(ref1, [4], [(2, 3), (0, 6)])
    assert torch.equal(a.raw, expected_a), _diff(a.raw, expected_a)
    assert torch.equal(raw_b, expected_b), _diff(raw_b, expected_b)
