"""Vectorized torch zeroing: the runtime path for caches that are not on CUDA.

One indexed assignment per distinct cache (per region for RegionCaches); the
slot lists are built with numpy, never with a Python loop per slot.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtail_connector.ops.geometry import CacheGeometry


def expand_slots(
    blocks: np.ndarray, firsts: np.ndarray, pages_per_block: int, n_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (block, page, slot) to zero for items ``(block, first slot)``.

    Returns three int64 tensors of equal length: manager block, kernel page
    within the block, slot within the page.
    """
    per_block = pages_per_block * n_slots
    counts = np.clip(per_block - firsts, 0, None)
    total = int(counts.sum())
    if total == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty, empty
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    slots = np.repeat(firsts, counts) + (np.arange(total, dtype=np.int64) - starts)
    b = torch.from_numpy(np.repeat(blocks, counts))
    s = torch.from_numpy(slots)
    return b, s // n_slots, s % n_slots


def _byte_storage(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def zero_group(
    geoms: list[CacheGeometry],
    pages_per_block: int,
    blocks: np.ndarray,
    firsts: np.ndarray,
) -> None:
    """Zero slots ``[first, P*N)`` of every item's block in every cache.

    Caches that alias the same bytes are zeroed once.
    """
    seen: set[tuple] = set()
    slot_lists: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for g in geoms:
        if g.alias_key in seen:
            continue
        seen.add(g.alias_key)
        n = g.slots_per_page
        if n not in slot_lists:
            slot_lists[n] = expand_slots(blocks, firsts, pages_per_block, n)
        b, j, s = slot_lists[n]
        if b.numel() == 0:
            continue
        device = g.tensor.device
        b, j, s = b.to(device), j.to(device), s.to(device)
        num_blocks = g.num_pages // pages_per_block
        if g.is_view_4d:
            view = g.tensor.unflatten(0, (num_blocks, pages_per_block))
            view[b, j, :, s] = 0
            continue
        raw = _byte_storage(g.tensor)
        first_byte = g.tensor.storage_offset() * g.tensor.element_size()
        for r in g.regions:
            region = torch.as_strided(
                raw,
                size=(num_blocks, pages_per_block, n, r.slot_bytes),
                stride=(pages_per_block * g.page_stride, g.page_stride, r.stride, 1),
                storage_offset=first_byte + r.offset,
            )
            region[b, j, s] = 0
