"""Triton kernel of the KV digest (``mix64-1``): ``@triton.jit`` only.

The hash is defined in ``ops/digest/reference.py``; the work buffer and row
table are built by ``ops/digest/plan.py``.
"""

import triton
import triton.language as tl

# Layout of the int64 work buffer and row table (must match ops/digest/plan.py).
HEADER: tl.constexpr = tl.constexpr(8)
KIND_COLS: tl.constexpr = tl.constexpr(8)
ITEM_COLS: tl.constexpr = tl.constexpr(8)
ROW_COLS: tl.constexpr = tl.constexpr(16)
# mix64-1 constants (see ops/digest/reference.py).
POS_MUL: tl.constexpr = tl.constexpr(0x9E3779B97F4A7C15)
WORD_MUL: tl.constexpr = tl.constexpr(0xBF58476D1CE4E5B9)
# Row load modes (ops/digest/plan.py).
MODE_BYTES: tl.constexpr = tl.constexpr(0)
MODE_WORDS: tl.constexpr = tl.constexpr(1)
MODE_VECTORS: tl.constexpr = tl.constexpr(2)


@triton.jit
def fmix64(x):
    """MurmurHash3's 64-bit finalizer (a bijection of uint64)."""
    x = x ^ (x >> 33)
    x = x * 0xFF51AFD7ED558CCD
    x = x ^ (x >> 33)
    x = x * 0xC4CEB9FE1A85EC53
    x = x ^ (x >> 33)
    return x


@triton.jit
def kv_digest_kernel(
    work_ptr,  # int64: HEADER, kinds, items, then the output cells (zeroed)
    rows_ptr,  # int64 [n_rows, ROW_COLS]
    SLOTS: tl.constexpr,  # slots of one tile
    WORDS: tl.constexpr,  # 32-bit words of one tile row
    ANY_MODE: tl.constexpr,  # some rows are not MODE_VECTORS (compiles their loads)
    DCP_SPLIT: tl.constexpr,  # some items have interleave > 1 and turn > interleave
):
    """Add the mix64-1 terms of every (item, row) pair to its output cell.

    Header: ``n_kinds, total_units, output offset`` (int64 index into the
    work buffer), padding. Kind ``k`` (one per cache group): ``first unit,
    n_items, n_rows, first item, first row, items per unit, item chunks``. A
    unit is one row and a chunk of consecutive items (chunk fastest); the
    kernel is persistent, each program striding over units. Items of a chunk
    that share an output cell are summed in registers, and the sum is added
    to the cell once (atomically: units of a cell run in any order).

    Item: manager block id, block-local slot range ``[klo, khi)`` (all in one
    token segment), ``pos_base``, DCP ``interleave`` and ``turn`` (interleave *
    DCP size; both 1 without DCP), output cell of head 0 and the cell stride
    between heads. Block-local slot ``s`` holds global token ``pos_base + (s //
    interleave) * turn + s % interleave``.

    Row (one region of one kernel page of a manager block, for one layer and
    local head): base byte address (block 0), block stride (bytes), slot
    stride (bytes, or words in word modes), content words, content bytes,
    block-local slot of the row's first served slot, slots served, page
    slots between served slots, word index of the row's first word in the
    slot's content, plane key (group, layer, global head), head index of its
    output cell, mode (0: byte loads, 1: word loads, 2: word loads 16-byte
    aligned), element bytes and element stride (bytes; byte mode only).

    Term of word ``w`` (uint32 ``x``, zero-extended; a partial last word
    holds its bytes little-endian, zeros above) of the slot of token ``t``:
    ``fmix64(((plane + t * POS_MUL + w * WORD_MUL) mod 2**64) ^ x)``.
    """
    n_kinds = tl.load(work_ptr + 0).to(tl.int32)
    total = tl.load(work_ptr + 1).to(tl.int32)
    out_ptr = work_ptr + tl.load(work_ptr + 2)
    items_ptr = work_ptr + HEADER + n_kinds * KIND_COLS
    s_lanes = tl.arange(0, SLOTS)
    w_lanes = tl.arange(0, WORDS)
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        kind = w * 0
        for k in range(1, n_kinds):
            kind = tl.where(w >= tl.load(work_ptr + HEADER + k * KIND_COLS), k, kind)
        kind_row = work_ptr + HEADER + kind * KIND_COLS
        local = w - tl.load(kind_row + 0).to(tl.int32)
        n_chunks = tl.load(kind_row + 6).to(tl.int32)
        per_unit = tl.load(kind_row + 5).to(tl.int32)
        items_end = tl.load(kind_row + 3).to(tl.int32) + tl.load(kind_row + 1).to(tl.int32)
        item_lo = tl.load(kind_row + 3).to(tl.int32) + (local % n_chunks) * per_unit
        item_hi = tl.minimum(item_lo + per_unit, items_end)
        rw = (
            rows_ptr
            + (tl.load(kind_row + 4).to(tl.int32) + local // n_chunks).to(tl.int64) * ROW_COLS
        )

        base = tl.load(rw + 0)
        block_stride = tl.load(rw + 1)
        slot_stride = tl.load(rw + 2).to(tl.int32)
        n_words = tl.load(rw + 3).to(tl.int32)
        run_bytes = tl.load(rw + 4).to(tl.int32)
        first = tl.load(rw + 5).to(tl.int32)
        n_slots = tl.load(rw + 6).to(tl.int32)
        step = tl.load(rw + 7).to(tl.int32)
        word_base = tl.load(rw + 8).to(tl.int32)
        plane = tl.load(rw + 9).to(tl.uint64, bitcast=True)
        out_head = tl.load(rw + 10)
        mode = tl.load(rw + 11).to(tl.int32)

        acc = tl.zeros([SLOTS, WORDS], dtype=tl.uint64)
        cell = tl.full([], -1, tl.int64)  # no cell yet
        for item in range(item_lo, item_hi):
            it = items_ptr + item * ITEM_COLS  # < 2**31: checked by the planner
            item_cell = tl.load(it + 6) + out_head * tl.load(it + 7)
            if item_cell != cell:
                if cell >= 0:
                    tl.atomic_add(out_ptr + cell, tl.sum(acc).to(tl.int64, bitcast=True))
                acc = tl.zeros([SLOTS, WORDS], dtype=tl.uint64)
                cell = item_cell
            # Served slots k of the row hold block-local slots first + k * step.
            k_lo = _served_before(tl.load(it + 1).to(tl.int32), first, step, n_slots)
            k_hi = _served_before(tl.load(it + 2).to(tl.int32), first, step, n_slots)
            addr = base + tl.load(it + 0) * block_stride
            pos_base = tl.load(it + 3)
            ilv = tl.load(it + 4).to(tl.int32)
            turn = tl.load(it + 5).to(tl.int32)
            for s0 in range(k_lo, k_hi, SLOTS):
                ks = s0 + s_lanes
                s_mask = ks < k_hi
                local_slot = first + ks * step
                if DCP_SPLIT:
                    t_in = (local_slot // ilv) * turn + local_slot % ilv
                else:
                    t_in = local_slot * turn
                slot_key = plane + (pos_base + t_in).to(tl.uint64) * POS_MUL
                for w0 in range(0, n_words, WORDS):
                    ws = w0 + w_lanes
                    if ANY_MODE:
                        mask, x = _load_any(
                            addr,
                            ks,
                            ws,
                            s_mask,
                            n_words,
                            slot_stride,
                            run_bytes,
                            mode,
                            rw,
                            SLOTS,
                            WORDS,
                        )
                        word_key = (word_base + ws).to(tl.uint64) * WORD_MUL
                        key = slot_key[:, None] + word_key[None, :]
                        term = fmix64(key ^ x.to(tl.uint32, bitcast=True).to(tl.uint64))
                        acc += tl.where(mask, term, 0)
                    elif s0 + SLOTS <= k_hi and w0 + WORDS <= n_words:
                        # A full tile (the usual case): no masks, no selects.
                        x = _load_vectors_full(rw, addr, ks, ws)
                        word_key = (word_base + ws).to(tl.uint64) * WORD_MUL
                        key = slot_key[:, None] + word_key[None, :]
                        acc += fmix64(key ^ x.to(tl.uint32, bitcast=True).to(tl.uint64))
                    else:
                        mask, x = _load_vectors(rw, addr, ks, ws, s_mask)
                        word_key = (word_base + ws).to(tl.uint64) * WORD_MUL
                        key = slot_key[:, None] + word_key[None, :]
                        term = fmix64(key ^ x.to(tl.uint32, bitcast=True).to(tl.uint64))
                        acc += tl.where(mask, term, 0)
        if cell >= 0:
            tl.atomic_add(out_ptr + cell, tl.sum(acc).to(tl.int64, bitcast=True))


@triton.jit
def _load_vectors(rw, addr, ks, ws, s_mask):
    """Words of a 16-byte aligned row of whole vectors: ld.global.v4.

    The hints are set on values loaded here: on a function argument they
    would be lost (and elsewhere they would also claim rows of other modes).
    """
    slot_stride = tl.multiple_of(tl.load(rw + 2).to(tl.int32), 4)
    n_words = tl.multiple_of(tl.load(rw + 3).to(tl.int32), 4)
    p32 = tl.multiple_of(addr.to(tl.pointer_type(tl.int32)), 16)
    mask = s_mask[:, None] & (ws < n_words)[None, :]
    return mask, tl.load(p32 + ks[:, None] * slot_stride + ws[None, :], mask=mask, other=0)


@triton.jit
def _load_vectors_full(rw, addr, ks, ws):
    """:func:`_load_vectors` of a tile whose slots and words are all valid."""
    slot_stride = tl.multiple_of(tl.load(rw + 2).to(tl.int32), 4)
    p32 = tl.multiple_of(addr.to(tl.pointer_type(tl.int32)), 16)
    return tl.load(p32 + ks[:, None] * slot_stride + ws[None, :])


@triton.jit
def _load_any(
    addr,
    ks,
    ws,
    s_mask,
    n_words,
    slot_stride,
    run_bytes,
    mode,
    rw,
    SLOTS: tl.constexpr,
    WORDS: tl.constexpr,
):
    """Words of a row in any mode (``slot_stride`` in the mode's units)."""
    mask = s_mask[:, None] & (ws < n_words)[None, :]
    if mode == MODE_VECTORS:
        _, x = _load_vectors(rw, addr, ks, ws, s_mask)
    elif mode == MODE_WORDS:
        p32 = addr.to(tl.pointer_type(tl.int32))
        x = tl.load(p32 + ks[:, None] * slot_stride + ws[None, :], mask=mask, other=0)
    else:
        x = _gather_words(addr, ks, ws, mask, slot_stride, run_bytes, rw, SLOTS, WORDS)
    return mask, x


@triton.jit
def _served_before(slot, first, step, n_slots):
    """Served slots of a row that precede block-local ``slot``."""
    ahead = tl.maximum(slot - first, 0)
    if step != 1:
        ahead = (ahead + step - 1) // step
    return tl.minimum(ahead, n_slots)


@triton.jit
def _gather_words(
    addr, ks, ws, mask, slot_stride, run_bytes, rw, SLOTS: tl.constexpr, WORDS: tl.constexpr
):
    """Words assembled from byte loads: unaligned rows, strided elements, and
    slots whose content is not a whole number of words (missing bytes are 0).

    Content byte ``j`` of a slot lives ``(j // elem) * elem_stride + j % elem``
    bytes into its run."""
    elem = tl.load(rw + 12).to(tl.int32)
    elem_stride = tl.load(rw + 13).to(tl.int32)
    p8 = addr.to(tl.pointer_type(tl.uint8))
    row_off = ks[:, None] * slot_stride
    x = tl.zeros([SLOTS, WORDS], dtype=tl.int32)
    for b in tl.static_range(4):
        j = ws * 4 + b
        off = (j // elem) * elem_stride + j % elem
        m = mask & (j < run_bytes)[None, :]
        byte = tl.load(p8 + row_off + off[None, :], mask=m, other=0)
        x = x | (byte.to(tl.int32) << (8 * b))
    return x
