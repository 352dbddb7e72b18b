"""Digest of Mamba / linear-attention state blocks: the contract of ``mix64-state-1``.

A state group (vLLM's ``MambaSpec``: Mamba1/2 conv and SSM states, GDN conv
and recurrent states) holds one state per request, not one slot per token:
the block vLLM's transfer sends holds the state after the prompt. Its digest
is one u64 per (group, TP shard), keyed by logical coordinates only, so the
block ids (which differ between producer and consumer) do not change it.

Definition (all arithmetic modulo 2**64; ``fmix64`` and ``WORD_MUL`` as in
``ops/digest/reference.py``)::

    splane(g, l, s, r) = fmix64(fmix64(fmix64(fmix64(STATE_SEED ^ g) ^ l) ^ s) ^ r)
    term = fmix64((splane(g, l, s, r) + w * WORD_MUL) ^ x)
    sum[g][r] = sum of term over the layers l of group g, the states s of
                each layer and the words w of each state's bytes

- ``g``: the KV cache group id; ``l``: the layer's index in the group's
  layer list; ``s``: the state's index in the layer's ``MambaSpec.shapes``;
  ``r``: the TP rank holding the shard (shards compare rank by rank).
- A state's bytes: ``prod(shape) * itemsize`` bytes at its offset in the
  block's page (states packed in spec order from offset 0, as vLLM's
  ``MambaBase.bind_kv_cache`` lays them out; page padding is not digested).
- Word ``w``: the little-endian uint32 of bytes ``[4w, 4w + 4)`` of the
  state; a partial last word holds its 1-3 bytes low, zeros above.

Producers and consumers of any version must agree on these sums bit for bit:
the kernel (``kernel.py``) and the torch path (``torch_path.py``) implement
this; ``tests/ops/test_state_digest.py`` holds an independent reference.
"""

from __future__ import annotations

from kvtail_connector.extras.ops.digest.reference import MASK64, WORD_MUL, fmix64

__all__ = ["STATE_ALGORITHM", "STATE_SEED", "WORD_MUL", "as_u64", "signed", "state_plane"]

STATE_ALGORITHM = "mix64-state-1"
STATE_SEED = int.from_bytes(b"mix64-s1", "little")


def state_plane(group: int, layer: int, state: int, shard: int) -> int:
    """``splane(g, l, s, r)`` of the definition (a Python int < 2**64)."""
    return fmix64(fmix64(fmix64(fmix64(STATE_SEED ^ group) ^ layer) ^ state) ^ shard)


def signed(x: int) -> int:
    """A u64 as the int64 with the same bits (how tensors hold it)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def as_u64(value: int) -> int:
    """An int64 bit pattern as the u64 it stands for."""
    return value & MASK64
