"""Triton kernel of the state digest (``mix64-state-1``): ``@triton.jit`` only.

The definition is in ``ops/state_digest/reference.py``; the tables are
built by ``ops/state_digest/launcher.py``.
"""

import triton
import triton.language as tl

from kvtail_connector.extras.ops.digest.mix64 import WORD_MUL, fmix64

# Table layouts (must match ops/state_digest/launcher.py).
ROW_COLS: tl.constexpr = tl.constexpr(4)
UNIT_COLS: tl.constexpr = tl.constexpr(8)
# Unit load modes (launcher.py).
MODE_BYTES: tl.constexpr = tl.constexpr(0)
MODE_WORDS: tl.constexpr = tl.constexpr(1)
MODE_VECTORS: tl.constexpr = tl.constexpr(2)


@triton.jit
def state_digest_kernel(
    rows_ptr,  # int64 [n_rows, ROW_COLS]: this call's (request, group) cells
    units_ptr,  # int64 [n_units, UNIT_COLS]: every group's state chunks (built once)
    out_ptr,  # int64 output cells, zeroed
    BLOCK: tl.constexpr,  # words of one tile
):
    """Add the mix64-state-1 terms of each row's state chunks to its cell.

    Program ``(r, p)`` takes row ``r`` (block id, output cell, first unit,
    unit count: its group's units) and units ``p, p + P, ...`` of it (``P``
    programs per row); it sums their terms in registers and adds the sum to
    the cell once, atomically (programs of a cell run in any order; uint64
    addition wraps as int64 addition does).

    Unit (one chunk of one state of one layer): address of the state in
    block 0, page stride (bytes), first and end word of the chunk, the
    state's bytes, its plane ``splane(g, l, s, r)`` (int64 bits), load mode
    (0: bytes, 1: words, 2: words of a 16-byte aligned state and stride).
    Word ``w`` (bytes ``[4w, 4w + 4)``, a partial last word zero-filled
    above) adds ``fmix64((plane + w * WORD_MUL) ^ x)``; each word is read
    once.
    """
    row = rows_ptr + tl.program_id(0).to(tl.int64) * ROW_COLS
    block = tl.load(row + 0)
    cell = tl.load(row + 1)
    first = tl.load(row + 2)
    n_units = tl.load(row + 3).to(tl.int32)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    for u in range(tl.program_id(1), n_units, tl.num_programs(1)):
        unit = units_ptr + (first + u) * UNIT_COLS
        state = tl.load(unit + 0) + block * tl.load(unit + 1)
        w_lo = tl.load(unit + 2).to(tl.int32)
        w_hi = tl.load(unit + 3).to(tl.int32)
        nbytes = tl.load(unit + 4)
        plane = tl.load(unit + 5).to(tl.uint64, bitcast=True)
        mode = tl.load(unit + 6).to(tl.int32)
        n_full = (nbytes // 4).to(tl.int32)
        n = tl.maximum(tl.minimum(w_hi, n_full) - w_lo, 0)  # whole words in the chunk
        chunk = state + w_lo.to(tl.int64) * 4
        key = plane + w_lo.to(tl.uint64) * WORD_MUL
        tiled = (n // BLOCK) * BLOCK
        for off in range(0, tiled, BLOCK):
            idx = off + lanes
            x = _load_tile(chunk, idx, idx, mode, False)
            acc += fmix64((key + idx.to(tl.uint64) * WORD_MUL) ^ x.to(tl.uint64))
        if tiled < n:
            idx = tiled + lanes
            mask = idx < n
            x = _load_tile(chunk, idx, mask, mode, True)
            term = fmix64((key + idx.to(tl.uint64) * WORD_MUL) ^ x.to(tl.uint64))
            acc += tl.where(mask, term, 0)
        if w_hi > n_full:
            # The chunk ends in the state's partial last word: 1-3 bytes, low.
            j = tl.arange(0, 4)
            p8 = (state + n_full.to(tl.int64) * 4).to(tl.pointer_type(tl.uint8))
            b = tl.load(p8 + j, mask=n_full.to(tl.int64) * 4 + j < nbytes, other=0)
            x = tl.sum(b.to(tl.uint64) << (8 * j).to(tl.uint64))
            term = fmix64((plane + n_full.to(tl.uint64) * WORD_MUL) ^ x)
            acc += tl.where(lanes == 0, term, 0)
    if tl.program_id(1) < n_units:
        tl.atomic_add(out_ptr + cell, tl.sum(acc).to(tl.int64, bitcast=True))


@triton.jit
def _load_tile(chunk, idx, mask, mode, MASKED: tl.constexpr):
    """uint32 words ``idx`` of a chunk (whole words only), 0 where masked
    (``mask`` is ignored unless ``MASKED``: full tiles load unmasked, so
    aligned ones vectorize)."""
    if mode == MODE_VECTORS:
        p32 = tl.multiple_of(chunk.to(tl.pointer_type(tl.uint32)), 16)
        if MASKED:
            x = tl.load(p32 + idx, mask=mask, other=0)
        else:
            x = tl.load(p32 + idx)
    elif mode == MODE_WORDS:
        p32 = chunk.to(tl.pointer_type(tl.uint32))
        if MASKED:
            x = tl.load(p32 + idx, mask=mask, other=0)
        else:
            x = tl.load(p32 + idx)
    else:
        p8 = chunk.to(tl.pointer_type(tl.uint8))
        x = tl.zeros_like(idx).to(tl.uint32)
        for b in tl.static_range(4):
            if MASKED:
                byte = tl.load(p8 + idx * 4 + b, mask=mask, other=0)
            else:
                byte = tl.load(p8 + idx * 4 + b)
            x = x | (byte.to(tl.uint32) << (8 * b))
    return x
