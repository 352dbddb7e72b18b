"""Reference of the KV digest: the contract of ``mix64-1``, written plainly.

Slow on purpose (Python loops over tokens, layers, heads and words, Python
integers for the arithmetic) and independent of the planner, the kernel and
the torch path; tests compare those against it.

Definition (algorithm ``mix64-1``; all arithmetic modulo 2**64)::

    fmix64(x)  = MurmurHash3 finalizer: x ^= x >> 33; x *= 0xFF51AFD7ED558CCD;
                 x ^= x >> 33; x *= 0xC4CEB9FE1A85EC53; x ^= x >> 33
    plane(g, l, h) = fmix64(fmix64(fmix64(SEED ^ g) ^ l) ^ h)
    key(g, l, h, t, w) = plane(g, l, h) + t * POS_MUL + w * WORD_MUL
    term = fmix64(key ^ x)
    sum[g][h][s] = sum of term over the layers l of group g and the words w
                   of every valid token t with t // seg == s that this rank
                   holds, for global KV head h

- ``g``: the cache group id; ``l``: the layer's index in the group's cache
  list; ``h``: the global KV head (``head_offset`` + local head); ``t``: the
  global token position; ``w``: the 32-bit word index in the slot's content.
- Content of a ``[B, H, N, C]`` view's slot for head ``h``: the ``C``
  elements ``view[page, h, slot, :]`` in order, each element's bytes as
  stored (little-endian). K and V are part of ``C`` in vLLM's views.
- Content of a :class:`RegionCache` slot: its local head is 0 (its global
  head ``h`` is ``head_offset``, whatever KV heads its pages hold; the
  connector's TP keying of it: ``extras/kv_verification/rank_digests.py``),
  and each region that serves the slot contributes its run of bytes; region
  ``r``'s words are numbered from ``sum(ceil(slot_bytes(r') / 4) for r' < r)``.
- Word ``w`` of a run is the little-endian uint32 of bytes ``[4w, 4w + 4)``;
  a run whose length is not a multiple of 4 ends in a partial word holding
  its last 1-3 bytes in the low bytes and zeros above (sub-word slots are
  one partial word).
- Placement: the manager block ``i`` of a request covers tokens ``[i * eb,
  (i + 1) * eb)`` with ``eb = pages_per_block * N * dcp_world_size``; token
  offset ``o = t - i * eb`` is held by DCP rank ``(o // I) % W`` at local slot
  ``(o // (I * W)) * I + o % I``, i.e. page ``block * P + slot // N``, page
  slot ``slot % N``.

The key uses logical coordinates only, so block ids, block size, the
kernel-page split, the page layout and the rank placement do not change the
sums; a rank's per-head sums add up across ranks to the single-rank sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtail_connector.ops.geometry import PageRegion, RegionCache

ALGORITHM = "mix64-1"
MASK64 = (1 << 64) - 1
SEED = int.from_bytes(b"mix64-1\0", "little")
POS_MUL = 0x9E3779B97F4A7C15
WORD_MUL = 0xBF58476D1CE4E5B9


def fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK64
    x ^= x >> 33
    return x


def plane_key(group: int, layer: int, head: int) -> int:
    return fmix64(fmix64(fmix64(SEED ^ group) ^ layer) ^ head)


def word_terms(key_base: int, data: bytes, first_word: int) -> int:
    """Sum of the terms of the words of ``data`` (``key_base = plane + t *
    POS_MUL``), numbered from ``first_word``."""
    total = 0
    for i in range(0, len(data), 4):
        x = int.from_bytes(data[i : i + 4], "little")  # short tail: zeros above
        key = (key_base + (first_word + i // 4) * WORD_MUL) & MASK64
        total += fmix64(key ^ x)
    return total & MASK64


def _region_served(region: PageRegion, n: int, page_slot: int) -> int | None:
    """Index among the region's served slots of ``page_slot``, or None."""
    first, step = region.first_slot, region.slot_step
    if page_slot < first or (page_slot - first) % step:
        return None
    k = (page_slot - first) // step
    limit = -(-(n - first) // step) if region.n_slots is None else region.n_slots
    return k if k < limit else None


def _region_slot_terms(cache: RegionCache, page: int, slot: int, key_base: int) -> int:
    t = cache.tensor
    el = t.element_size()
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).cpu()
    page_start = (t.storage_offset() + page * t.stride(0)) * el
    total, first_word = 0, 0
    for region in cache.regions:
        k = _region_served(region, cache.slots_per_page, slot)
        if k is not None:
            stride = region.slot_bytes if region.slot_stride is None else region.slot_stride
            start = page_start + region.offset + k * stride
            data = bytes(raw[start : start + region.slot_bytes].tolist())
            total += word_terms(key_base, data, first_word)
        first_word += -(-region.slot_bytes // 4)
    return total & MASK64


def _view_slot_bytes(view: torch.Tensor, page: int, head: int, slot: int) -> bytes:
    elements = view[page, head, slot, :].cpu().contiguous()
    return bytes(elements.view(torch.uint8).tolist())


def reference_digest(
    groups: Sequence[dict[str, Any]],
    requests: Sequence[Sequence[tuple[Sequence[int], int, int] | None]],
    segment: int = 1024,
) -> list[list[dict[int, list[int]] | None]]:
    """Per request and group: ``{global head: [sum of segment s for s in
    range(ceil(end / segment))]}``, or None where the request skips the group.

    Args:
        groups: per group, a dict with ``caches`` (per layer, in layer order)
            and optionally ``group_id`` (default: its index),
            ``pages_per_block`` (1), ``head_offset`` (0), ``counted_heads``
            (None: all), ``dcp_rank`` (0), ``dcp_world_size`` (1) and
            ``interleave`` (1).
        requests: per request, per group ``(block_ids, start, end)`` (tokens
            ``[start, end)``) or None.
        segment: tokens per segment.
    """
    out: list[list[dict[int, list[int]] | None]] = []
    for request in requests:
        per_group: list[dict[int, list[int]] | None] = []
        for index, (spec, span) in enumerate(zip(groups, request, strict=True)):
            per_group.append(None if span is None else _group_sums(index, spec, span, segment))
        out.append(per_group)
    return out


def _heads_of(cache: torch.Tensor | RegionCache) -> int:
    return 1 if isinstance(cache, RegionCache) else int(cache.shape[1])


def _group_sums(
    index: int, spec: dict[str, Any], span: tuple[Sequence[int], int, int], segment: int
) -> dict[int, list[int]]:
    caches = spec["caches"]
    g = spec.get("group_id", index)
    p = spec.get("pages_per_block", 1)
    head_offset = spec.get("head_offset", 0)
    rank = spec.get("dcp_rank", 0)
    world = spec.get("dcp_world_size", 1)
    ilv = spec.get("interleave", 1)
    n = caches[0].slots_per_page if isinstance(caches[0], RegionCache) else caches[0].shape[2]
    local_heads = max(_heads_of(c) for c in caches)
    counted = spec.get("counted_heads")
    counted = sorted(range(local_heads) if counted is None else counted)
    block_ids, start, end = span
    eb = p * n * world
    sums = {head_offset + h: [0] * (-(-end // segment)) for h in counted}
    for t in range(start, end):
        offset = t % eb
        if (offset // ilv) % world != rank:
            continue
        local = (offset // (ilv * world)) * ilv + offset % ilv
        page, slot = block_ids[t // eb] * p + local // n, local % n
        for layer, cache in enumerate(caches):
            for h in counted:
                if h >= _heads_of(cache):
                    continue
                key_base = (plane_key(g, layer, head_offset + h) + t * POS_MUL) & MASK64
                if isinstance(cache, RegionCache):
                    term = _region_slot_terms(cache, page, slot, key_base)
                else:
                    term = word_terms(key_base, _view_slot_bytes(cache, page, h, slot), 0)
                cell = sums[head_offset + h]
                cell[t // segment] = (cell[t // segment] + term) & MASK64
    return sums
