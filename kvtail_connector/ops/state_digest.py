"""Digest of Mamba / linear-attention state blocks: ``mix64-state-1``.

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

The torch path below is vectorized over requests: per layer one gather of the
requests' pages and one pass of int64 arithmetic per state (states are a few
per layer; one launch sequence per step that has any).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtail_connector.ops.digest.reference import MASK64, WORD_MUL, fmix64
from kvtail_connector.ops.digest.torch_path import fmix64 as fmix64_torch

STATE_ALGORITHM = "mix64-state-1"
STATE_SEED = int.from_bytes(b"mix64-s1", "little")
_LOW32 = (1 << 32) - 1


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def state_plane(group: int, layer: int, state: int, shard: int) -> int:
    """``splane(g, l, s, r)`` of the definition (a Python int < 2**64)."""
    return fmix64(fmix64(fmix64(fmix64(STATE_SEED ^ group) ^ layer) ^ state) ^ shard)


@dataclass(frozen=True)
class StateLayer:
    """One layer's state pages.

    Attributes:
        pages: ``[num_blocks, page_bytes]`` uint8 view: block ``b``'s page.
        states: ``(offset, nbytes)`` of each state in a page, in spec order.
    """

    pages: torch.Tensor
    states: tuple[tuple[int, int], ...]


class StateDigester:
    """Digests requests' state blocks over the state groups of one rank.

    Args:
        groups: per state group, ``(group id, its layers in layer order)``.
        shard: this rank's TP rank (``r`` of the definition).

    Raises:
        ValueError: a state that does not fit its page, or layers on several devices.
    """

    def __init__(self, groups: Sequence[tuple[int, Sequence[StateLayer]]], shard: int) -> None:
        self.group_ids = tuple(g for g, _ in groups)
        self._layers = [list(layers) for _, layers in groups]
        devices = {layer.pages.device for layers in self._layers for layer in layers}
        if len(devices) > 1:
            raise ValueError(f"state pages on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        max_words = 1
        for layers in self._layers:
            for layer in layers:
                if layer.pages.dim() != 2 or layer.pages.dtype != torch.uint8:
                    raise ValueError("StateLayer.pages: expected a [blocks, bytes] uint8 view")
                for offset, nbytes in layer.states:
                    if offset < 0 or nbytes <= 0 or offset + nbytes > layer.pages.shape[1]:
                        raise ValueError(
                            f"state at byte {offset} of {nbytes} bytes does not fit a "
                            f"{layer.pages.shape[1]}-byte page"
                        )
                    max_words = max(max_words, -(-nbytes // 4))
        # Planes per (group, layer, state), as int64 bit patterns.
        self._planes = [
            [
                [_signed(state_plane(g, li, si, shard)) for si in range(len(layer.states))]
                for li, layer in enumerate(layers)
            ]
            for g, layers in zip(self.group_ids, self._layers, strict=True)
        ]
        self._word_keys = torch.arange(max_words, dtype=torch.int64, device=self.device) * _signed(
            WORD_MUL
        )

    def digest(self, blocks: Sequence[Sequence[int | None]]) -> torch.Tensor:
        """Per request (row) and group (column): the sum, int64 bit patterns,
        on the pages' device, enqueued on the current stream. ``blocks[i][j]``:
        request ``i``'s state block in group ``j``, or None (its cell is 0)."""
        out = torch.zeros((len(blocks), len(self.group_ids)), dtype=torch.int64, device=self.device)
        for j, layers in enumerate(self._layers):
            rows = [i for i, per in enumerate(blocks) if per[j] is not None]
            if not rows or not layers:
                continue
            index = torch.tensor([blocks[i][j] for i in rows], dtype=torch.int64)
            index = index.to(self.device)
            total = torch.zeros(len(rows), dtype=torch.int64, device=self.device)
            for li, layer in enumerate(layers):
                pages = layer.pages.index_select(0, index)
                for si, (offset, nbytes) in enumerate(layer.states):
                    words = _words(pages[:, offset : offset + nbytes])
                    key = self._planes[j][li][si] + self._word_keys[: words.shape[1]]
                    total += fmix64_torch(key[None, :] ^ words).sum(dim=1)
            out[torch.tensor(rows, dtype=torch.int64, device=self.device), j] = total
        return out


def _words(content: torch.Tensor) -> torch.Tensor:
    """int64 ``[n, ceil(bytes / 4)]``: little-endian uint32 words, the last
    one zero-filled above a partial run."""
    n, run = content.shape
    if run % 4 == 0 and content.is_contiguous() and content.storage_offset() % 4 == 0:
        padded = content
    else:
        padded = torch.zeros((n, -(-run // 4) * 4), dtype=torch.uint8, device=content.device)
        padded[:, :run] = content
    return padded.view(torch.int32).to(torch.int64) & _LOW32


def as_u64(value: int) -> int:
    """An int64 bit pattern as the u64 it stands for."""
    return value & MASK64
