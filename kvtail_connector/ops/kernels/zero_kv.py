"""Triton kernel that zeroes KV slots of manager blocks: ``@triton.jit`` only."""

import triton
import triton.language as tl

# Layout of the int64 work buffer and row table; built by ops/plan.py.
HEADER: tl.constexpr = tl.constexpr(8)
ITEM_COLS: tl.constexpr = tl.constexpr(4)
ROW_COLS: tl.constexpr = tl.constexpr(9)


@triton.jit
def zero_kv_slots_kernel(
    work_ptr,  # int64: HEADER words, then [n_whole + n_tail, ITEM_COLS] items
    rows_ptr,  # int64 [n_rows, ROW_COLS]
    BLOCK: tl.constexpr,  # units (int32 words or bytes) one work unit stores
):
    """Zero slots ``[first_slot, ...)`` of manager blocks in every row.

    Header: ``n_whole, rows_whole, chunks_whole, n_tail, rows_tail,
    chunks_tail`` (then padding). Whole-block items come first, then tails.
    Work unit ``w`` of a kind is (item fastest, then row, then chunk): the
    kernel is persistent, each program striding over units, so the grid is a
    fixed size (the same launch replays from a CUDA graph) and no program is
    spent on rows or chunks an item does not have.

    Item columns: block id, first slot to zero (block-local, across the
    block's kernel pages), first row, row count. Row columns: base byte
    address, block stride (bytes), slot stride (units), run (units), slots
    the row serves, block-local slot of its first one, unit (4: int32
    stores, 1: byte stores), a flag for rows that are 16-byte aligned with
    runs of whole 16-byte vectors (then stores are 16 bytes wide), and the
    slot step. The row serves slots ``row_first_slot + k * slot_step`` for
    ``k < n_slots``; the k-th one, in block ``b``, starts at ``base + b *
    block_stride + k * slot_stride * unit`` bytes.
    """
    n_whole = tl.load(work_ptr + 0).to(tl.int32)
    rows_whole = tl.load(work_ptr + 1).to(tl.int32)
    chunks_whole = tl.load(work_ptr + 2).to(tl.int32)
    n_tail = tl.load(work_ptr + 3).to(tl.int32)
    rows_tail = tl.load(work_ptr + 4).to(tl.int32)
    chunks_tail = tl.load(work_ptr + 5).to(tl.int32)
    total_whole = n_whole * rows_whole * chunks_whole
    total = total_whole + n_tail * rows_tail * chunks_tail
    lanes = tl.arange(0, BLOCK)
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        is_tail = w >= total_whole
        n = tl.where(is_tail, n_tail, n_whole)
        rows = tl.where(is_tail, rows_tail, rows_whole)
        local = tl.where(is_tail, w - total_whole, w)
        item = tl.where(is_tail, n_whole, 0) + local % n
        rest = local // n
        r = rest % rows
        chunk = rest // rows
        item_row = work_ptr + HEADER + item.to(tl.int64) * ITEM_COLS
        row_count = tl.load(item_row + 3)
        if r < row_count:
            block = tl.load(item_row + 0)
            first = tl.load(item_row + 1)
            row = rows_ptr + (tl.load(item_row + 2) + r) * ROW_COLS
            base = tl.load(row + 0)
            block_stride = tl.load(row + 1)
            slot_stride = tl.load(row + 2)
            run = tl.load(row + 3)
            n_slots = tl.load(row + 4)
            page_first = tl.load(row + 5)
            unit = tl.load(row + 6)
            vec = tl.load(row + 7)
            step = tl.load(row + 8)
            # First served slot at or past `first` (operands >= 0: floor = trunc).
            lo = tl.minimum((tl.maximum(first - page_first, 0) + step - 1) // step, n_slots)
            span = (n_slots - lo) * run
            start = chunk.to(tl.int64) * BLOCK
            if start < span:
                addr = base + block * block_stride
                if vec != 0:
                    # Aligned page, runs of whole vectors: st.global.v4.
                    p32 = tl.multiple_of(addr.to(tl.pointer_type(tl.int32)), 16)
                    p32 = p32 + tl.multiple_of(lo * run, 4)
                    e = tl.multiple_of(start, 4) + lanes
                    tl.store(p32 + e, tl.zeros([BLOCK], tl.int32), mask=e < tl.multiple_of(span, 4))
                else:
                    e = start + lanes
                    if slot_stride == run:
                        off = lo * run + e
                    else:
                        off = (lo + e // run) * slot_stride + e % run
                    if unit == 4:
                        ptr32 = addr.to(tl.pointer_type(tl.int32))
                        tl.store(ptr32 + off, tl.zeros([BLOCK], tl.int32), mask=e < span)
                    else:
                        ptr8 = addr.to(tl.pointer_type(tl.int8))
                        tl.store(ptr8 + off, tl.zeros([BLOCK], tl.int8), mask=e < span)
