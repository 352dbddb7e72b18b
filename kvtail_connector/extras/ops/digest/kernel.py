"""Triton kernel of the KV digest (``mix64-1``): ``@triton.jit`` only.

The hash is defined in ``ops/digest/reference.py`` (in Triton: ``mix64.py``);
the work buffer and row table are built by ``ops/digest/plan.py``. A unit's
tiles are ``tiles.py``, their loads ``loads.py``.
"""

import triton
import triton.language as tl

from kvtail_connector.extras.ops.digest.mix64 import POS_MUL, WORD_MUL
from kvtail_connector.extras.ops.digest.tiles import (
    served_upto,
    slot_tile,
    tile_terms,
    unit_prefetched,
)

# Layout of the int64 work buffer and row table (must match ops/digest/plan.py).
HEADER: tl.constexpr = tl.constexpr(8)
KIND_COLS: tl.constexpr = tl.constexpr(16)
REQ_COLS: tl.constexpr = tl.constexpr(8)
ROW_COLS: tl.constexpr = tl.constexpr(16)


@triton.jit
def kv_digest_kernel(
    work_ptr,  # int64: header, kinds, requests, block tables, output cells (zeroed)
    rows_ptr,  # int64 [n_rows, ROW_COLS]
    SLOTS: tl.constexpr,  # slots of one tile
    WORDS: tl.constexpr,  # 32-bit words of one tile row
    ANY_MODE: tl.constexpr,  # some rows are not MODE_VECTORS (compiles their loads)
    DCP_SPLIT: tl.constexpr,  # some group has interleave > 1 and turn > interleave
    WHOLE_SLOTS: tl.constexpr,  # every row's content fits in WORDS words
    STREAM: tl.constexpr,  # cache bytes loaded evict-first (read once)
    NUM_STAGES: tl.constexpr,  # software pipelining of the innermost tile loop
    PREFETCH: tl.constexpr,  # a tile's slots hold a block (vector rows): load the next tile early
):
    """Add the mix64-1 terms of every (chunk, row) unit to its output cell.

    Header: ``n_kinds, total units, output offset`` (int64 index into the
    work buffer), ``segment, chunk`` (tokens). Kind ``k`` (one per cache
    group): ``first unit, n_rows, first row, first request, n_requests,
    chunks, tokens per manager block eb, DCP rank, interleave, turn``
    (interleave * DCP size; without DCP ``0, 1, 1``). Request: ``table``
    (work index of the entry of manager block 0: block ``i`` is at ``table +
    i``), ``start, end`` (tokens), ``first chunk`` (in its kind), ``output
    cell`` of (head 0, segment 0), ``segments`` (the cell stride between
    heads), ``start // chunk``.

    A unit is one row and one chunk of one request (rows fastest); the kernel
    is persistent, each program striding over units. Unit ``u`` of a kind
    reads row ``u % n_rows`` of chunk ``c = u // n_rows``; the chunk's request
    is the last one whose first chunk is ``<= c`` (a binary search), and its
    tokens ``[lo, hi)`` are chunk ``start // chunk + c - first chunk`` cut to
    ``[start, end)``. Served slots are numbered ``q = i * n_slots + k`` (block
    ``i`` of the request, the row's ``k``-th served slot), in token order; the
    unit walks ``q`` from ``Q(lo)`` to ``Q(hi)`` (served slots of tokens
    below), block by block (``i = q // n_slots``, once per block, its id loaded
    one block ahead), in tiles of ``SLOTS`` slots by ``WORDS`` words, and adds
    its sum to its cell once (atomically: units of a cell run in any order). A
    chunk lies in one segment, so a unit has one cell. With ``PREFETCH`` (every
    row's block fits in ``SLOTS`` slots, 16-byte aligned rows) each tile is
    loaded before the one before it is hashed (:func:`unit_prefetched`).

    Row (one region of one kernel page of a manager block, for one layer and
    local head): base byte address (block 0), block stride, slot stride (both
    in words in the word modes, bytes in byte mode), content words, content
    bytes, block-local slot of the row's first served slot, slots served,
    page slots between served slots, word index of the row's first word in
    the slot's content, plane key (group, layer, global head), head index of
    its output cell, mode (0: byte loads, 1: word loads, 2: word loads
    16-byte aligned), element bytes and element stride (bytes; byte mode
    only). Block-local slot ``s`` holds token ``i * eb + rank * interleave +
    (s // interleave) * turn + s % interleave``.

    Term of word ``w`` (uint32 ``x``, zero-extended; a partial last word
    holds its bytes little-endian, zeros above) of the slot of token ``t``:
    ``fmix64(((plane + t * POS_MUL + w * WORD_MUL) mod 2**64) ^ x)``.
    """
    n_kinds = tl.load(work_ptr + 0).to(tl.int32)
    total = tl.load(work_ptr + 1).to(tl.int32)
    out_ptr = work_ptr + tl.load(work_ptr + 2)
    segment = tl.load(work_ptr + 3).to(tl.int32)
    chunk = tl.load(work_ptr + 4).to(tl.int32)
    reqs_ptr = work_ptr + HEADER + n_kinds * KIND_COLS
    s_lanes = tl.arange(0, SLOTS)
    w_lanes = tl.arange(0, WORDS)
    for u in range(tl.program_id(0), total, tl.num_programs(0)):
        kind = u * 0
        for k in range(1, n_kinds):
            kind = tl.where(u >= tl.load(work_ptr + HEADER + k * KIND_COLS), k, kind)
        kr = work_ptr + HEADER + kind * KIND_COLS
        local = u - tl.load(kr + 0).to(tl.int32)
        n_rows = tl.load(kr + 1).to(tl.int32)
        c = local // n_rows
        rw = rows_ptr + (tl.load(kr + 2).to(tl.int32) + local % n_rows).to(tl.int64) * ROW_COLS
        # The chunk's request: the last of the kind's whose first chunk <= c.
        r_lo = tl.load(kr + 3).to(tl.int32)
        r_hi = r_lo + tl.load(kr + 4).to(tl.int32)
        while r_hi - r_lo > 1:
            mid = (r_lo + r_hi) // 2
            below = tl.load(reqs_ptr + mid * REQ_COLS + 3).to(tl.int32) <= c
            r_lo = tl.where(below, mid, r_lo)
            r_hi = tl.where(below, r_hi, mid)
        rq = reqs_ptr + r_lo * REQ_COLS
        t0 = (tl.load(rq + 6).to(tl.int32) + c - tl.load(rq + 3).to(tl.int32)) * chunk
        t_lo = tl.maximum(tl.load(rq + 1).to(tl.int32), t0)
        t_hi = tl.minimum(tl.load(rq + 2).to(tl.int32), t0 + chunk)
        table = work_ptr + tl.load(rq + 0)
        cell = tl.load(rq + 4) + tl.load(rw + 10) * tl.load(rq + 5) + (t_lo // segment).to(tl.int64)

        eb = tl.load(kr + 6).to(tl.int32)
        rank = tl.load(kr + 7).to(tl.int32)
        ilv = tl.load(kr + 8).to(tl.int32)
        turn = tl.load(kr + 9).to(tl.int32)
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
        mode = tl.load(rw + 11).to(tl.int32)
        q_lo = served_upto(t_lo, eb, rank, ilv, turn, first, step, n_slots)
        q_hi = served_upto(t_hi, eb, rank, ilv, turn, first, step, n_slots)

        if PREFETCH:
            acc = unit_prefetched(
                base,
                table,
                q_lo,
                q_hi,
                n_slots,
                n_words,
                block_stride,
                slot_stride,
                first,
                step,
                eb,
                rank,
                ilv,
                turn,
                plane,
                word_base,
                s_lanes,
                w_lanes,
                SLOTS,
                WORDS,
                DCP_SPLIT,
                STREAM,
            )
        else:
            acc = tl.zeros([SLOTS, WORDS], dtype=tl.uint64)
            # Block by block (no per-slot division): the unit's blocks are
            # i_lo..i_last; each block's id is loaded one block ahead.
            i_lo = q_lo // n_slots
            # An empty unit walks no block (q_hi - 1 may be negative).
            i_last = tl.where(q_hi > q_lo, (q_hi - 1) // n_slots, i_lo - 1)
            blk = tl.load(table + i_lo, mask=q_hi > q_lo, other=0)
            word_key = (word_base + w_lanes).to(tl.uint64) * WORD_MUL
            for i in range(i_lo, i_last + 1):
                blk_next = tl.load(table + tl.minimum(i + 1, i_last))
                k_lo = tl.maximum(q_lo - i * n_slots, 0)
                k_hi = tl.minimum(q_hi - i * n_slots, n_slots)
                blk_off = blk * block_stride
                block_key = plane + (i * eb).to(tl.uint64) * POS_MUL
                if WHOLE_SLOTS:
                    # One word tile holds a slot's content: a single loop, pipelinable.
                    for k0 in tl.range(k_lo, k_hi, SLOTS, num_stages=NUM_STAGES):
                        s_mask, slot_key, slot_off = slot_tile(
                            k0,
                            s_lanes,
                            k_hi,
                            blk_off,
                            block_key,
                            rank,
                            ilv,
                            turn,
                            first,
                            step,
                            slot_stride,
                            DCP_SPLIT,
                        )
                        acc += tile_terms(
                            (k0 + SLOTS <= k_hi) & (n_words == WORDS),
                            base,
                            slot_off,
                            w_lanes,
                            s_mask,
                            slot_key[:, None] + word_key[None, :],
                            n_words,
                            run_bytes,
                            mode,
                            rw,
                            SLOTS,
                            WORDS,
                            ANY_MODE,
                            STREAM,
                        )
                else:
                    for k0 in range(k_lo, k_hi, SLOTS):
                        s_mask, slot_key, slot_off = slot_tile(
                            k0,
                            s_lanes,
                            k_hi,
                            blk_off,
                            block_key,
                            rank,
                            ilv,
                            turn,
                            first,
                            step,
                            slot_stride,
                            DCP_SPLIT,
                        )
                        for w0 in tl.range(0, n_words, WORDS, num_stages=NUM_STAGES):
                            ws = w0 + w_lanes
                            w_key = (word_base + ws).to(tl.uint64) * WORD_MUL
                            acc += tile_terms(
                                (k0 + SLOTS <= k_hi) & (w0 + WORDS <= n_words),
                                base,
                                slot_off,
                                ws,
                                s_mask,
                                slot_key[:, None] + w_key[None, :],
                                n_words,
                                run_bytes,
                                mode,
                                rw,
                                SLOTS,
                                WORDS,
                                ANY_MODE,
                                STREAM,
                            )
                blk = blk_next
        if q_hi > q_lo:
            tl.atomic_add(out_ptr + cell, tl.sum(acc).to(tl.int64, bitcast=True))
