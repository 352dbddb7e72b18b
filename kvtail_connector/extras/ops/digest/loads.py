"""How the KV digest kernel loads a tile of a row's 32-bit words, per row load mode
(``@triton.jit`` only; the modes are chosen by ``ops/digest/plan.py``)."""

import triton
import triton.language as tl

# Row load modes (ops/digest/plan.py).
MODE_BYTES: tl.constexpr = tl.constexpr(0)
MODE_WORDS: tl.constexpr = tl.constexpr(1)
MODE_VECTORS: tl.constexpr = tl.constexpr(2)


@triton.jit
def _load(ptrs, mask, STREAM: tl.constexpr):
    if STREAM:
        return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def load_vectors(base, slot_off, ws, s_mask, n_words, STREAM: tl.constexpr):
    """Words of a 16-byte aligned row of whole vectors: ld.global.v4.

    The hints are set here, on values of MODE_VECTORS rows only: elsewhere
    they would also claim rows of other modes.
    """
    p32 = tl.multiple_of(base.to(tl.pointer_type(tl.int32)), 16)
    off = tl.multiple_of(slot_off, 4)
    mask = s_mask[:, None] & (ws < n_words)[None, :]
    return mask, _load(p32 + off[:, None] + ws[None, :], mask, STREAM)


@triton.jit
def load_vectors_full(base, slot_off, ws, STREAM: tl.constexpr):
    """:func:`load_vectors` of a tile whose slots and words are all valid."""
    p32 = tl.multiple_of(base.to(tl.pointer_type(tl.int32)), 16)
    ptrs = p32 + tl.multiple_of(slot_off, 4)[:, None] + ws[None, :]
    if STREAM:
        return tl.load(ptrs, eviction_policy="evict_first")
    return tl.load(ptrs)


@triton.jit
def load_any(
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
        _, x = load_vectors(base, slot_off, ws, s_mask, n_words, STREAM)
    elif mode == MODE_WORDS:
        p32 = base.to(tl.pointer_type(tl.int32))
        x = _load(p32 + slot_off[:, None] + ws[None, :], mask, STREAM)
    else:
        x = _gather_words(base, slot_off, ws, mask, run_bytes, rw, SLOTS, WORDS)
    return mask, x


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
