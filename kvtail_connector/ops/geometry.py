"""Page geometry: how a KV cache page reduces to regions of slots.

A *page* is one entry of a cache's dim 0 (a kernel block). Every page holds
``N`` token slots, and every slot is spread over one or more *regions*: a
region serves an arithmetic run of slots (``first_slot``, ``first_slot +
slot_step``, ... , ``n_slots`` of them) and gives each of them ``slot_bytes``
bytes, the k-th starting at ``offset + k * slot_stride`` bytes from the page
start. Zeroing slot ``s`` of a page means zeroing its run in every region that
serves ``s``, and nothing else.

- token-major pages (``N`` outside ``H``): one region of ``H*C*elem`` bytes;
- head-major pages (``H`` outside ``N``): one region per head;
- values-then-scales pages (the DeepSeek indexer cache): two regions,
  described explicitly with :class:`RegionCache`;
- pages a writer interleaves (CPU attention's AMX tiles, ROCm's x-packed K):
  many regions over slot ranges, decomposed from an element -> slot map
  (``ops/ownership.py``).

Rows (one per region and kernel page of a manager block) are what the kernel
and the torch path consume; addresses come from the storage and the strides,
never from guesses about neighbouring pages.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtail_connector.ops.integers import as_int

# Enumerating outer dims per layer must stay a table, not an explosion.
_MAX_REGIONS_PER_CACHE = 4096


@dataclass(frozen=True)
class PageRegion:
    """One run of bytes per slot, for an arithmetic run of a page's slots.

    Attributes:
        offset: bytes from the page start to the run of slot ``first_slot``.
        slot_bytes: bytes of one slot's run.
        slot_stride: bytes between the runs of consecutive served slots;
            defaults to ``slot_bytes`` (runs packed back to back).
        first_slot: the first page slot the region serves.
        n_slots: slots served; None: every ``slot_step``-th slot from
            ``first_slot`` to the end of the page.
        slot_step: page slots between consecutive served slots.
    """

    offset: int
    slot_bytes: int
    slot_stride: int | None = None
    first_slot: int = 0
    n_slots: int | None = None
    slot_step: int = 1

    @property
    def stride(self) -> int:
        return self.slot_bytes if self.slot_stride is None else self.slot_stride

    def count(self, slots_per_page: int) -> int:
        """Slots this region serves in a page of ``slots_per_page`` slots."""
        if self.n_slots is not None:
            return self.n_slots
        return max(0, -(-(slots_per_page - self.first_slot) // self.slot_step))

    def end(self, slots_per_page: int) -> int:
        """One past the region's last byte, from the page start."""
        return self.offset + (self.count(slots_per_page) - 1) * self.stride + self.slot_bytes


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
    value_bytes = as_int("value_bytes", value_bytes)
    scale_bytes = as_int("scale_bytes", scale_bytes)
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


def slot_runs(
    regions: Sequence[PageRegion], slots_per_page: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every slot's run in every region of a page: ``(first byte from the page
    start, slot, bytes)``, int64 arrays of one length, region by region."""
    if not regions:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    lengths = np.array([r.slot_bytes for r in regions], dtype=np.int64)
    counts = np.array([r.count(slots_per_page) for r in regions], dtype=np.int64)
    region = np.repeat(np.arange(len(regions)), counts)
    k = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    offset = np.array([r.offset for r in regions], dtype=np.int64)[region]
    stride = np.array([r.stride for r in regions], dtype=np.int64)[region]
    first = np.array([r.first_slot for r in regions], dtype=np.int64)[region]
    step = np.array([r.slot_step for r in regions], dtype=np.int64)[region]
    return offset + k * stride, first + k * step, lengths[region]


def _refuse_shared_bytes(regions: tuple[PageRegion, ...], n: int, name: str) -> None:
    """Raise ValueError naming ``name`` where two slots' runs share a byte
    (zeroing one would zero the other's). Once per region tuple and ``n``."""
    key = (_REGION_IDS.setdefault(regions, len(_REGION_IDS)), n)
    if key in _DISJOINT:
        return
    starts, slots, lengths = slot_runs(regions, n)
    order = np.argsort(starts, kind="stable")
    starts, slots, ends = starts[order], slots[order], (starts + lengths)[order]
    if starts.size > 1 and (starts[1:] < np.maximum.accumulate(ends)[:-1]).any():
        # Some runs overlap: only different slots on one byte are refused.
        owner = np.full(int(ends.max()), -1, dtype=np.int64)
        for start, end, slot in zip(starts.tolist(), ends.tolist(), slots.tolist(), strict=True):
            taken = owner[start:end]
            clash = (taken >= 0) & (taken != slot)
            if clash.any():
                at = start + int(np.argmax(clash))
                raise ValueError(
                    f"{name}: slots {int(owner[at])} and {slot} share byte {at} of a page, "
                    "so neither can be zeroed alone"
                )
            taken[:] = slot
    _DISJOINT.add(key)


# (region tuple id, slots per page) whose slots were checked not to share bytes.
_DISJOINT: set[tuple[int, int]] = set()


@dataclass(frozen=True)
class Row:
    """One region of one kernel page of a manager block, as the kernel sees it.

    The row serves block-local slots ``first_slot + k * slot_step`` for
    ``0 <= k < n_slots``; the k-th one, in manager block ``b``, starts at byte
    ``base + b * block_stride + k * slot_stride`` and is ``run`` bytes long.
    """

    base: int
    block_stride: int
    slot_stride: int
    run: int
    n_slots: int
    first_slot: int
    slot_step: int = 1

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
    """

    tensor: torch.Tensor
    num_pages: int
    slots_per_page: int
    page_stride: int
    regions: tuple[PageRegion, ...]

    def rows(self, pages_per_block: int) -> list[Row]:
        """Rows for every region and kernel page of a manager block."""
        base = self.tensor.data_ptr()
        n = self.slots_per_page
        return [
            Row(
                base=base + j * self.page_stride + r.offset,
                block_stride=pages_per_block * self.page_stride,
                slot_stride=r.stride,
                run=r.slot_bytes,
                n_slots=r.count(n),
                first_slot=j * n + r.first_slot,
                slot_step=r.slot_step,
            )
            for j in range(pages_per_block)
            for r in self.regions
        ]

    @functools.cached_property
    def regions_id(self) -> int:
        """A small id equal for equal region tuples (which can be thousands
        long: hashed once per cache, not per call)."""
        return _REGION_IDS.setdefault(self.regions, len(_REGION_IDS))

    @functools.cached_property
    def alias_key(self) -> tuple:
        """Equal for caches that zero exactly the same bytes."""
        return (
            self.tensor.device,
            self.tensor.data_ptr(),
            self.num_pages,
            self.slots_per_page,
            self.page_stride,
            self.regions_id,
        )


# Region tuples seen so far -> their ids (see CacheGeometry.regions_id).
_REGION_IDS: dict[tuple[PageRegion, ...], int] = {}


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


def _dense(t: torch.Tensor, name: str) -> None:
    # Sparse (and other non-strided) tensors have no strides to derive slots from.
    if t.layout != torch.strided:
        raise ValueError(f"{name}: expected a dense tensor, got layout {t.layout}")


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
        _dense(t, f"{name}.tensor")
        n = as_int(f"{name}.slots_per_page", cache.slots_per_page)
        for k, r in enumerate(cache.regions):
            for attr, value in vars(r).items():
                if value is not None:  # the optional sizes default to None
                    as_int(f"{name}.regions[{k}].{attr}", value)
        if n <= 0 or not cache.regions:
            raise ValueError(f"{name}: a RegionCache needs slots_per_page > 0 and regions")
        el = t.element_size()
        page_span = el + sum((t.shape[d] - 1) * t.stride(d) * el for d in range(1, t.dim()))
        for r in cache.regions:
            count = r.count(n)
            slots_ok = (
                r.slot_step >= 1
                and r.first_slot >= 0
                and count >= 1
                and r.first_slot + (count - 1) * r.slot_step < n
            )
            if not slots_ok:
                raise ValueError(f"{name}: region {r} serves slots outside a page of {n} slots")
            stride_ok = count == 1 or r.stride >= r.slot_bytes
            if r.offset < 0 or r.slot_bytes <= 0 or not stride_ok or r.end(n) > page_span:
                raise ValueError(
                    f"{name}: region {r} does not fit a page of {page_span} bytes with {n} slots"
                )
        _refuse_shared_bytes(tuple(cache.regions), n, name)
        return CacheGeometry(
            tensor=t,
            num_pages=int(t.shape[0]),
            slots_per_page=n,
            page_stride=t.stride(0) * el,
            regions=tuple(cache.regions),
        )
    if not isinstance(cache, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor or RegionCache, got {type(cache)}")
    _dense(cache, name)
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
    )


def describe_caches(
    caches: Sequence[torch.Tensor | RegionCache], pages_per_block: int
) -> list[CacheGeometry]:
    """Validate a group of caches sharing one manager-block geometry (their
    device is checked across groups, by :func:`one_device`)."""
    pages_per_block = as_int("pages_per_block", pages_per_block, minimum=1)
    if isinstance(caches, (torch.Tensor, RegionCache)):
        raise ValueError("caches: expected a sequence of caches, got a single cache")
    geoms = [describe_cache(c, i) for i, c in enumerate(caches)]
    for i, g in enumerate(geoms):
        if g.num_pages % pages_per_block:
            raise ValueError(
                f"pages_per_block: caches[{i}] has {g.num_pages} pages, "
                f"not a multiple of {pages_per_block}"
            )
    return geoms


def one_device(geoms: Sequence[CacheGeometry]) -> torch.device:
    """The device every cache of ``geoms`` is on (CPU when there are none).

    Raises:
        ValueError: naming ``caches`` when they are on several devices.
    """
    devices = {g.tensor.device for g in geoms}
    if len(devices) > 1:
        raise ValueError(
            f"caches: all caches must be on one device, got {sorted(map(str, devices))}"
        )
    return devices.pop() if devices else torch.device("cpu")


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
            if r.slot_stride == r.run or r.n_slots == 1:
                spans.setdefault(r.block_stride, []).append((r.base, r.base + r.n_slots * r.run))
            else:
                # A whole block zeroes every slot a row serves, whichever they are.
                strided.append(
                    Row(r.base, r.block_stride, r.slot_stride, r.run, r.n_slots, 0, r.slot_step)
                )
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
