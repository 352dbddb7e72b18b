"""A KV digest work unit's tiles (``@triton.jit`` only): its served slots and their keys, a
tile's terms, the prefetched walk of whole-block tiles, and served-slot counting."""

import triton
import triton.language as tl

from kvtail_connector.extras.ops.digest.loads import load_any, load_vectors, load_vectors_full
from kvtail_connector.extras.ops.digest.mix64 import POS_MUL, WORD_MUL, fmix64


@triton.jit
def slot_tile(
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
def tile_terms(
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
        mask, x = load_any(
            base, slot_off, ws, s_mask, n_words, run_bytes, mode, rw, SLOTS, WORDS, STREAM
        )
        term = fmix64(key ^ x.to(tl.uint32, bitcast=True).to(tl.uint64))
        out = tl.where(mask, term, 0)
    elif full:
        # A full tile (the usual case): no masks, no selects.
        x = load_vectors_full(base, slot_off, ws, STREAM)
        out = fmix64(key ^ x.to(tl.uint32, bitcast=True).to(tl.uint64))
    else:
        mask, x = load_vectors(base, slot_off, ws, s_mask, n_words, STREAM)
        term = fmix64(key ^ x.to(tl.uint32, bitcast=True).to(tl.uint64))
        out = tl.where(mask, term, 0)
    return out


@triton.jit
def unit_prefetched(
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
        x = load_vectors_full(base, slot_off, ws, STREAM)
    else:
        s_mask = (s_lanes >= k_lo) & (s_lanes < k_hi)
        _, x = load_vectors(base, slot_off, ws, s_mask, n_words, STREAM)
    return x


@triton.jit
def served_upto(t, eb, rank, ilv, turn, first, step, n_slots):
    """Served slots ``q`` of a row held by tokens below ``t`` of a request
    (``t`` a token bound, ``0 <= t``)."""
    i = t // eb
    off = t - i * eb
    # Local slots below block offset ``off`` (dcp_local_valid_slots).
    below = (off // turn) * ilv + tl.minimum(tl.maximum(off % turn - rank * ilv, 0), ilv)
    return i * n_slots + _served_before(below, first, step, n_slots)


@triton.jit
def _served_before(slot, first, step, n_slots):
    """Served slots of a row that precede block-local ``slot``."""
    ahead = tl.maximum(slot - first, 0)
    if step != 1:
        ahead = (ahead + step - 1) // step
    return tl.minimum(ahead, n_slots)
