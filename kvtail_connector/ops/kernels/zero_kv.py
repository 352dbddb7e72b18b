"""Triton kernel that zeroes KV slots of manager blocks: ``@triton.jit`` only."""

import triton
import triton.language as tl

# Widths of the int64 item and row tables; the column order is documented in
# the kernel docstring and built by ops/launcher.py.
ITEM_COLS: tl.constexpr = tl.constexpr(4)
ROW_COLS: tl.constexpr = tl.constexpr(8)


@triton.jit(do_not_specialize=["n_items"])
def zero_kv_slots_kernel(
    # Pointers
    items_ptr,  # int64 [n_items, ITEM_COLS]: block id, first slot, row start, row count
    rows_ptr,  # int64 [n_rows, ROW_COLS]: see the docstring
    # Sizes
    n_items,
    # Meta-parameters
    BLOCK: tl.constexpr,  # units (int32 words or bytes) stored per iteration
):
    """Zero slots ``[first_slot, ...)`` of manager blocks in every row.

    Item columns: block id, first slot to zero (block-local, across the
    block's kernel pages), first row, row count. Row columns: base byte
    address, block stride (bytes), slot stride (units), run (units), slots
    per page, block-local slot of the page's slot 0, unit (4 or 1), unused.

    Grid ``(G0, G1, G2)``: axis 0 strides over items, axis 1 over an item's
    rows, axis 2 over BLOCK-sized chunks of one row's span; every axis loops,
    so the grid is bounded whatever the sizes.

    A row is one region of one kernel page: slot ``s`` of block ``b`` starts
    at ``base + b * block_stride + (s - row_first_slot) * slot_stride`` bytes
    and is ``run`` bytes long. ``unit`` is 4 for rows whose addresses and
    widths are word-aligned (int32 stores) and 1 otherwise (byte stores);
    slot strides and runs are stored in those units.
    """
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    pid2 = tl.program_id(2)
    g0 = tl.num_programs(0)
    g1 = tl.num_programs(1)
    g2 = tl.num_programs(2)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    for item in range(pid0, n_items, g0):
        item_row = items_ptr + item * ITEM_COLS
        block = tl.load(item_row + 0)
        first = tl.load(item_row + 1)
        row_start = tl.load(item_row + 2)
        row_count = tl.load(item_row + 3)
        for r in range(pid1, row_count, g1):
            row = rows_ptr + (row_start + r) * ROW_COLS
            base = tl.load(row + 0)
            block_stride = tl.load(row + 1)
            slot_stride = tl.load(row + 2)
            run = tl.load(row + 3)
            n_slots = tl.load(row + 4)
            page_first = tl.load(row + 5)
            unit = tl.load(row + 6)
            lo = tl.minimum(tl.maximum(first - page_first, 0), n_slots)
            span = (n_slots - lo) * run
            addr = base + block * block_stride
            flat = slot_stride == run
            for start in range(pid2.to(tl.int64) * BLOCK, span, g2.to(tl.int64) * BLOCK):
                e = start + lanes
                mask = e < span
                if flat:
                    off = lo * run + e
                else:
                    off = (lo + e // run) * slot_stride + e % run
                if unit == 4:
                    ptr32 = addr.to(tl.pointer_type(tl.int32))
                    tl.store(ptr32 + off, tl.zeros([BLOCK], tl.int32), mask=mask)
                else:
                    ptr8 = addr.to(tl.pointer_type(tl.int8))
                    tl.store(ptr8 + off, tl.zeros([BLOCK], tl.int8), mask=mask)
