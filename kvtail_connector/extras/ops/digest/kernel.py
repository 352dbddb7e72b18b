"""Triton kernel of the KV digest (``mix64-1``): ``@triton.jit`` only.

The hash is defined in ``ops/digest/reference.py``; the work buffer and row
table are built by ``ops/digest/plan.py``.
"""

import triton
import triton.language as tl

# Layout of the int64 work buffer and row table (must match ops/digest/plan.py).
HEADER: tl.constexpr = tl.constexpr(8)
KIND_COLS: tl.constexpr = tl.constexpr(16)
REQ_COLS: tl.constexpr = tl.constexpr(8)
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
    loaded before the one before it is hashed (:func:`_unit_prefetched`).

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
        q_lo = _served_upto(t_lo, eb, rank, ilv, turn, first, step, n_slots)
        q_hi = _served_upto(t_hi, eb, rank, ilv, turn, first, step, n_slots)

        if PREFETCH:
            acc = _unit_prefetched(
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
                        s_mask, slot_key, slot_off = _slot_tile(
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
                        acc += _tile_terms(
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
                        s_mask, slot_key, slot_off = _slot_tile(
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
                            acc += _tile_terms(
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


@triton.jit
def _slot_tile(
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
    DCP_SPLIT: tl.constexpr,
):
    """Served slots ``k0 + s_lanes`` of one block of a unit: their mask, key
    base ``plane + t * POS_MUL`` (``block_key`` is the block's first token's)
    and offsets from the row's base (load units)."""
    ks = k0 + s_lanes
    s_mask = ks < k_hi
    local_slot = first + ks * step
    if DCP_SPLIT:
        t_in = rank * ilv + (local_slot // ilv) * turn + local_slot % ilv
    else:
        t_in = rank + local_slot * turn
    slot_key = block_key + t_in.to(tl.uint64) * POS_MUL
    slot_off = blk_off + ks.to(tl.int64) * slot_stride
    return s_mask, slot_key, slot_off


@triton.jit
def _tile_terms(
    full,
    base,
    slot_off,
    ws,
    s_mask,
    key,
    n_words,
    run_bytes,
    mode,
    rw,
    SLOTS: tl.constexpr,
    WORDS: tl.constexpr,
    ANY_MODE: tl.constexpr,
    STREAM: tl.constexpr,
):
    """The tile's terms (0 outside the row's slots and words)."""
    if ANY_MODE:
        mask, x = _load_any(
            base, slot_off, ws, s_mask, n_words, run_bytes, mode, rw, SLOTS, WORDS, STREAM
        )
        term = fmix64(key ^ x.to(tl.uint32, bitcast=True).to(tl.uint64))
        out = tl.where(mask, term, 0)
    elif full:
        # A full tile (the usual case): no masks, no selects.
        x = _load_vectors_full(base, slot_off, ws, STREAM)
        out = fmix64(key ^ x.to(tl.uint32, bitcast=True).to(tl.uint64))
    else:
        mask, x = _load_vectors(base, slot_off, ws, s_mask, n_words, STREAM)
        term = fmix64(key ^ x.to(tl.uint32, bitcast=True).to(tl.uint64))
        out = tl.where(mask, term, 0)
    return out


@triton.jit
def _unit_prefetched(
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
    SLOTS: tl.constexpr,
    WORDS: tl.constexpr,
    DCP_SPLIT: tl.constexpr,
    STREAM: tl.constexpr,
):
    """A unit's sum where one tile's slots hold a whole block of the row
    (``n_slots <= SLOTS``, 16-byte aligned vector rows): lane ``k`` is served
    slot ``k`` of every block; the tiles are (block, word tile) in order, and
    each is loaded before the one before it is hashed (twice the bytes in
    flight a program)."""
    local_slot = first + s_lanes * step
    if DCP_SPLIT:
        t_in = rank * ilv + (local_slot // ilv) * turn + local_slot % ilv
    else:
        t_in = rank + local_slot * turn
    lane_key = t_in.to(tl.uint64) * POS_MUL
    lane_off = s_lanes.to(tl.int64) * slot_stride
    word_key = (word_base + w_lanes).to(tl.uint64) * WORD_MUL
    n_wt = (n_words + WORDS - 1) // WORDS
    some = q_hi > q_lo
    i_lo = q_lo // n_slots
    # An empty unit walks no block (q_hi - 1 may be negative).
    i_last = tl.where(some, (q_hi - 1) // n_slots, i_lo - 1)
    blk = tl.load(table + i_lo, mask=some, other=0)
    blk_next = tl.load(table + tl.minimum(i_lo + 1, i_last), mask=some, other=0)
    k_lo = tl.maximum(q_lo - i_lo * n_slots, 0)
    k_hi = tl.minimum(q_hi - i_lo * n_slots, n_slots)
    x = _block_tile(
        base,
        blk * block_stride + lane_off,
        0,
        s_lanes,
        k_lo,
        k_hi,
        n_words,
        SLOTS,
        WORDS,
        STREAM,
    )
    acc = tl.zeros([SLOTS, WORDS], dtype=tl.uint64)
    for i in range(i_lo, i_last + 1):
        blk_after = tl.load(table + tl.minimum(i + 2, i_last))
        k_lo = tl.maximum(q_lo - i * n_slots, 0)
        k_hi = tl.minimum(q_hi - i * n_slots, n_slots)
        n_hi = tl.minimum(q_hi - (i + 1) * n_slots, n_slots)  # block i + 1's
        slot_key = plane + (i * eb).to(tl.uint64) * POS_MUL + lane_key
        for wt in range(0, n_wt):
            w0 = wt * WORDS
            # The next tile, loaded before this one is hashed.
            if wt + 1 < n_wt:
                x_next = _block_tile(
                    base,
                    blk * block_stride + lane_off,
                    w0 + WORDS,
                    s_lanes,
                    k_lo,
                    k_hi,
                    n_words,
                    SLOTS,
                    WORDS,
                    STREAM,
                )
            elif i + 1 <= i_last:
                x_next = _block_tile(
                    base,
                    blk_next * block_stride + lane_off,
                    0,
                    s_lanes,
                    n_hi * 0,
                    n_hi,
                    n_words,
                    SLOTS,
                    WORDS,
                    STREAM,
                )
            else:
                x_next = x
            tile_key = slot_key + (w0.to(tl.uint64) * WORD_MUL)
            key = tile_key[:, None] + word_key[None, :]
            term = fmix64(key ^ x.to(tl.uint32, bitcast=True).to(tl.uint64))
            if (k_lo == 0) & (k_hi == SLOTS) & (w0 + WORDS <= n_words):
                acc += term
            else:
                s_mask = (s_lanes >= k_lo) & (s_lanes < k_hi)
                mask = s_mask[:, None] & (w0 + w_lanes < n_words)[None, :]
                acc += tl.where(mask, term, 0)
            x = x_next
        blk = blk_next
        blk_next = blk_after
    return acc


@triton.jit
def _block_tile(
    base,
    slot_off,
    w0,
    s_lanes,
    k_lo,
    k_hi,
    n_words,
    SLOTS: tl.constexpr,
    WORDS: tl.constexpr,
    STREAM: tl.constexpr,
):
    """Words ``[w0, w0 + WORDS)`` of served slots ``[k_lo, k_hi)`` of one
    block (lanes ``k``; 0 elsewhere); unmasked when the tile is all valid."""
    ws = w0 + tl.arange(0, WORDS)
    if (k_lo == 0) & (k_hi == SLOTS) & (w0 + WORDS <= n_words):
        x = _load_vectors_full(base, slot_off, ws, STREAM)
    else:
        s_mask = (s_lanes >= k_lo) & (s_lanes < k_hi)
        _, x = _load_vectors(base, slot_off, ws, s_mask, n_words, STREAM)
    return x


@triton.jit
def _served_upto(t, eb, rank, ilv, turn, first, step, n_slots):
    """Served slots ``q`` of a row held by tokens below ``t`` of a request
    (``t`` a token bound, ``0 <= t``)."""
    i = t // eb
    off = t - i * eb
    # Local slots below block offset ``off`` (dcp_local_valid_slots).
    below = (off // turn) * ilv + tl.minimum(tl.maximum(off % turn - rank * ilv, 0), ilv)
    return i * n_slots + _served_before(below, first, step, n_slots)


@triton.jit
def _load(ptrs, mask, STREAM: tl.constexpr):
    if STREAM:
        return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _load_vectors(base, slot_off, ws, s_mask, n_words, STREAM: tl.constexpr):
    """Words of a 16-byte aligned row of whole vectors: ld.global.v4.

    The hints are set here, on values of MODE_VECTORS rows only: elsewhere
    they would also claim rows of other modes.
    """
    p32 = tl.multiple_of(base.to(tl.pointer_type(tl.int32)), 16)
    off = tl.multiple_of(slot_off, 4)
    mask = s_mask[:, None] & (ws < n_words)[None, :]
    return mask, _load(p32 + off[:, None] + ws[None, :], mask, STREAM)


@triton.jit
def _load_vectors_full(base, slot_off, ws, STREAM: tl.constexpr):
    """:func:`_load_vectors` of a tile whose slots and words are all valid."""
    p32 = tl.multiple_of(base.to(tl.pointer_type(tl.int32)), 16)
    ptrs = p32 + tl.multiple_of(slot_off, 4)[:, None] + ws[None, :]
    if STREAM:
        return tl.load(ptrs, eviction_policy="evict_first")
    return tl.load(ptrs)


@triton.jit
def _load_any(
    base,
    slot_off,
    ws,
    s_mask,
    n_words,
    run_bytes,
    mode,
    rw,
    SLOTS: tl.constexpr,
    WORDS: tl.constexpr,
    STREAM: tl.constexpr,
):
    """Words of a row in any mode (``slot_off`` in the mode's units)."""
    mask = s_mask[:, None] & (ws < n_words)[None, :]
    if mode == MODE_VECTORS:
        _, x = _load_vectors(base, slot_off, ws, s_mask, n_words, STREAM)
    elif mode == MODE_WORDS:
        p32 = base.to(tl.pointer_type(tl.int32))
        x = _load(p32 + slot_off[:, None] + ws[None, :], mask, STREAM)
    else:
        x = _gather_words(base, slot_off, ws, mask, run_bytes, rw, SLOTS, WORDS)
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
    base, slot_off, ws, mask, run_bytes, rw, SLOTS: tl.constexpr, WORDS: tl.constexpr
):
    """Words assembled from byte loads: unaligned rows, strided elements, and
    slots whose content is not a whole number of words (missing bytes are 0).

    Content byte ``j`` of a slot lives ``(j // elem) * elem_stride + j % elem``
    bytes into its run."""
    elem = tl.load(rw + 12).to(tl.int32)
    elem_stride = tl.load(rw + 13).to(tl.int32)
    p8 = base.to(tl.pointer_type(tl.uint8))
    x = tl.zeros([SLOTS, WORDS], dtype=tl.int32)
    for b in tl.static_range(4):
        j = ws * 4 + b
        off = (j // elem) * elem_stride + j % elem
        m = mask & (j < run_bytes)[None, :]
        byte = tl.load(p8 + slot_off[:, None] + off[None, :], mask=m, other=0)
        x = x | (byte.to(tl.int32) << (8 * b))
    return x
