"""The torch zeroing path: caches that are not on CUDA (vLLM's CPU engines).

A page's bytes are counted in *units*, the most bytes that divide every slot
run's start and length (a head's row of ``C`` elements in most layouts, one
element where a writer interleaves slots), and every unit a slot owns is
listed in slot order, so the units of slots ``>= s`` are one suffix of that
list. A step's tails then become one numpy index of units per page geometry,
shared by every layer of that geometry, and each cache is zeroed with one
``index_fill_`` over the rows of a ``[units, words]`` view of its storage:
the cost per layer is one torch call, whatever the page layout (CPU_ATTN's
transposed and tiled pages included).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvtail_connector.ops.geometry import CacheGeometry, slot_runs

# A unit is stored as words of the widest integer dividing it.
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

# Units one index may hold (int64: 32 MiB); more items are zeroed in chunks,
# so zeroing thousands of whole blocks does not build a gigabyte index.
_MAX_INDEX = 1 << 22


class SlotUnits(NamedTuple):
    """Where a page geometry's slots lie, in units.

    Attributes:
        unit: bytes per unit.
        offsets: int64, every unit some slot owns, in units from the page
            start, ordered by slot (then offset).
        first_at: int64 ``[N + 1]``: ``offsets[first_at[s]:]`` are the units
            of slots ``>= s``.
        page_units: units from one page's start to the next's.
        dense: slots own every unit from one page's start to the next's, so
            a whole page is one run (zeroed as a row of page rows).
    """

    unit: int
    offsets: np.ndarray
    first_at: np.ndarray
    page_units: int
    dense: bool


class CacheUnits(NamedTuple):
    """One cache as the torch path zeroes it: ``flat`` is its storage from its
    first page's first byte as ``[units, words]`` integers (a row per unit);
    ``pages`` the same bytes as ``[pages, page_units, words]`` where the page
    geometry is dense (else None)."""

    flat: torch.Tensor
    units: SlotUnits
    pages: torch.Tensor | None


class TailIndex(NamedTuple):
    """What a call zeroes in one page geometry: ``pages``, whole pages (dense
    geometries only), and ``units``, single units of the other pages; int64."""

    pages: np.ndarray
    units: np.ndarray


def _first_byte(g: CacheGeometry) -> int:
    return int(g.tensor.storage_offset() * g.tensor.element_size())


# Per page geometry: the gcd of its runs' starts and lengths; per page
# geometry and unit, its SlotUnits. Small numpy arrays, never a cache's tensor.
_RUNS_GCD: dict[tuple, int] = {}
_SLOT_UNITS: dict[tuple, SlotUnits] = {}


def _unit_of(g: CacheGeometry) -> int:
    """The most bytes that divide every run's start and length, the page
    stride and where the first page starts in the storage."""
    key = (g.regions_id, g.slots_per_page)
    runs = _RUNS_GCD.get(key)
    if runs is None:
        starts, _, lengths = slot_runs(g.regions, g.slots_per_page)
        runs = _RUNS_GCD[key] = int(np.gcd.reduce(np.concatenate([starts, lengths])))
    return math.gcd(runs, g.page_stride, _first_byte(g))


def slot_units(g: CacheGeometry, unit: int) -> SlotUnits:
    """``g``'s page in ``unit``-byte units (built once per page geometry)."""
    key = (g.regions_id, g.slots_per_page, g.page_stride, unit)
    found = _SLOT_UNITS.get(key)
    if found is not None:
        return found
    starts, slots, lengths = slot_runs(g.regions, g.slots_per_page)
    per_run = lengths // unit
    run = np.repeat(np.arange(starts.size), per_run)
    within = np.arange(int(per_run.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(per_run) - per_run, per_run
    )
    offsets = starts[run] // unit + within
    owner = slots[run]
    order = np.lexsort((offsets, owner))
    owner = owner[order]
    first_at = np.searchsorted(owner, np.arange(g.slots_per_page + 1), side="left")
    page_units = g.page_stride // unit
    dense = offsets.size == page_units and np.array_equal(
        np.sort(offsets), np.arange(page_units, dtype=np.int64)
    )
    found = _SLOT_UNITS[key] = SlotUnits(
        unit, offsets[order], first_at.astype(np.int64), page_units, bool(dense)
    )
    return found


def cache_units(g: CacheGeometry) -> CacheUnits:
    """``g`` as a flat view of units over its storage, and its page's units."""
    unit = _unit_of(g)
    word = next(w for w in (8, 4, 2, 1) if unit % w == 0)
    t = g.tensor
    storage = t.untyped_storage()
    first = _first_byte(g)
    words = unit // word
    units = slot_units(g, unit)
    # A view made under inference mode (a cache registered inside it) could
    # not be written outside it; the cache itself can.
    with torch.inference_mode(False):
        flat = torch.empty(0, dtype=_WORD_DTYPES[word], device=t.device).set_(
            storage, first // word, ((storage.nbytes() - first) // unit, words), (words, 1)
        )
        pages = None
        if units.dense:
            pages = flat.as_strided(
                (g.num_pages, units.page_units, words), (units.page_units * words, words, 1)
            )
    return CacheUnits(flat, units, pages)


_NONE = np.zeros(0, dtype=np.int64)
# Up to this many one-page items (a step's completions, a producer's prompts)
# take a suffix view of the slot-ordered units each: a few numpy calls per
# item instead of a dozen per call.
_FEW = 8


def _few_tails(units: SlotUnits, n: int, blocks: np.ndarray, firsts: np.ndarray) -> TailIndex:
    """:func:`tail_index` for one kernel page per block, item by item."""
    whole: list[int] = []
    parts: list[np.ndarray] = []
    offsets, first_at, page_units = units.offsets, units.first_at, units.page_units
    for block, first in zip(blocks.tolist(), firsts.tolist(), strict=True):
        if first >= n:
            continue
        if first == 0 and units.dense:
            whole.append(block)
        else:
            parts.append(offsets[first_at[first] :] + block * page_units)
    single = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else _NONE
    return TailIndex(np.array(whole, dtype=np.int64) if whole else _NONE, single)


def tail_index(
    units: SlotUnits, pages_per_block: int, blocks: np.ndarray, firsts: np.ndarray
) -> TailIndex:
    """The pages and units of slots ``[first, P*N)`` of each item's block (one
    appears twice where two items name one block: zeroing is idempotent)."""
    n = units.first_at.size - 1
    if pages_per_block == 1 and blocks.size <= _FEW:
        return _few_tails(units, n, blocks, firsts)
    kernel_page = np.arange(pages_per_block, dtype=np.int64)
    lo = np.clip(firsts[:, None] - kernel_page[None, :] * n, 0, n)
    page = blocks[:, None] * pages_per_block + kernel_page[None, :]
    keep = lo < n
    page, lo = page[keep], lo[keep]
    whole = _NONE
    if units.dense:
        full = lo == 0
        if full.any():
            whole, page, lo = page[full], page[~full], lo[~full]
    start = units.first_at[lo]
    count = units.offsets.size - start
    total = int(count.sum())
    if total == 0:
        return TailIndex(whole, _NONE)
    step_start = np.cumsum(count) - count
    pos = np.arange(total, dtype=np.int64) + np.repeat(start - step_start, count)
    return TailIndex(whole, units.offsets[pos] + np.repeat(page * units.page_units, count))


class GroupZeroing:
    """The torch path of one cache group: its caches as flat views, those of
    one page geometry together so their index is built once per call.

    Caches that alias the same bytes are zeroed once; empty caches never.
    """

    def __init__(self, geoms: Sequence[CacheGeometry], pages_per_block: int) -> None:
        self.pages_per_block = pages_per_block
        seen: set[tuple] = set()
        by_units: dict[int, tuple[SlotUnits, list[CacheUnits]]] = {}
        for g in geoms:
            if g.alias_key in seen or not g.tensor.numel():
                continue
            seen.add(g.alias_key)
            cache = cache_units(g)
            by_units.setdefault(id(cache.units), (cache.units, []))[1].append(cache)
        self.by_units = list(by_units.values())

    def zero(self, blocks: np.ndarray, firsts: np.ndarray) -> None:
        """Zero slots ``[first, P*N)`` of every item's block in every cache."""
        pages = self.pages_per_block
        for units, caches in self.by_units:
            device = caches[0].flat.device
            per_item = max(1, pages * units.offsets.size)
            chunk = max(1, _MAX_INDEX // per_item)
            for at in range(0, blocks.size, chunk):
                whole, single = tail_index(
                    units, pages, blocks[at : at + chunk], firsts[at : at + chunk]
                )
                if whole.size:
                    index = torch.from_numpy(whole).to(device)
                    for cache in caches:
                        assert cache.pages is not None  # whole pages: dense geometries only
                        cache.pages.index_fill_(0, index, 0)
                if single.size:
                    index = torch.from_numpy(single).to(device)
                    for cache in caches:
                        cache.flat.index_fill_(0, index, 0)
