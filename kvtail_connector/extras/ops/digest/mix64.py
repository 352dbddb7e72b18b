"""``mix64-1`` in Triton: MurmurHash3's finalizer and the key multipliers (``@triton.jit``
only; the definition is ``ops/digest/reference.py``), shared by the KV and the state digest
kernels."""

import triton
import triton.language as tl

# mix64-1 constants (see ops/digest/reference.py).
POS_MUL: tl.constexpr = tl.constexpr(0x9E3779B97F4A7C15)
WORD_MUL: tl.constexpr = tl.constexpr(0xBF58476D1CE4E5B9)


@triton.jit
def fmix64(x):
    """MurmurHash3's 64-bit finalizer (a bijection of uint64)."""
    x = x ^ (x >> 33)
    x = x * 0xFF51AFD7ED558CCD
    x = x ^ (x >> 33)
    x = x * 0xC4CEB9FE1A85EC53
    x = x ^ (x >> 33)
    return x
