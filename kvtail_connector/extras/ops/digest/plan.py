"""Work tables of the KV digest: the inputs, their rows, and the work buffer.

A *row* is one (layer, local head, kernel page of a manager block) of a
``[B, H, N, C]`` view, or one (layer, region, kernel page) of a
:class:`RegionCache`: the bytes one slot's content has in it, and where they
are. Rows are derived once per cache set.

Per call the host lists, per request and group, only its token range, its
block table (a slice of an integer array) and where its output cells are: no
work per token, block, segment or head. A *chunk* is ``chunk`` tokens
(aligned, a power of two dividing the segment, so one chunk lies in one
segment); a work *unit* is one (row, chunk of a request), and the kernel
derives each slot's block, token and address from the unit by arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtail_connector.extras.ops.digest.reference import MASK64, SEED
from kvtail_connector.ops.dcp import dcp_local_valid_slots
from kvtail_connector.ops.geometry import RegionCache, describe_caches
from kvtail_connector.ops.integers import as_int, int_rows

CacheLike = torch.Tensor | RegionCache

# Work buffer layout (must match ops/digest/kernel.py; the modes, ops/digest/loads.py).
HEADER = 8
KIND_COLS = 16
REQ_COLS = 8
ROW_COLS = 16
MODE_BYTES, MODE_WORDS, MODE_VECTORS = 0, 1, 2
# Units and in-block offsets are int32 inside the kernel.
MAX_INT32 = 2**31 - 1
# Tokens of a work unit (choose_chunk): powers of two; programs get at least
# UNITS_PER_PROGRAM units where the launch has the tokens for it.
MIN_CHUNK = 16
MAX_CHUNK = 512
UNITS_PER_PROGRAM = 4


@dataclass(frozen=True)
class DigestGroup:
    """One KV cache group as this rank holds it.

    Attributes:
        caches: per-layer ``[B, H, N, C]`` views (any strides and dtype) or
            :class:`RegionCache` s, in the group's layer order (the index is
            the layer coordinate of the key). ``B = num_blocks * P``; every
            cache has the same ``P * N`` slots per manager block.
        pages_per_block: ``P``, kernel pages per manager block.
        group_id: the group coordinate of the key (default: the group's index).
        head_offset: global KV head of local head 0 (TP rank placement).
        counted_heads: local heads this rank counts (None: all). With
            replicated heads (TP > KV heads, MLA) only the lowest replica
            counts a global head, so that the ranks' sums add up.
        dcp_rank, dcp_world_size, interleave: DCP placement of the group's
            tokens (``dcp_world_size=1``: not sharded).
    """

    caches: Sequence[CacheLike]
    pages_per_block: int = 1
    group_id: int | None = None
    head_offset: int = 0
    counted_heads: Sequence[int] | None = None
    dcp_rank: int = 0
    dcp_world_size: int = 1
    interleave: int = 1


@dataclass(frozen=True)
class GroupSpan:
    """The tokens ``[start, end)`` of one request in one group.

    Attributes:
        block_ids: the request's manager block ids in the group from block
            ``first_block`` on; entry ``i`` covers tokens ``[(first_block +
            i) * eb, (first_block + i + 1) * eb)``, ``eb = P * N *
            dcp_world_size``. Only the blocks holding tokens of ``[start,
            end)`` are read (and checked). An int64 numpy array is taken as
            is (a slice); other sequences are checked entry by entry.
        start, end: the token range to digest (``start >= first_block * eb``).
        first_block: the block ``block_ids[0]`` is.
    """

    block_ids: Sequence[int] | np.ndarray
    start: int
    end: int
    first_block: int = 0


@dataclass(frozen=True)
class Row:
    """See the module docstring; addresses in bytes, absolute."""

    tensor: torch.Tensor  # whose storage the row reads
    base: int  # address of the row's first served slot in manager block 0
    block_stride: int
    slot_stride: int
    run_bytes: int
    first_slot: int  # block-local slot of the first served slot
    n_slots: int
    slot_step: int
    word_base: int
    plane: int  # uint64 plane key
    out_head: int  # index of the output cell's head among the counted heads
    elem: int  # element bytes (byte loads of strided elements)
    elem_stride: int

    @property
    def n_words(self) -> int:
        return -(-self.run_bytes // 4)

    @property
    def mode(self) -> int:
        contiguous = self.elem_stride == self.elem
        aligned = (self.base | self.block_stride | self.slot_stride | self.run_bytes) % 4 == 0
        if not (contiguous and aligned):
            return MODE_BYTES
        wide = (self.base | self.block_stride | self.slot_stride | self.run_bytes) % 16 == 0
        return MODE_VECTORS if wide else MODE_WORDS


def _fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK64
    return x ^ (x >> 33)


def _plane(group: int, layer: int, head: int) -> int:
    return _fmix64(_fmix64(_fmix64(SEED ^ group) ^ layer) ^ head)


@dataclass
class GroupRows:
    """A validated :class:`DigestGroup` and its rows."""

    group_id: int
    slots_per_block: int  # P * N, local slots of one manager block
    num_blocks: int
    dcp: tuple[int, int, int]  # rank, world size, interleave
    heads: tuple[int, ...]  # global heads of the output cells, in order
    rows: list[Row]

    @property
    def tokens_per_block(self) -> int:
        return self.slots_per_block * self.dcp[1]


def group_rows(group: DigestGroup, index: int) -> GroupRows:
    """Validate ``group`` (``groups[index]``) and derive its rows.

    Raises:
        ValueError: naming the field: invalid caches (see
            ``describe_caches``), caches of unequal slots per block, heads or
            DCP placement out of range.
    """
    name = f"groups[{index}]"
    if not isinstance(group, DigestGroup):
        raise ValueError(f"{name}: expected a DigestGroup, got {type(group).__name__}")
    p = as_int(f"{name}.pages_per_block", group.pages_per_block, minimum=1)
    try:
        geoms = describe_caches(group.caches, p)
    except ValueError as e:
        raise ValueError(f"{name}.{e}") from None
    group_id = as_int(
        f"{name}.group_id", index if group.group_id is None else group.group_id, minimum=0
    )
    head_offset = as_int(f"{name}.head_offset", group.head_offset, minimum=0)
    try:
        dcp_local_valid_slots(0, group.dcp_rank, group.dcp_world_size, group.interleave)
    except ValueError as e:
        raise ValueError(f"{name}.{e}") from None
    per_block = {g.slots_per_page * p for g in geoms}
    if len(per_block) > 1:
        raise ValueError(
            f"{name}.caches: every cache of a group needs the same slots per manager block "
            f"(pages_per_block * N), got {sorted(per_block)}; put caches of another block "
            "geometry in their own DigestGroup"
        )
    local_heads = [1 if isinstance(c, RegionCache) else int(c.shape[1]) for c in group.caches]
    num_heads = max(local_heads, default=0)
    counted = (
        list(range(num_heads))
        if group.counted_heads is None
        else [as_int(f"{name}.counted_heads", h, minimum=0) for h in group.counted_heads]
    )
    for h in counted:
        if h >= num_heads:
            raise ValueError(f"{name}.counted_heads: head {h} out of range [0, {num_heads})")
    if len(set(counted)) != len(counted):
        raise ValueError(f"{name}.counted_heads: heads must be distinct, got {counted}")
    counted.sort()
    out_head = {h: i for i, h in enumerate(counted)}
    rows: list[Row] = []
    for layer, (cache, geom) in enumerate(zip(group.caches, geoms, strict=True)):
        n = geom.slots_per_page
        block_stride = p * geom.page_stride
        page_bases = [geom.tensor.data_ptr() + j * geom.page_stride for j in range(p)]
        if isinstance(cache, RegionCache):
            if 0 not in out_head:
                continue
            plane = _plane(group_id, layer, head_offset)
            word_base = 0
            for region in cache.regions:
                first, count, step = region.first_slot, region.count(n), region.slot_step
                for j, page in enumerate(page_bases):
                    rows.append(
                        Row(
                            geom.tensor,
                            page + region.offset,
                            block_stride,
                            region.stride,
                            region.slot_bytes,
                            j * n + first,
                            count,
                            step,
                            word_base,
                            plane,
                            out_head[0],
                            1,
                            1,
                        )
                    )
                word_base += -(-region.slot_bytes // 4)
            continue
        el = cache.element_size()
        _, s_h, s_n, s_c = cache.stride()
        c = int(cache.shape[3])
        for h in counted:
            if h >= cache.shape[1]:
                continue
            plane = _plane(group_id, layer, head_offset + h)
            for j, page in enumerate(page_bases):
                rows.append(
                    Row(
                        cache,
                        page + h * s_h * el,
                        block_stride,
                        s_n * el,
                        c * el,
                        j * n,
                        n,
                        1,
                        0,
                        plane,
                        out_head[h],
                        el,
                        (s_c if c > 1 else 1) * el,
                    )
                )
    for r in rows:
        if r.n_slots * r.slot_stride * r.slot_step + r.run_bytes > MAX_INT32:
            raise ValueError(f"{name}.caches: a page spans more than 2 GiB; not supported")
    return GroupRows(
        group_id=group_id,
        slots_per_block=per_block.pop() if per_block else 0,
        num_blocks=min((g.num_pages // p for g in geoms), default=0),
        dcp=(int(group.dcp_rank), int(group.dcp_world_size), int(group.interleave)),
        heads=tuple(head_offset + h for h in counted),
        rows=rows,
    )


def row_table(rows: Sequence[Row]) -> np.ndarray:
    """The kernel's int64 row table ``[max(len(rows), 1), ROW_COLS]`` (strides
    in the row's load unit: words in the word modes, bytes in byte mode)."""
    table = np.zeros((max(len(rows), 1), ROW_COLS), dtype=np.int64)
    for i, r in enumerate(rows):
        mode = r.mode
        unit = 1 if mode == MODE_BYTES else 4
        plane = r.plane - (1 << 64) if r.plane >= 1 << 63 else r.plane
        table[i, :14] = (
            r.base,
            r.block_stride // unit,
            r.slot_stride // unit,
            r.n_words,
            r.run_bytes,
            r.first_slot,
            r.n_slots,
            r.slot_step,
            r.word_base,
            plane,
            r.out_head,
            mode,
            r.elem,
            r.elem_stride,
        )
    return table


def span_request(
    g: GroupRows, span: GroupSpan, segment: int, name: str
) -> tuple[np.ndarray | None, tuple[int, int, int, int]]:
    """The block table of one request's span in one group (None when there
    is nothing to read) and its request row's fields ``(start, end, first
    block, n_seg)``.

    The table holds the span's blocks from ``start // eb`` to the last one
    with a token below ``end`` (``int64``; the kernel reads entry ``i - first
    block`` for manager block ``i``). Cost: O(1) in Python, a slice and one
    vectorized range check of the blocks when ``block_ids`` is an integer numpy array (a sequence is
    checked entry by entry, by the kernel API's integer rule).

    Raises:
        ValueError: naming ``name``: a bad range, or a block id out of range.
    """
    start = as_int(f"{name}.start", span.start, minimum=0)
    end = as_int(f"{name}.end", span.end, minimum=start)
    eb = g.tokens_per_block
    skipped = as_int(f"{name}.first_block", span.first_block, minimum=0)
    if start < skipped * eb:
        raise ValueError(
            f"{name}.start: {start} lies before first_block {skipped} (tokens from {skipped * eb})"
        )
    blocks_needed = -(-end // eb) if eb else 0
    ids = span.block_ids
    if blocks_needed > skipped + len(ids):
        raise ValueError(
            f"{name}.block_ids: tokens [{start}, {end}) need {blocks_needed} blocks of {eb} "
            f"tokens, got {len(ids)} from block {skipped}"
        )
    n_seg = -(-end // segment)
    if start == end or not g.rows:
        return None, (start, end, 0, n_seg)
    first_block = start // eb
    lo, hi = first_block - skipped, blocks_needed - skipped
    if isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.ndim == 1:
        table = ids[lo:hi]
    else:
        table = int_rows(ids[lo:hi], 1, f"{name}.block_ids")[:, 0]
    # Negative ids are huge as uint64: one reduction checks both bounds.
    if int(table.view(np.uint64).max()) >= g.num_blocks:
        bad = (table < 0) | (table >= g.num_blocks)
        block = int(table[int(np.argmax(bad))])
        raise ValueError(f"{name}.block_ids: block id {block} out of range [0, {g.num_blocks})")
    return table, (start, end, first_block, n_seg)


def choose_chunk(row_tokens: int, programs: int, segment: int) -> int:
    """Tokens of a work unit: the largest power of two in ``[MIN_CHUNK,
    min(MAX_CHUNK, segment)]`` that still gives every program
    ``UNITS_PER_PROGRAM`` units (``row_tokens``: tokens times rows of the
    launch). Large units amortize a unit's set-up (its request's search, its
    row, its atomic add); small ones fill the GPU with short requests."""
    per_unit = row_tokens // max(1, UNITS_PER_PROGRAM * programs)
    chunk = 1 << max(per_unit, 1).bit_length() - 1
    return max(MIN_CHUNK, min(chunk, MAX_CHUNK, segment))


@dataclass
class KindPlan:
    """One group's share of a launch: its requests' tables and rows."""

    group: GroupRows
    first_row: int
    tables: list[np.ndarray]
    # start, end, first block, output cell, segments
    requests: list[tuple[int, int, int, int, int]]


def work_buffer(
    kinds: Sequence[KindPlan], n_cells: int, segment: int, chunk: int
) -> tuple[np.ndarray, int, int]:
    """The kernel's work buffer, its work units and the output's offset.

    Layout (int64): the header ``n_kinds, units, output offset, segment,
    chunk tokens``; per kind (``KIND_COLS``) ``first unit, rows, first row,
    first request, requests, chunks, tokens per block, DCP rank, interleave,
    turn``; per request (``REQ_COLS``) ``table offset, start, end, first
    chunk (in the kind), output cell, segments, first chunk index (start //
    chunk)``; the block tables; the output cells (zeroed). A unit is one
    chunk of one request and one row (rows fastest). Only requests with
    chunks are listed.
    """
    n_req = 0
    n_blocks = 0
    for k in kinds:
        n_req += len(k.requests)
        for t in k.tables:
            n_blocks += len(t)
    req_offset = HEADER + KIND_COLS * len(kinds)
    table_offset = req_offset + REQ_COLS * n_req
    out_offset = table_offset + n_blocks
    work = np.zeros(out_offset + n_cells, dtype=np.int64)
    if n_blocks:
        work[table_offset:out_offset] = np.concatenate([t for k in kinds for t in k.tables])
    req_rows: list[tuple[int, ...]] = []
    kind_rows: list[tuple[int, ...]] = []
    units, pos = 0, table_offset
    for k in kinds:
        chunks = 0
        first_req = len(req_rows)
        for (start, end, first_block, cell, n_seg), table in zip(k.requests, k.tables, strict=True):
            req_rows.append((pos - first_block, start, end, chunks, cell, n_seg, start // chunk, 0))
            chunks += -(-end // chunk) - start // chunk
            pos += len(table)
        g = k.group
        rank, world, ilv = g.dcp
        dcp = (rank, ilv, ilv * world) if world > 1 else (0, 1, 1)
        n_rows = len(g.rows)
        kind_rows.append(
            (units, n_rows, k.first_row, first_req, len(k.requests), chunks, g.tokens_per_block)
            + dcp
            + (0,) * (KIND_COLS - 10)
        )
        units += chunks * n_rows
    if kind_rows:
        work[HEADER:req_offset] = np.array(kind_rows, dtype=np.int64).reshape(-1)
        work[req_offset:table_offset] = np.array(req_rows, dtype=np.int64).reshape(-1)
    if units > MAX_INT32 or out_offset > MAX_INT32:
        raise ValueError(f"requests: {units} work units exceed one launch; split the call")
    work[:5] = (len(kinds), units, out_offset, segment, chunk)
    return work, units, out_offset
