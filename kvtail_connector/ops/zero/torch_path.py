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

from kvtail_connector.ops.geometry import CacheGeometry
from kvtail_connector.ops.ownership import slot_runs

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
    """

    unit: int
    offsets: np.ndarray
    first_at: np.ndarray
    page_units: int


class CacheUnits(NamedTuple):
    """One cache as the torch path zeroes it: ``flat`` is its storage from its
    first page's first byte as ``[units, words]`` integers (a row per unit)."""

    flat: torch.Tensor
    units: SlotUnits


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
    found = _SLOT_UNITS[key] = SlotUnits(
        unit, offsets[order], first_at.astype(np.int64), g.page_stride // unit
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
    # A view made under inference mode (a cache registered inside it) could
    # not be written outside it; the cache itself can.
    with torch.inference_mode(False):
        flat = torch.empty(0, dtype=_WORD_DTYPES[word], device=t.device).set_(
            storage, first // word, ((storage.nbytes() - first) // unit, words), (words, 1)
        )
    return CacheUnits(flat, slot_units(g, unit))


def tail_index(
    units: SlotUnits, pages_per_block: int, blocks: np.ndarray, firsts: np.ndarray
) -> np.ndarray:
    """The units of slots ``[first, P*N)`` of each item's block, int64 (a unit
    appears twice where two items name one block: zeroing is idempotent)."""
    n = units.first_at.size - 1
    kernel_page = np.arange(pages_per_block, dtype=np.int64)
    lo = np.clip(firsts[:, None] - kernel_page[None, :] * n, 0, n)
    page = blocks[:, None] * pages_per_block + kernel_page[None, :]
    keep = lo < n
    page, lo = page[keep], lo[keep]
    start = units.first_at[lo]
    count = units.offsets.size - start
    total = int(count.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    step_start = np.cumsum(count) - count
    pos = np.arange(total, dtype=np.int64) + np.repeat(start - step_start, count)
    return units.offsets[pos] + np.repeat(page * units.page_units, count)


class GroupZeroing:
    """The torch path of one cache group: its caches as flat views, those of
    one page geometry together so their index is built once per call.

    Caches that alias the same bytes are zeroed once; empty caches never.
    """

    def __init__(self, geoms: Sequence[CacheGeometry], pages_per_block: int) -> None:
        self.pages_per_block = pages_per_block
        seen: set[tuple] = set()
        by_units: dict[int, tuple[SlotUnits, list[torch.Tensor]]] = {}
        for g in geoms:
            if g.alias_key in seen or not g.tensor.numel():
                continue
            seen.add(g.alias_key)
            flat, units = cache_units(g)
            by_units.setdefault(id(units), (units, []))[1].append(flat)
        self.by_units = list(by_units.values())

    def zero(self, blocks: np.ndarray, firsts: np.ndarray) -> None:
        """Zero slots ``[first, P*N)`` of every item's block in every cache."""
        pages = self.pages_per_block
        for units, flats in self.by_units:
            per_item = max(1, pages * units.offsets.size)
            chunk = max(1, _MAX_INDEX // per_item)
            for at in range(0, blocks.size, chunk):
                index = tail_index(units, pages, blocks[at : at + chunk], firsts[at : at + chunk])
                if not index.size:
                    continue
                indices = torch.from_numpy(index).to(flats[0].device)
                for flat in flats:
                    flat.index_fill_(0, indices, 0)
