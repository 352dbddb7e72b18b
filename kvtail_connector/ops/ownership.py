"""Element -> slot maps and the page regions that describe them exactly.

A cache writer's page layout is known through its *owner map*: for every
element of a page, the slot that writes it (-1: none, e.g. padding). Any map
in which each element has at most one owner can be zeroed exactly, however
the slots interleave (transposed K, tiles of 16 tokens, two slots inside one
32-bit word): :func:`regions_from_owner` cuts it into :class:`PageRegion` s
over slot ranges, few of them, and proves the result by rebuilding the whole
map from the regions (:func:`owner_of_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from kvtail_connector.ops.geometry import PageRegion, slot_runs

# Regions per page the decomposition may produce; a page needing more is not
# a layout this package can zero in reasonable work (and is refused).
MAX_REGIONS_PER_PAGE = 1 << 16


def owner_of_bytes(regions: Sequence[PageRegion], slots_per_page: int, span: int) -> np.ndarray:
    """The slot owning each byte of a ``span``-byte page (-1: none), int32.

    Raises:
        ValueError: two regions claim one byte.
    """
    owner = np.full(span, -1, dtype=np.int32)
    run_start, run_slot, run_len = slot_runs(regions, slots_per_page)
    byte_run = np.repeat(np.arange(run_start.size), run_len)
    byte = np.arange(int(run_len.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(run_len) - run_len, run_len
    )
    where = run_start[byte_run] + byte
    if np.unique(where).size != where.size:
        raise ValueError("page layout: two regions claim the same byte")
    owner[where] = run_slot[byte_run]
    return owner


def regions_from_owner(
    owner: Sequence[int] | np.ndarray,
    n_slots: int,
    elem_bytes: int,
    segments: Sequence[tuple[int, int]] | None = None,
) -> tuple[PageRegion, ...]:
    """Describe a page from its element -> slot map, exactly, or refuse.

    ``owner[e]`` is the slot element ``e`` of one page belongs to (-1: none).
    ``segments`` (element ranges ``[start, end)`` covering every owned
    element, e.g. each head's K and V halves) are decomposed independently,
    each with the slot step that gives it the fewest regions: a writer may
    tile K by 16 tokens and interleave V in token pairs in the same page.

    Raises:
        ValueError: the map names slots outside the page, the page needs more
            than ``MAX_REGIONS_PER_PAGE`` regions, or (never expected) the
            regions do not rebuild the map.
    """
    owned = np.asarray(owner, dtype=np.int64)
    if owned.size == 0 or owned.max() >= n_slots or owned.min() < -1:
        raise ValueError("page layout: the element map names slots outside the page")
    if segments is None:
        segments = [(0, owned.size)]
    covered = np.zeros(owned.size, dtype=bool)
    regions: list[PageRegion] = []
    # Segments with the same map (every head of a layer) are decomposed once.
    seen: dict[bytes, list[PageRegion]] = {}
    for start, end in segments:
        covered[start:end] = True
        part = owned[start:end]
        key = part.tobytes()
        if key not in seen:
            seen[key] = _decompose(part, n_slots, elem_bytes)
        shift = start * elem_bytes
        regions.extend(replace(r, offset=r.offset + shift) for r in seen[key])
        if len(regions) > MAX_REGIONS_PER_PAGE:
            raise ValueError(
                f"page layout: more than {MAX_REGIONS_PER_PAGE} regions per page "
                "(slots interleave too finely to zero as runs)"
            )
    if (owned[~covered] >= 0).any():
        raise ValueError("page layout: the segments leave written elements out")
    rebuilt = owner_of_bytes(regions, n_slots, owned.size * elem_bytes)
    if not np.array_equal(rebuilt[::elem_bytes], owned) or not np.array_equal(
        rebuilt.reshape(-1, elem_bytes).min(axis=1), rebuilt.reshape(-1, elem_bytes).max(axis=1)
    ):
        raise ValueError("page layout: the regions found do not rebuild the element map")
    return tuple(regions)


def _runs(owned: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of one owner: (slot, first element, length), sorted by
    slot, then element."""
    cuts = np.flatnonzero(np.diff(owned)) + 1
    starts = np.concatenate([[0], cuts])
    lengths = np.diff(np.concatenate([starts, [owned.size]]))
    slots = owned[starts]
    keep = slots >= 0
    slots, starts, lengths = slots[keep], starts[keep], lengths[keep]
    order = np.lexsort((starts, slots))
    return slots[order], starts[order], lengths[order]


def _decompose(owned: np.ndarray, n_slots: int, elem_bytes: int) -> list[PageRegion]:
    """The fewest regions over the candidate slot steps (powers of two), for
    one segment; offsets from the segment start."""
    slots, starts, lengths = _runs(owned)
    if slots.size == 0:
        return []
    best: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None
    step = 1
    while step < max(n_slots, 2):
        heads, stride, length = _chains(slots, starts, lengths, n_slots, step)
        if best is None or heads.size < best[1].size:
            best = (step, heads, stride, length)
        step *= 2
    assert best is not None
    step, heads, stride, length = best
    return [
        PageRegion(
            offset=int(starts[i]) * elem_bytes,
            slot_bytes=int(lengths[i]) * elem_bytes,
            slot_stride=int(d) * elem_bytes if n > 1 else None,
            first_slot=int(slots[i]),
            n_slots=int(n),
            slot_step=step if n > 1 else 1,
        )
        for i, d, n in zip(
            heads.tolist(), stride[heads].tolist(), length[heads].tolist(), strict=True
        )
    ]


def _chains(
    slots: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    n_slots: int,
    step: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Regions linking the k-th run of slot ``s`` to the k-th run of slot
    ``s + step`` while the shift stays constant and the length equal.

    Greedy from the first slot: a chain grows while its next link has the
    chain's stride. For this pairing that is the fewest regions (any part of
    an arithmetic run is one); other pairings are not tried, so layouts that
    only diagonal chains would cover take more regions than they could.

    Returns:
        the runs that head a region, and per run (read at heads) the region's
        stride and length, in elements and runs.
    """
    count = np.bincount(slots, minlength=n_slots)
    first_run = np.concatenate([[0], np.cumsum(count)[:-1]])
    rank = np.arange(slots.size) - first_run[slots]
    nxt_slot = slots + step
    has_next = nxt_slot < n_slots
    nxt = np.full(slots.size, -1, dtype=np.int64)
    cand = np.flatnonzero(has_next)
    ok = rank[cand] < count[nxt_slot[cand]]
    cand = cand[ok]
    target = first_run[nxt_slot[cand]] + rank[cand]
    # Links go forward past the run (a region's slots never overlap or go back).
    fits = (lengths[target] == lengths[cand]) & (starts[target] - starts[cand] >= lengths[cand])
    nxt[cand[fits]] = target[fits]
    delta = np.where(nxt >= 0, starts[np.maximum(nxt, 0)] - starts, 0)

    # Walk every chain in slot order, all chains at once: a run starts a
    # region unless its predecessor links to it with the region's stride.
    # Slots [t*step, (t+1)*step) only link to the band before: one band a pass.
    prev = np.full(slots.size, -1, dtype=np.int64)
    linked = np.flatnonzero(nxt >= 0)
    prev[nxt[linked]] = linked
    head = np.full(slots.size, -1, dtype=np.int64)  # region head of each run
    stride = np.zeros(slots.size, dtype=np.int64)  # region stride (elements)
    length = np.zeros(slots.size, dtype=np.int64)  # runs in the region so far
    bounds = np.concatenate([first_run, [slots.size]])
    for lo in range(0, n_slots, step):
        idx = np.arange(bounds[lo], bounds[min(lo + step, n_slots)])
        if idx.size == 0:
            continue
        p = prev[idx]
        joins = p >= 0
        h = np.where(joins, head[np.maximum(p, 0)], -1)
        d = np.where(joins, delta[np.maximum(p, 0)], 0)
        joins &= (length[np.maximum(h, 0)] == 1) | (stride[np.maximum(h, 0)] == d)
        new = idx[~joins]
        head[new], length[new] = new, 1
        grow = idx[joins]
        hs = h[joins]
        head[grow] = hs
        stride[hs] = d[joins]
        length[hs] += 1
    heads = np.flatnonzero(head == np.arange(slots.size))
    return heads, stride, length
