"""Vectorized torch zeroing: the runtime path for caches that are not on CUDA.

One indexed assignment per distinct cache (per region for RegionCaches); the
slot lists are built with numpy, never with a Python loop per slot.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtail_connector.ops.geometry import CacheGeometry
from kvtail_connector.ops.ownership import owner_of_bytes


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


def _storage_bytes(g: CacheGeometry) -> tuple[torch.Tensor, int]:
    """The cache's whole storage as uint8, and the byte its first page starts at."""
    t = g.tensor
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    return raw, int(t.storage_offset() * t.element_size())


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
        _zero_regions(g, pages_per_block, blocks, firsts)


def owner_bytes(g: CacheGeometry) -> torch.Tensor:
    """Page slot owning each byte of ``g``'s page span (-1: none), int32, on
    the cache's device; built once per page geometry (not per layer)."""
    key = (g.regions_id, g.slots_per_page, g.page_span, g.tensor.device)
    owner = _OWNERS.get(key)
    if owner is None:
        table = owner_of_bytes(g.regions, g.slots_per_page, g.page_span)
        owner = _OWNERS[key] = torch.from_numpy(table).to(g.tensor.device)
    return owner


def tail_pages(
    g: CacheGeometry, pages_per_block: int, blocks: np.ndarray, firsts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(page, first local slot to zero) per page the items reach, each page
    once, from the smallest slot any item names (the union of the items)."""
    n = g.slots_per_page
    kernel_page = np.arange(pages_per_block)
    lo = np.clip(firsts[:, None] - kernel_page[None, :] * n, 0, n)
    page = blocks[:, None] * pages_per_block + kernel_page[None, :]
    keep = lo < n
    page, lo = page[keep], lo[keep]
    if page.size == 0:
        return page, lo
    order = np.lexsort((lo, page))
    page, lo = page[order], lo[order]
    first_of_page = np.concatenate([[True], page[1:] != page[:-1]])
    return page[first_of_page], lo[first_of_page]


def page_rows(g: CacheGeometry) -> torch.Tensor:
    """``[B, page_span]`` uint8 view of every page of a region-described cache
    (rows overlap when a page's span reaches past the next page's start)."""
    raw, first_byte = _storage_bytes(g)
    return torch.as_strided(
        raw, (g.num_pages, g.page_span), (g.page_stride, 1), storage_offset=first_byte
    )


def region_slots(
    g: CacheGeometry,
    pages_per_block: int,
    num_blocks: int,
    b: torch.Tensor,
    j: torch.Tensor,
    s: torch.Tensor,
) -> list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Per region, its ``[blocks, pages, served slots, slot_bytes]`` byte view and
    the indices of the (b, j, s) slots it serves."""
    raw, first_byte = _storage_bytes(g)
    n = g.slots_per_page
    out = []
    for r in g.regions:
        count = r.count(n)
        k = torch.div(s - r.first_slot, r.slot_step, rounding_mode="floor")
        sel = (s >= r.first_slot) & ((s - r.first_slot) % r.slot_step == 0) & (k < count)
        if not bool(sel.any()):
            continue
        region = torch.as_strided(
            raw,
            size=(num_blocks, pages_per_block, count, r.slot_bytes),
            stride=(pages_per_block * g.page_stride, g.page_stride, r.stride, 1),
            storage_offset=first_byte + r.offset,
        )
        out.append((region, (b[sel], j[sel], k[sel])))
    return out


# A byte view and what of it a tail covers: the view's entries at ``index``
# (whole entries), or those entries' bytes where ``mask`` is True.
TailBytes = tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None]


def region_tail_bytes(
    g: CacheGeometry, pages_per_block: int, blocks: np.ndarray, firsts: np.ndarray
) -> list[TailBytes]:
    """Where the slots ``[first, P*N)`` of each item's block lie in a
    region-described cache: one gather of whole page rows masked by the
    byte -> slot map (a page may have thousands of regions, e.g. CPU_ATTN's
    AMX tiles), or region by region where page rows would overlap (heads
    outside the block dim)."""
    num_blocks = g.num_pages // pages_per_block
    device = g.tensor.device
    if g.page_span > g.page_stride:
        b, j, s = expand_slots(blocks, firsts, pages_per_block, g.slots_per_page)
        found = region_slots(
            g, pages_per_block, num_blocks, b.to(device), j.to(device), s.to(device)
        )
        return [(region, served, None) for region, served in found]
    page, lo = tail_pages(g, pages_per_block, blocks, firsts)
    if page.size == 0:
        return []
    owner = owner_bytes(g)
    index = torch.from_numpy(page).to(owner.device)
    mask = owner[None, :] >= torch.from_numpy(lo).to(owner.device)[:, None].to(torch.int32)
    return [(page_rows(g), (index,), mask)]


def _zero_regions(
    g: CacheGeometry, pages_per_block: int, blocks: np.ndarray, firsts: np.ndarray
) -> None:
    for view, index, mask in region_tail_bytes(g, pages_per_block, blocks, firsts):
        if mask is None:
            view[index] = 0
        else:
            view[index] = view[index].masked_fill(mask, 0)


# Byte -> slot maps, one per page geometry (not per layer), built on first use.
_OWNERS: dict[tuple, torch.Tensor] = {}
