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
        _zero_regions(g, pages_per_block, num_blocks, blocks, firsts)


def _page_span(g: CacheGeometry) -> int:
    n = g.slots_per_page
    return max(r.offset + (n - 1) * r.stride + r.slot_bytes for r in g.regions)


def _owner_bytes(g: CacheGeometry, span: int) -> torch.Tensor:
    """Slot owning each byte of a page (-1: none), from the regions."""
    owner = torch.full((span,), -1, dtype=torch.int32)
    n = g.slots_per_page
    for r in g.regions:
        starts = r.offset + torch.arange(n) * r.stride
        idx = (starts[:, None] + torch.arange(r.slot_bytes)[None, :]).reshape(-1)
        owner[idx] = torch.arange(n, dtype=torch.int32).repeat_interleave(r.slot_bytes)
    return owner.to(g.tensor.device)


def _zero_regions(
    g: CacheGeometry, pages_per_block: int, num_blocks: int, blocks: np.ndarray, firsts: np.ndarray
) -> None:
    """Region-described pages: one gather, masked fill and scatter of whole
    page rows (a page may have many regions, e.g. CPU_ATTN's transposed K)."""
    raw = _byte_storage(g.tensor)
    first_byte = g.tensor.storage_offset() * g.tensor.element_size()
    n = g.slots_per_page
    span = _page_span(g)
    if span > g.page_stride:
        # Page rows would overlap (heads outside the block dim): go region by region.
        b, j, s = expand_slots(blocks, firsts, pages_per_block, n)
        b, j, s = b.to(raw.device), j.to(raw.device), s.to(raw.device)
        for r in g.regions:
            region = torch.as_strided(
                raw,
                size=(num_blocks, pages_per_block, n, r.slot_bytes),
                stride=(pages_per_block * g.page_stride, g.page_stride, r.stride, 1),
                storage_offset=first_byte + r.offset,
            )
            region[b, j, s] = 0
        return
    # (page, first local slot) per item and kernel page; a page named twice
    # is zeroed from the smaller slot (the union of both requests).
    kernel_page = np.arange(pages_per_block)
    lo = np.clip(firsts[:, None] - kernel_page[None, :] * n, 0, n)
    page = blocks[:, None] * pages_per_block + kernel_page[None, :]
    keep = lo < n
    page, lo = page[keep], lo[keep]
    if page.size == 0:
        return
    order = np.lexsort((lo, page))
    page, lo = page[order], lo[order]
    first_of_page = np.concatenate([[True], page[1:] != page[:-1]])
    page, lo = page[first_of_page], lo[first_of_page]
    rows = torch.as_strided(raw, (g.num_pages, span), (g.page_stride, 1), storage_offset=first_byte)
    key = (g.regions, n, span, raw.device)
    owner = _OWNERS.get(key)
    if owner is None:
        owner = _OWNERS[key] = _owner_bytes(g, span)
    index = torch.from_numpy(page).to(raw.device)
    mask = owner[None, :] >= torch.from_numpy(lo).to(raw.device)[:, None].to(torch.int32)
    rows[index] = rows[index].masked_fill(mask, 0)


# Byte -> slot maps, one per page geometry (not per layer), built on first use.
_OWNERS: dict[tuple, torch.Tensor] = {}
