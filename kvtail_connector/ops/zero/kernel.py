"""Triton kernel that zeroes KV slots of manager blocks: ``@triton.jit`` only."""

import triton
import triton.language as tl


@triton.jit
def zero_kv_slots_kernel(
    work_ptr,  # int64: HEADER_WORDS words, then [n_whole + n_tail, ITEM_COLS] items
    rows_ptr,  # int64 [n_rows, ROW_COLS]
    BLOCK: tl.constexpr,  # units (int32 words or bytes) one work unit stores
    # Column offsets and widths of both tables: ops/zero/work_schema.py, passed
    # by the launcher (kernel_columns()).
    HEADER_WORDS: tl.constexpr,
    HEADER_N_WHOLE: tl.constexpr,
    HEADER_ROWS_WHOLE: tl.constexpr,
    HEADER_CHUNKS_WHOLE: tl.constexpr,
    HEADER_N_TAIL: tl.constexpr,
    HEADER_ROWS_TAIL: tl.constexpr,
    HEADER_CHUNKS_TAIL: tl.constexpr,
    ITEM_COLS: tl.constexpr,
    ITEM_BLOCK: tl.constexpr,
    ITEM_FIRST_SLOT: tl.constexpr,
    ITEM_FIRST_ROW: tl.constexpr,
    ITEM_ROW_COUNT: tl.constexpr,
    ROW_COLS: tl.constexpr,
    ROW_BASE: tl.constexpr,
    ROW_BLOCK_STRIDE: tl.constexpr,
    ROW_SLOT_STRIDE: tl.constexpr,
    ROW_RUN: tl.constexpr,
    ROW_N_SLOTS: tl.constexpr,
    ROW_FIRST_SLOT: tl.constexpr,
    ROW_UNIT: tl.constexpr,
    ROW_VECTORIZED: tl.constexpr,
    ROW_SLOT_STEP: tl.constexpr,
):
    """Zero slots ``[first_slot, ...)`` of manager blocks in every row.

    The header counts whole-block items (first slot 0, they come first) and
    tails, with the most rows and chunks any item of each kind has. Work unit
    ``w`` of a kind is (item fastest, then row, then chunk): the kernel is
    persistent, each program striding over units, so the grid is a fixed
    size (the same launch replays from a CUDA graph) and no program is spent
    on rows or chunks an item does not have.

    An item names a block, its first slot to zero (block-local, across the
    block's kernel pages) and a range of rows. A row serves slots
    ``first_slot + k * slot_step`` for ``k < n_slots``; the k-th one, in block
    ``b``, starts at ``base + b * block_stride + k * slot_stride * unit``
    bytes and spans ``run`` units (4: int32 stores, 1: byte stores). Rows
    flagged vectorized are 16-byte aligned with runs of whole 16-byte
    vectors: their stores are 16 bytes wide.
    """
    n_whole = tl.load(work_ptr + HEADER_N_WHOLE).to(tl.int32)
    rows_whole = tl.load(work_ptr + HEADER_ROWS_WHOLE).to(tl.int32)
    chunks_whole = tl.load(work_ptr + HEADER_CHUNKS_WHOLE).to(tl.int32)
    n_tail = tl.load(work_ptr + HEADER_N_TAIL).to(tl.int32)
    rows_tail = tl.load(work_ptr + HEADER_ROWS_TAIL).to(tl.int32)
    chunks_tail = tl.load(work_ptr + HEADER_CHUNKS_TAIL).to(tl.int32)
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
        item_row = work_ptr + HEADER_WORDS + item.to(tl.int64) * ITEM_COLS
        row_count = tl.load(item_row + ITEM_ROW_COUNT)
        if r < row_count:
            block = tl.load(item_row + ITEM_BLOCK)
            first = tl.load(item_row + ITEM_FIRST_SLOT)
            row = rows_ptr + (tl.load(item_row + ITEM_FIRST_ROW) + r) * ROW_COLS
            base = tl.load(row + ROW_BASE)
            block_stride = tl.load(row + ROW_BLOCK_STRIDE)
            slot_stride = tl.load(row + ROW_SLOT_STRIDE)
            run = tl.load(row + ROW_RUN)
            n_slots = tl.load(row + ROW_N_SLOTS)
            page_first = tl.load(row + ROW_FIRST_SLOT)
            unit = tl.load(row + ROW_UNIT)
            vec = tl.load(row + ROW_VECTORIZED)
            step = tl.load(row + ROW_SLOT_STEP)
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
