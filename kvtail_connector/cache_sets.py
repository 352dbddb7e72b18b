"""vLLM's per-layer KV views -> the cache sets the zeroer works on.

``register_kv_caches`` hands every layer's ``[B, H, N, C]`` view (views of one
backing buffer; groups overlay each other). Each attention group with tails
becomes one or more cache sets: its layers' views with the kernel pages per
manager block (``B // num_blocks``) and tokens per stored slot. Pages the
``[B, H, N, C]`` view does not describe slot by slot become
:class:`RegionCache` s: the DeepSeek indexer's values-then-scales pages, vLLM's
CPU attention pages (per-ISA layouts learned from its writer; see
``cpu_pages``) and ROCm's paged-attention planes (K x-packed; see
``rocm_pages``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from kvtail_connector import _compat, cpu_pages, rocm_pages
from kvtail_connector.kvgroups import GroupInfo, layer_spec
from kvtail_connector.ops import RegionCache, indexer_cache

# What "off" does and does not switch off, for refusals that suggest it.
_OFF_HINT = (
    'set kv_connector_extra_config.zero_tails to "off" if this model needs no tail zeroing '
    "(with MoRIIO READ on a model vLLM zeroes, the producer tails READs copy are zeroed "
    '"off" or not, so it does not help there).'
)
# Layer classes whose cache pages hold all values, then all scales (fp8).
INDEXER_LAYER_CLASSES = frozenset({"DeepseekV32IndexerCache", "DeepseekV4IndexerCache"})
# fp8 indexer slot: D fp8 values + D/128 fp32 scales (D + D/32 bytes).
_FP8_SLOT_NUM, _FP8_SLOT_DEN = 33, 32
# MXFP4 indexer slot: D/2 packed values + D/32 scales, token-major in the page.
_FP4_SLOT_NUM, _FP4_SLOT_DEN = 17, 32


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


def _is_indexer(spec: Any, layer_object: Any) -> bool:
    role = getattr(spec, "cache_role", None)
    if role is not None and getattr(role, "value", role) == "indexer":
        return True
    return type(layer_object).__name__ in INDEXER_LAYER_CLASSES


def _backend_name(layer_object: Any) -> str | None:
    backend = getattr(layer_object, "attn_backend", None)
    get_name = getattr(backend, "get_name", None)
    return str(get_name()) if callable(get_name) else None


def _cpu_attn_cache(layer: str, view: torch.Tensor, layer_object: Any) -> RegionCache:
    isa = cpu_pages.layer_isa(layer_object)
    if isa is None:
        raise ValueError(
            f"KVTailConnector: CPU_ATTN layer {layer!r} has no ISA set by vLLM's "
            "metadata builder; cannot learn its page layout."
        )
    dtype = str(getattr(layer_object, "kv_cache_dtype", "auto"))
    model_dtype = cpu_pages.layer_model_dtype(layer_object)
    try:
        regions = cpu_pages.cpu_attn_regions(view, isa, dtype, model_dtype)
    except ValueError as e:
        raise ValueError(
            f"KVTailConnector: layer {layer!r} (CPU_ATTN, ISA {isa!r}, kv_cache_dtype "
            f"{dtype!r}): {str(e).rstrip('.')}. Its tails cannot be zeroed exactly. "
            "vLLM picks the CPU attention ISA from --dtype, the block size and the head "
            f'size (on x86, --dtype float32 selects "vec"): change one of them, or {_OFF_HINT}'
        ) from e
    return RegionCache(view, int(view.shape[2]), regions)


def _rocm_cache(
    layer: str, view: torch.Tensor, spec: Any, backend: str, v_interleaved: bool
) -> RegionCache:
    heads = int(getattr(spec, "num_kv_heads", 0))
    head_size = int(getattr(spec, "head_size", 0))
    try:
        regions = rocm_pages.rocm_regions(view, heads, head_size, v_interleaved)
    except ValueError as e:
        raise ValueError(f"KVTailConnector: layer {layer!r} ({backend}): {e}.") from e
    return RegionCache(view, int(view.shape[2]), regions)


def _as_cache(layer: str, view: torch.Tensor, spec: Any, layer_object: Any) -> Any:
    backend = _backend_name(layer_object)
    if backend == cpu_pages.BACKEND_NAME:
        return _cpu_attn_cache(layer, view, layer_object)
    v_interleaved = _compat.rocm_v_interleaved(backend, layer_object)
    if v_interleaved is not None:
        label = "ROCM_ATTN" if backend == "ROCM_ATTN" else "ROCM_AITER_FA (shuffle layout)"
        return _rocm_cache(layer, view, spec, label, v_interleaved)
    if not _is_indexer(spec, layer_object):
        return view
    c_bytes = view.shape[-1] * view.element_size()
    if c_bytes % _FP8_SLOT_NUM == 0 and (c_bytes // _FP8_SLOT_NUM * _FP8_SLOT_DEN) % 128 == 0:
        value_bytes = c_bytes // _FP8_SLOT_NUM * _FP8_SLOT_DEN
        return indexer_cache(view, value_bytes, c_bytes - value_bytes)
    if c_bytes % _FP4_SLOT_NUM == 0 and (c_bytes // _FP4_SLOT_NUM * _FP4_SLOT_DEN) % 64 == 0:
        return view  # MXFP4: values and scales packed per token, one slot per token
    raise ValueError(
        f"KVTailConnector: indexer cache layer {layer!r} has {c_bytes}-byte slots, which match "
        "neither the fp8 (values then scales) nor the MXFP4 indexer page; its tails cannot be "
        f"zeroed exactly. Report the layout, or {_OFF_HINT}"
    )


def cache_sets(
    kv_caches: Mapping[str, Any],
    kv_cache_config: Any,
    groups: tuple[GroupInfo, ...],
    layer_objects: Mapping[str, Any] | None = None,
) -> list[CacheSet]:
    """Cache sets of every group with tails.

    Raises:
        ValueError: at start-up, for a view whose pages do not split evenly
            into manager blocks, or an indexer page of unknown layout.
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
            if not isinstance(view, torch.Tensor) or view.dim() != 4:
                continue  # raw buffers, host pools, layers this worker does not hold
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
            cs.caches.append(_as_cache(layer, view, spec, layer_objects.get(layer)))
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
