"""``probe_stale_tails``: what the tail held before the wrapper zeroed it.

Diagnostics only (one gather per cache and call): counts, per request, the
non-zero bytes and the non-finite values (for float caches) in the slots
about to be zeroed. Returns host numbers, so it synchronizes the stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvtail_connector.cache_sets import CacheSet
from kvtail_connector.ops import RegionCache
from kvtail_connector.ops.geometry import describe_cache
from kvtail_connector.ops.zero.torch_path import expand_slots, region_tail_bytes


def _region_tail_bytes(
    cache: RegionCache, pages: int, block: int, first: int
) -> list[torch.Tensor]:
    """The bytes of slots ``[first, P*N)`` of ``block`` (see
    :func:`region_tail_bytes`: page order where page rows do not overlap)."""
    g = describe_cache(cache, 0)
    found = region_tail_bytes(g, pages, np.array([block]), np.array([first]))
    return [view[index] if mask is None else view[index][mask] for view, index, mask in found]


def _view_tail_bytes(cache: torch.Tensor, pages: int, block: int, first: int) -> list[torch.Tensor]:
    b, j, s = expand_slots(np.array([block]), np.array([first]), pages, int(cache.shape[2]))
    if b.numel() == 0:
        return []
    view = cache.unflatten(0, (cache.shape[0] // pages, pages))
    device = cache.device
    return [view[b.to(device), j.to(device), :, s.to(device)]]


def _as_values(cache: torch.Tensor | RegionCache, part: torch.Tensor) -> torch.Tensor:
    """Region bytes reinterpreted as the cache's float dtype where every
    element has one owner (CPU_ATTN and ROCm pages); mixed-type pages (indexer
    values and scales) stay bytes and count no non-finite values."""
    if not isinstance(cache, RegionCache):
        return part
    dtype = cache.tensor.dtype
    el = cache.tensor.element_size()
    whole = all(
        r.offset % el == 0 and r.slot_bytes % el == 0 and r.stride % el == 0 for r in cache.regions
    )
    if dtype.is_floating_point and whole:
        return part.contiguous().view(-1).view(dtype)
    return part


def _nonfinite(values: torch.Tensor) -> int:
    if values.dtype.is_floating_point:
        return int((~torch.isfinite(values.float())).sum())
    return 0


def probe_items(
    sets: Sequence[CacheSet], items: np.ndarray, owners: Sequence[str]
) -> dict[str, tuple[int, int]]:
    """``{request id: (non-zero bytes, non-finite values)}`` of the slots
    ``items`` (set index, block, first slot) are about to zero."""
    found: dict[str, list[int]] = {}
    for row, req_id in zip(items.tolist(), owners, strict=True):
        set_index, block, first = row
        cache_set = sets[set_index]
        counts = found.setdefault(req_id, [0, 0])
        pages = cache_set.pages_per_block
        for cache in cache_set.caches:
            if isinstance(cache, RegionCache):
                parts = _region_tail_bytes(cache, pages, block, first)
            else:
                parts = _view_tail_bytes(cache, pages, block, first)
            for part in parts:
                as_bytes = part.contiguous().view(torch.uint8)
                counts[0] += int(as_bytes.count_nonzero())
                counts[1] += _nonfinite(_as_values(cache, part))
    return {req: (c[0], c[1]) for req, c in found.items()}
