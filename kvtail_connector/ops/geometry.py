"""Page geometry: how a KV cache page reduces to regions of consecutive slots.

A *page* is one entry of a cache's dim 0 (a kernel block). Every page holds
``N`` token slots, and every slot is spread over one or more *regions*: a
region is a run of ``slot_bytes`` bytes per slot, slot ``s`` starting at
``offset + s * slot_stride`` bytes from the page start. Zeroing slot ``s`` of
a page means zeroing its run in every region, and nothing else.

- token-major pages (``N`` outside ``H``): one region of ``H*C*elem`` bytes;
- head-major pages (``H`` outside ``N``): one region per head;
- values-then-scales pages (the DeepSeek indexer cache): two regions,
  described explicitly with :class:`RegionCache`.

Rows (one per region and kernel page of a manager block) are what the kernel
and the torch path consume; addresses come from the storage and the strides,
never from guesses about neighbouring pages.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Enumerating outer dims per layer must stay a table, not an explosion.
_MAX_REGIONS_PER_CACHE = 4096


@dataclass(frozen=True)
class PageRegion:
    """One run of bytes per slot inside a page.

    Attributes:
        offset: bytes from the page start to slot 0's run.
        slot_bytes: bytes of one slot's run.
        slot_stride: bytes between consecutive slots' runs; defaults to
            ``slot_bytes`` (slots packed back to back).
    """

    offset: int
    slot_bytes: int
    slot_stride: int | None = None

    @property
    def stride(self) -> int:
        return self.slot_bytes if self.slot_stride is None else self.slot_stride


@dataclass(frozen=True)
class RegionCache:
    """A cache whose pages are described by explicit regions.

    Use it for pages the ``[B, H, N, C]`` view does not describe slot by slot,
    e.g. the DeepSeek indexer cache (all values of a page, then all scales).

    Attributes:
        tensor: the per-layer cache; dim 0 indexes kernel pages, and page
            ``p`` starts at ``tensor[p]``'s first byte (``stride(0)`` apart).
        slots_per_page: ``N``, the token slots of one page.
        regions: the regions every slot is spread over.
    """

    tensor: torch.Tensor
    slots_per_page: int
    regions: tuple[PageRegion, ...]


def indexer_cache(tensor: torch.Tensor, value_bytes: int, scale_bytes: int) -> RegionCache:
    """Describe a values-then-scales page (DeepSeek V3.2/V4 indexer cache).

    Args:
        tensor: ``[B, N, C]`` or ``[B, 1, N, C]`` uint8 view with
            ``C == value_bytes + scale_bytes``.
        value_bytes: bytes of one slot's values (all slots' values first).
        scale_bytes: bytes of one slot's scales (after all values).
    """
    if tensor.dim() not in (3, 4):
        raise ValueError(
            f"tensor: expected a [B, N, C] or [B, 1, N, C] view, got {tuple(tensor.shape)}"
        )
    n = int(tensor.shape[-2])
    c_bytes = int(tensor.shape[-1]) * tensor.element_size()
    if value_bytes <= 0 or scale_bytes <= 0 or value_bytes + scale_bytes != c_bytes:
        raise ValueError(
            f"value_bytes + scale_bytes must equal the slot width {c_bytes} "
            f"(got {value_bytes} + {scale_bytes})"
        )
    return RegionCache(
        tensor=tensor,
        slots_per_page=n,
        regions=(PageRegion(0, value_bytes), PageRegion(n * value_bytes, scale_bytes)),
    )


@dataclass(frozen=True)
class Row:
    """One region of one kernel page of a manager block, as the kernel sees it.

    Byte address of slot ``s`` (``first_slot <= s < first_slot + n_slots``) of
    manager block ``b``: ``base + b * block_stride + (s - first_slot) *
    slot_stride``; its run is ``run`` bytes long.
    """

    base: int
    block_stride: int
    slot_stride: int
    run: int
    n_slots: int
    first_slot: int

    @property
    def word_aligned(self) -> bool:
        return (
            self.base % 4 == 0
            and self.block_stride % 4 == 0
            and self.slot_stride % 4 == 0
            and self.run % 4 == 0
        )


@dataclass(frozen=True)
class CacheGeometry:
    """Everything the zeroer needs about one cache, derived once.

    Attributes:
        tensor: the cache (a tensor, or a RegionCache's tensor).
        num_pages: ``B``, entries of dim 0.
        slots_per_page: ``N``.
        page_stride: bytes between consecutive pages.
        regions: the page's regions.
        is_view_4d: True for plain ``[B, H, N, C]`` views (slot dim 2).
    """

    tensor: torch.Tensor
    num_pages: int
    slots_per_page: int
    page_stride: int
    regions: tuple[PageRegion, ...]
    is_view_4d: bool

    def rows(self, pages_per_block: int) -> list[Row]:
        """Rows for every region and kernel page of a manager block."""
        base = self.tensor.data_ptr()
        return [
            Row(
                base=base + j * self.page_stride + r.offset,
                block_stride=pages_per_block * self.page_stride,
                slot_stride=r.stride,
                run=r.slot_bytes,
                n_slots=self.slots_per_page,
                first_slot=j * self.slots_per_page,
            )
            for j in range(pages_per_block)
            for r in self.regions
        ]

    @property
    def alias_key(self) -> tuple:
        """Equal for caches that zero exactly the same bytes."""
        return (
            self.tensor.device,
            self.tensor.data_ptr(),
            self.num_pages,
            self.slots_per_page,
            self.page_stride,
            self.regions,
        )


def _regions_of_view(t: torch.Tensor) -> tuple[PageRegion, ...]:
    """Regions of a ``[B, H, N, C]`` view from its strides (elements -> bytes)."""
    el = t.element_size()
    _, h, n, c = t.shape
    _, s_h, s_n, s_c = t.stride()
    # Grow one contiguous run from the innermost dim outward; dims that do not
    # continue it (a head dim outside N, a strided C) are enumerated instead.
    dims = sorted(((s, size) for s, size in ((s_h, h), (s_c, c)) if size > 1))
    run, outer, merging = 1, [], True
    for stride, size in dims:
        if merging and stride == run:
            run *= size
        else:
            merging = False
            outer.append((stride, size))
    if n > 1 and s_n < run:
        raise ValueError(
            f"caches: a view with shape {tuple(t.shape)} and strides "
            f"{tuple(t.stride())} has overlapping token slots"
        )
    n_regions = 1
    for _, size in outer:
        n_regions *= size
    if n_regions > _MAX_REGIONS_PER_CACHE:
        raise ValueError(
            f"caches: a view with strides {tuple(t.stride())} splits each page into "
            f"{n_regions} regions (limit {_MAX_REGIONS_PER_CACHE}); make C contiguous"
        )
    offsets = [
        sum(i * s for i, (s, _) in zip(idx, outer, strict=False))
        for idx in itertools.product(*(range(size) for _, size in outer))
    ]
    return tuple(
        PageRegion(offset=o * el, slot_bytes=run * el, slot_stride=s_n * el) for o in offsets
    )


def describe_cache(cache: torch.Tensor | RegionCache, index: int) -> CacheGeometry:
    """Validate one cache argument and derive its geometry.

    Raises:
        ValueError: naming ``caches[index]`` for a wrong rank, overlapping slots,
            or regions outside the page.
    """
    name = f"caches[{index}]"
    if isinstance(cache, RegionCache):
        t = cache.tensor
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            raise ValueError(f"{name}: RegionCache.tensor must be a tensor of rank >= 2")
        n = int(cache.slots_per_page)
        if n <= 0 or not cache.regions:
            raise ValueError(f"{name}: a RegionCache needs slots_per_page > 0 and regions")
        el = t.element_size()
        page_span = el + sum((t.shape[d] - 1) * t.stride(d) * el for d in range(1, t.dim()))
        for r in cache.regions:
            end = r.offset + (n - 1) * r.stride + r.slot_bytes
            if r.offset < 0 or r.slot_bytes <= 0 or r.stride < r.slot_bytes or end > page_span:
                raise ValueError(
                    f"{name}: region {r} does not fit a page of {page_span} bytes with {n} slots"
                )
        return CacheGeometry(
            tensor=t,
            num_pages=int(t.shape[0]),
            slots_per_page=n,
            page_stride=t.stride(0) * el,
            regions=tuple(cache.regions),
            is_view_4d=False,
        )
    if not isinstance(cache, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor or RegionCache, got {type(cache)}")
    if cache.dim() != 4:
        raise ValueError(
            f"{name}: expected a 4-D [B, H, N, C] view, got rank {cache.dim()} "
            f"(shape {tuple(cache.shape)})"
        )
    return CacheGeometry(
        tensor=cache,
        num_pages=int(cache.shape[0]),
        slots_per_page=int(cache.shape[2]),
        page_stride=cache.stride(0) * cache.element_size(),
        regions=_regions_of_view(cache),
        is_view_4d=True,
    )


def describe_caches(
    caches: Sequence[torch.Tensor | RegionCache], pages_per_block: int
) -> list[CacheGeometry]:
    """Validate a group of caches sharing one manager-block geometry."""
    if isinstance(pages_per_block, bool) or not isinstance(pages_per_block, int):
        raise ValueError(f"pages_per_block: expected an int, got {pages_per_block!r}")
    if pages_per_block < 1:
        raise ValueError(f"pages_per_block: must be >= 1, got {pages_per_block}")
    if isinstance(caches, (torch.Tensor, RegionCache)):
        raise ValueError("caches: expected a sequence of caches, got a single cache")
    geoms = [describe_cache(c, i) for i, c in enumerate(caches)]
    devices = {g.tensor.device for g in geoms}
    if len(devices) > 1:
        raise ValueError(
            f"caches: all caches must be on one device, got {sorted(map(str, devices))}"
        )
    for i, g in enumerate(geoms):
        if g.num_pages % pages_per_block:
            raise ValueError(
                f"pages_per_block: caches[{i}] has {g.num_pages} pages, "
                f"not a multiple of {pages_per_block}"
            )
    return geoms


def whole_block_rows(geoms: Sequence[CacheGeometry], pages_per_block: int) -> list[Row]:
    """Rows that zero every slot of a manager block in as few spans as possible.

    Each cache contributes the byte intervals its slots cover in block 0;
    intervals that share a block stride are united and adjacent ones merged
    (consecutive heads, pages, or layers interleaved in one block), so whole
    blocks are zeroed by long spans without touching a byte no view covers.
    Regions with gaps between slots stay per-slot rows.
    """
    spans: dict[int, list[tuple[int, int]]] = {}
    strided: list[Row] = []
    for g in geoms:
        for r in g.rows(pages_per_block):
            if r.slot_stride == r.run:
                spans.setdefault(r.block_stride, []).append((r.base, r.base + r.n_slots * r.run))
            else:
                strided.append(Row(r.base, r.block_stride, r.slot_stride, r.run, r.n_slots, 0))
    rows: list[Row] = []
    for block_stride, intervals in spans.items():
        intervals.sort()
        start, end = intervals[0]
        for lo, hi in intervals[1:]:
            if lo <= end:
                end = max(end, hi)
                continue
            rows.append(Row(start, block_stride, end - start, end - start, 1, 0))
            start, end = lo, hi
        rows.append(Row(start, block_stride, end - start, end - start, 1, 0))
    return rows + list(dict.fromkeys(strided))


def regions_from_owner(
    owner: Sequence[int], n_slots: int, elem_bytes: int
) -> tuple[PageRegion, ...]:
    """Describe a page from its element -> slot map, exactly, or refuse.

    ``owner[e]`` is the slot element ``e`` of one page belongs to (-1: to none,
    e.g. padding). The page must be *affine*: every slot's elements are the
    same runs as slot 0's, each shifted by a fixed stride per run. The result
    is verified against the whole map.

    Raises:
        ValueError: the map is not a per-slot affine layout.
    """
    owned = np.asarray(owner, dtype=np.int64)
    if owned.size == 0 or owned.max() >= n_slots:
        raise ValueError("page layout: the element map names slots outside the page")
    cuts = np.flatnonzero(np.diff(owned)) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [owned.size]])
    runs_by_slot: list[list[tuple[int, int]]] = [[] for _ in range(n_slots)]
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        slot = int(owned[start])
        if slot >= 0:
            runs_by_slot[slot].append((start, end - start))
    base = sorted(runs_by_slot[0])
    regions = []
    if n_slots > 1:
        nxt = sorted(runs_by_slot[1])
        if len(nxt) != len(base):
            raise ValueError("page layout: slots 0 and 1 have different run structures")
        for (a, length), (b, length1) in zip(base, nxt, strict=True):
            if length != length1:
                raise ValueError("page layout: a run changes length between slots")
            regions.append(PageRegion(a * elem_bytes, length * elem_bytes, (b - a) * elem_bytes))
    else:
        regions = [PageRegion(a * elem_bytes, length * elem_bytes) for a, length in base]
    for s in range(n_slots):
        want = sorted(
            (r.offset // elem_bytes + s * (r.stride // elem_bytes), r.slot_bytes // elem_bytes)
            for r in regions
        )
        if sorted(runs_by_slot[s]) != want:
            raise ValueError(f"page layout: slot {s} is not slot 0 shifted by fixed strides")
    return tuple(regions)
