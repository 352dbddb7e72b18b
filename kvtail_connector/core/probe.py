"""``probe_stale_tails``: what the tail held before the wrapper zeroed it.

Diagnostics only (one gather per cache and call): counts, per request, the
non-zero bytes and the non-finite values (for float caches) in the slots
about to be zeroed. Returns host numbers, so it synchronizes the stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvtail_connector.core.cache_sets import CacheSet
from kvtail_connector.ops.geometry import describe_cache
from kvtail_connector.ops.zero.torch_path import CacheUnits, cache_units, tail_index


def _tail_units(found: CacheUnits, pages: int, block: int, first: int) -> torch.Tensor:
    """The units the torch path zeroes for slots ``[first, P*N)`` of
    ``block``, gathered (``[units, words]``)."""
    flat, units, page_rows = found
    whole, single = tail_index(units, pages, np.array([block]), np.array([first]))
    parts = [flat[torch.from_numpy(single).to(flat.device)]]
    if whole.size and page_rows is not None:
        rows = page_rows[torch.from_numpy(whole).to(flat.device)]
        parts.append(rows.reshape(-1, flat.shape[1]))
    return torch.cat(parts)


def _as_values(t: torch.Tensor, part: torch.Tensor, unit: int) -> torch.Tensor:
    """The gathered units as the float values of cache tensor ``t`` where they
    hold whole elements (always, for a float cache: runs start and end on
    elements); other pages (indexer values and scales) count no non-finite
    values."""
    if t.dtype.is_floating_point and unit % t.element_size() == 0:
        return part.view(torch.uint8).view(t.dtype)
    return part.view(torch.uint8)


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
    # Each cache's tensor and views, once per call (not per item); None for
    # an empty cache (a zero-sized H or C): no byte, as the zeroing skips it.
    views: dict[int, tuple[torch.Tensor, CacheUnits | None]] = {}
    for row, req_id in zip(items.tolist(), owners, strict=True):
        set_index, block, first = row
        cache_set = sets[set_index]
        counts = found.setdefault(req_id, [0, 0])
        pages = cache_set.pages_per_block
        for cache in cache_set.caches:
            known = views.get(id(cache))
            if known is None:
                g = describe_cache(cache, 0)
                known = views[id(cache)] = (g.tensor, cache_units(g) if g.tensor.numel() else None)
            t, at = known
            if at is None:
                continue
            part = _tail_units(at, pages, block, first)
            counts[0] += int(part.view(torch.uint8).count_nonzero())
            counts[1] += _nonfinite(_as_values(t, part, at.units.unit))
    return {req: (c[0], c[1]) for req, c in found.items()}
