"""Pure-torch reference of ``zero_kv_blocks``: the contract, written plainly.

Slow on purpose (a Python loop per slot) and independent of the geometry
code the kernel and the torch path share; tests compare both against it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kvtail_connector.ops.geometry import RegionCache


def _zero_region_cache_slot(cache: RegionCache, page: int, slot: int) -> None:
    t = cache.tensor
    el = t.element_size()
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    page_start = (t.storage_offset() + page * t.stride(0)) * el
    n = cache.slots_per_page
    for region in cache.regions:
        stride = region.slot_bytes if region.slot_stride is None else region.slot_stride
        count = (
            region.n_slots
            if region.n_slots is not None
            else -(-(n - region.first_slot) // region.slot_step)
        )
        k, rest = divmod(slot - region.first_slot, region.slot_step)
        if slot < region.first_slot or rest or k >= count:
            continue  # the region does not serve this slot
        start = page_start + region.offset + k * stride
        raw[start : start + region.slot_bytes] = 0


def reference_zero_kv_blocks(
    caches: Sequence[torch.Tensor | RegionCache],
    block_ids: Iterable[int] = (),
    tails: Iterable[tuple[int, int]] = (),
    *,
    pages_per_block: int = 1,
) -> None:
    """For each cache ``t`` with ``P = pages_per_block`` and ``N`` slots per page:

    - block ``b``: every slot of pages ``b*P .. b*P+P-1`` is zeroed;
    - tail ``(b, v)``: local slot ``s`` in ``[v, P*N)`` of block ``b`` lives at
      page ``b*P + s // N``, slot ``s % N``, and is zeroed.
    """
    p = pages_per_block
    work = [(b, 0) for b in block_ids] + [(b, v) for b, v in tails]
    for cache in caches:
        n = cache.slots_per_page if isinstance(cache, RegionCache) else cache.shape[2]
        for b, v in work:
            for s in range(v, p * n):
                page, slot = b * p + s // n, s % n
                if isinstance(cache, RegionCache):
                    _zero_region_cache_slot(cache, page, slot)
                else:
                    cache[page, :, slot, :] = 0
