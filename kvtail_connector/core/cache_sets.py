"""vLLM's per-layer KV views -> the cache sets the zeroer works on.

``register_kv_caches`` hands every layer's ``[B, H, N, C]`` view (views of one
backing buffer; groups overlay each other). Each attention group with tails
becomes one or more cache sets: its layers' caches with the kernel pages per
manager block (``B // num_blocks``) and tokens per stored slot. Which bytes of
a page each token slot owns is the page maps' decision (``pages``): the view
itself, a :class:`RegionCache` over it, or a refusal at start-up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from kvtail_connector.core.kvgroups import GroupInfo, layer_spec
from kvtail_connector.ops import RegionCache
from kvtail_connector.pages import PLAIN_ENGINE, EngineFacts, UnmappedPage, layer_cache


@dataclass
class CacheSet:
    """Caches of one KV cache group sharing one page geometry.

    Attributes:
        group_id: the KV cache group.
        pages_per_block: kernel pages per manager block.
        tokens_per_state: tokens one stored slot covers.
        caches: per-layer views or region caches.
        layer_names: the layers, for messages.
    """

    group_id: int
    pages_per_block: int
    tokens_per_state: int | Fraction
    caches: list[torch.Tensor | RegionCache] = field(default_factory=list)
    layer_names: list[str] = field(default_factory=list)


def cache_sets(
    kv_caches: Mapping[str, Any],
    kv_cache_config: Any,
    groups: tuple[GroupInfo, ...],
    layer_objects: Mapping[str, Any] | None = None,
    engine: EngineFacts = PLAIN_ENGINE,
) -> list[CacheSet]:
    """Cache sets of every group with tails.

    Raises:
        ValueError: at start-up, for a view whose pages do not split evenly
            into manager blocks, or a layer no page map covers
            (``pages.UnmappedPage``).
    """
    layer_objects = layer_objects or {}
    num_blocks = int(kv_cache_config.num_blocks)
    sets: dict[tuple[int, int, int | Fraction], CacheSet] = {}
    for info in groups:
        if not info.has_tails:
            continue
        group = kv_cache_config.kv_cache_groups[info.group_id]
        for layer in group.layer_names:
            view = kv_caches.get(layer)
            if not isinstance(view, torch.Tensor):
                continue  # a layer this worker does not hold (pipeline parallel)
            if view.dim() != 4:
                if layer not in layer_objects:
                    continue  # a raw buffer no attention layer of this worker reads
                raise UnmappedPage(
                    f"KVTailConnector: layer {layer!r} has a {view.dim()}-D KV cache "
                    f"{tuple(view.shape)} where vLLM hands attention layers [B, H, N, C] "
                    "views; its token slots' bytes are not known, so its tails cannot be "
                    'zeroed. Set kv_connector_extra_config.zero_tails to "off" if this model '
                    "needs no tail zeroing."
                )
            pages = int(view.shape[0])
            if pages % num_blocks:
                raise ValueError(
                    f"KVTailConnector: layer {layer!r} has {pages} kernel pages, not a multiple "
                    f"of num_blocks={num_blocks}; cannot map manager blocks to its pages."
                )
            spec = layer_spec(group.kv_cache_spec, layer)
            tps = getattr(spec, "tokens_per_state", 1)
            key = (info.group_id, pages // num_blocks, tps)
            cs = sets.setdefault(key, CacheSet(info.group_id, pages // num_blocks, tps))
            cs.caches.append(layer_cache(layer, view, spec, layer_objects.get(layer), engine))
            cs.layer_names.append(layer)
    return list(sets.values())


def cache_slots(cache: torch.Tensor | RegionCache) -> int:
    """Slots in one kernel page of ``cache``."""
    if isinstance(cache, RegionCache):
        return int(cache.slots_per_page)
    return int(cache.shape[2])


def cache_slot_bytes(cache: torch.Tensor | RegionCache) -> int:
    """Bytes one slot takes in ``cache``, over all its heads and regions (the
    page's slot bytes over its slots, for regions serving slot ranges)."""
    if isinstance(cache, RegionCache):
        n = int(cache.slots_per_page)
        return sum(r.slot_bytes * r.count(n) for r in cache.regions) // n
    return int(cache.shape[1] * cache.shape[3] * cache.element_size())


@dataclass(frozen=True)
class TailBytes:
    """Bytes a zeroing from slot ``first`` to the end of a block writes, per
    cache set: ``slot_bytes[i] * (slots[i] - first)`` (the zeroed-bytes
    counters). Tables built once at registration; a call is a few lookups.

    Attributes:
        slot_bytes: per set, bytes of one slot over all the set's caches.
        slots: per set, slots of one manager block on this rank (``P * N``;
            a set is one group, page split and ``tokens_per_state``).
    """

    slot_bytes: tuple[int, ...]
    slots: tuple[int, ...]

    @classmethod
    def of(cls, sets: Sequence[CacheSet]) -> TailBytes:
        return cls(
            tuple(sum(cache_slot_bytes(c) for c in s.caches) for s in sets),
            tuple(s.pages_per_block * cache_slots(s.caches[0]) for s in sets),
        )

    def __call__(self, set_index: int, first: int) -> int:
        return self.slot_bytes[set_index] * max(self.slots[set_index] - first, 0)
