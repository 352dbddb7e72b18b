"""``probe_stale_tails``: what the tail held before the wrapper zeroed it.

Diagnostics only (one gather per cache and call): counts, per request, the
non-zero bytes and the non-finite values (for float caches) in the slots
about to be zeroed. Returns host numbers, so it synchronizes the stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvtail_connector.layout import CacheSet
from kvtail_connector.ops import RegionCache
from kvtail_connector.ops.torch_path import expand_slots


def _tail_bytes(
    cache: torch.Tensor | RegionCache, pages: int, b: torch.Tensor, j: torch.Tensor, s: torch.Tensor
) -> list[torch.Tensor]:
    """The slots (b, j, s) of ``cache``: one tensor per region (or the slots of the view)."""
    if isinstance(cache, RegionCache):
        t = cache.tensor
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        first = t.storage_offset() * t.element_size()
        page_stride = t.stride(0) * t.element_size()
        out = []
        for r in cache.regions:
            view = torch.as_strided(
                raw,
                (t.shape[0] // pages, pages, cache.slots_per_page, r.slot_bytes),
                (pages * page_stride, page_stride, r.stride, 1),
                first + r.offset,
            )
            out.append(view[b, j, s])
        return out
    view = cache.unflatten(0, (cache.shape[0] // pages, pages))
    return [view[b, j, :, s]]


def _as_values(cache: torch.Tensor | RegionCache, part: torch.Tensor) -> torch.Tensor:
    """Region bytes reinterpreted as the cache's float dtype, where whole
    elements (CPU_ATTN pages); mixed-type pages (indexer values and scales)
    stay bytes and count no non-finite values."""
    if not isinstance(cache, RegionCache):
        return part
    dtype = cache.tensor.dtype
    el = cache.tensor.element_size()
    whole = all(r.offset % el == 0 and r.slot_bytes % el == 0 for r in cache.regions)
    if dtype.is_floating_point and whole:
        return part.contiguous().view(dtype)
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
        for cache in cache_set.caches:
            n = cache.slots_per_page if isinstance(cache, RegionCache) else int(cache.shape[2])
            b, j, s = expand_slots(
                np.array([block]), np.array([first]), cache_set.pages_per_block, n
            )
            if b.numel() == 0:
                continue
            device = cache.tensor.device if isinstance(cache, RegionCache) else cache.device
            for part in _tail_bytes(
                cache, cache_set.pages_per_block, b.to(device), j.to(device), s.to(device)
            ):
                as_bytes = part.contiguous().view(torch.uint8)
                counts[0] += int(as_bytes.count_nonzero())
                counts[1] += _nonfinite(_as_values(cache, part))
    return {req: (c[0], c[1]) for req, c in found.items()}
