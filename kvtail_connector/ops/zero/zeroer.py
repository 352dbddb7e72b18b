""":class:`KVZeroer`: zero whole blocks and tails of several cache groups at once.

Row tables are derived once from the caches. :meth:`KVZeroer.zero` turns
its items into one work buffer (a header and one line per item) and one
kernel launch on CUDA, or one vectorized torch pass per group elsewhere.

The worker zeroes the same way with its work encoded ahead: an item's line
packed where the item becomes known (:meth:`KVZeroer.rows_for`,
:func:`~kvtail_connector.ops.zero.plan.pack_line`), a step's lines joined
into one launch (:meth:`KVZeroer.zero_packed`), and per-layer launches
staged before the layers land (:meth:`KVZeroer.stage`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import numpy as np
import torch

from kvtail_connector.ops.geometry import (
    CacheGeometry,
    RegionCache,
    Row,
    describe_caches,
    one_device,
    whole_block_rows,
)
from kvtail_connector.ops.integers import as_int
from kvtail_connector.ops.zero import launcher, torch_path
from kvtail_connector.ops.zero.launcher import work_at
from kvtail_connector.ops.zero.plan import (
    GroupRows,
    WorkShape,
    items_work,
    packed_work,
    row_span,
    row_table,
    same_items_work,
)

CacheLike = torch.Tensor | RegionCache
Implementation = Literal["auto", "triton", "torch"]


def _widest(rows: Sequence[GroupRows]) -> WorkShape:
    return WorkShape(
        max((r.rows for r in rows), default=0), max((r.chunks for r in rows), default=0)
    )


class _OwnRows(NamedTuple):
    """A group's rows as a row table of its own numbers them (tail rows from
    row 0, then whole-block rows), and the most slots one of its blocks has."""

    tails: GroupRows
    whole: GroupRows
    any_slots: int


class KVZeroer:
    """Zero whole blocks and block tails across cache groups in one launch.

    Args:
        groups: per cache group, ``(caches, pages_per_block)``. ``caches`` are
            per-layer ``[B, H, N, C]`` views (any strides and dtype) or
            :class:`RegionCache` s; ``B = num_blocks * pages_per_block``.
            Groups may share tensors; each group reaches all of its caches.
        implementation: what zeroes: ``"triton"``, the kernel (CUDA, or CPU
            under ``TRITON_INTERPRET=1``); ``"torch"``, indexed assignments
            (any device); or ``"auto"``: Triton on CUDA, torch otherwise.
        use_graphs: on CUDA, replay small launches from CUDA graphs.
        hold_caches: keep references to the caches (the default). ``False``
            (Triton only) keeps nothing but their addresses and
            layout, so the zeroer does not keep freed caches alive; the
            caller then guarantees that the caches it was built from are
            alive, unmoved, whenever it zeroes.

    Raises:
        ValueError: for invalid caches, naming the argument.
    """

    def __init__(
        self,
        groups: Sequence[tuple[Sequence[CacheLike], int]],
        *,
        implementation: Implementation = "auto",
        use_graphs: bool = True,
        hold_caches: bool = True,
    ) -> None:
        self._geoms: list[list[CacheGeometry]] = []
        self._pages: list[int] = []
        self._num_blocks: list[int] = []
        # Per group: rows for tails (one per region and page) and rows for
        # whole blocks (merged spans); both live in one row table.
        tail_rows: list[list[Row]] = []
        whole_rows: list[list[Row]] = []
        for caches, pages in groups:
            pages_per_block = as_int("pages_per_block", pages, minimum=1)
            geoms = describe_caches(caches, pages_per_block)
            self._geoms.append(geoms)
            self._pages.append(pages_per_block)
            self._num_blocks.append(min((g.num_pages // pages_per_block for g in geoms), default=0))
            # An empty view (a zero-sized H, N or C) has no byte to zero, and its
            # data_ptr may be 0: it gets no rows, so nothing is ever launched for it.
            live = [g for g in geoms if g.tensor.numel()]
            tail_rows.append(list(dict.fromkeys(r for g in live for r in g.rows(pages_per_block))))
            whole_rows.append(whole_block_rows(live, pages_per_block))
        self.device = one_device([g for geoms in self._geoms for g in geoms])
        per_block = [
            [g.slots_per_page * p for g in gs]
            for gs, p in zip(self._geoms, self._pages, strict=True)
        ]
        # A first slot may reach the smallest block; past the largest one,
        # nothing is left to zero in any cache.
        self._max_first = [min(x, default=0) for x in per_block]
        self._any_slots = [max(x, default=0) for x in per_block]
        self.implementation: Implementation = _implementation(implementation, self.device)
        if not hold_caches and self.implementation != "triton":
            raise ValueError(
                "hold_caches: False needs implementation='triton' "
                "(torch zeroes through the tensors)"
            )

        # The row table: every group's tail rows, then every group's whole-block rows.
        all_rows = tail_rows + whole_rows
        counts = [len(rows) for rows in all_rows]
        starts = np.cumsum([0] + counts).tolist()
        spans = [max((row_span(r) for r in rows), default=0) for rows in all_rows]
        ranges = [
            GroupRows(start, count, -(-span // launcher.BLOCK))
            for start, count, span in zip(starts, counts, spans, strict=False)
        ]
        n = len(tail_rows)
        self._tails, self._whole = ranges[:n], ranges[n:]
        # One header shape serves any group's lines (see WorkShape).
        self._tail_shape, self._whole_shape = _widest(self._tails), _widest(self._whole)
        # The same facts as arrays, for zero()'s numpy encoding: index g for
        # group g's tail rows, n + g for its whole-block rows.
        self._row_start = np.array(starts[:-1], dtype=np.int64)
        self._row_count = np.array(counts, dtype=np.int64)
        self._max_span = np.array(spans, dtype=np.int64)
        self.num_rows = sum(counts[:n])
        self._launcher: launcher.KernelLauncher | None = None
        self._torch: list[torch_path.GroupZeroing] = []
        # Per group, its rows in a table of its own, for stage(); the tables
        # are built on first use.
        self._own_rows = [
            _OwnRows(tails._replace(start=0), whole._replace(start=tails.rows), any_slots)
            for tails, whole, any_slots in zip(
                self._tails, self._whole, self._any_slots, strict=True
            )
        ]
        self._own_tables: dict[int, torch.Tensor] = {}
        if self.implementation == "torch":
            self._torch = [
                torch_path.GroupZeroing(geoms, pages)
                for geoms, pages in zip(self._geoms, self._pages, strict=True)
            ]
        else:
            table = torch.from_numpy(row_table([r for rows in all_rows for r in rows]))
            self._launcher = launcher.KernelLauncher(
                self.device, table.to(self.device), use_graphs=use_graphs
            )
        if not hold_caches:
            # The row table holds every address the kernel needs; the torch
            # path, the only reader of the tensors, is never taken.
            self._geoms = [[] for _ in self._geoms]

    @property
    def num_groups(self) -> int:
        return len(self._geoms)

    def num_blocks(self, group: int) -> int:
        return self._num_blocks[group]

    def slots_per_block(self, group: int) -> int:
        """``P * N`` of the group (its smallest cache's, if they differ)."""
        return self._max_first[group]

    @property
    def last_launch_done(self) -> torch.cuda.Event | None:
        """An event behind this zeroer's latest CUDA launch (None before any, or on CPU)."""
        return self._launcher.last_done if self._launcher is not None else None

    @property
    def uses_graphs(self) -> bool:
        return self._launcher is not None and self._launcher.uses_graphs

    def check_items(self, items: np.ndarray, name: str = "items") -> None:
        """Raise ValueError naming ``name`` unless every (group, block, first) is valid."""
        if items.ndim != 2 or items.shape[1] != 3:
            raise ValueError(f"{name}: expected (group, block, first slot) triples")
        if items.shape[0] == 0:
            return
        groups, blocks, firsts = items[:, 0], items[:, 1], items[:, 2]
        if groups.min() < 0 or groups.max() >= self.num_groups:
            raise ValueError(f"{name}: group out of range [0, {self.num_groups})")
        nb = np.asarray(self._num_blocks, dtype=np.int64)[groups]
        bad = (blocks < 0) | (blocks >= nb)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{name}: block id {int(blocks[i])} out of range [0, {int(nb[i])})")
        limit = np.asarray(self._max_first, dtype=np.int64)[groups]
        bad = (firsts < 0) | (firsts > limit)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"{name}: first slot {int(firsts[i])} out of range [0, {int(limit[i])}] "
                f"(pages_per_block * slots per page)"
            )

    # ----------------------------------------------------------------- zero

    def zero(self, items: np.ndarray, *, validate: bool = True) -> int:
        """Zero slots ``[first, P*N)`` of each item's block in its group's caches.

        Args:
            items: int64 ``[n, 3]``: group, manager block id, first local slot
                to zero (0 zeroes the whole block).
            validate: check ranges first (skip only for pre-validated items).

        Returns:
            Items zeroed (0 means nothing was launched).
        """
        if len(items) == 0:
            return 0  # launch nothing, and skip the numpy work too
        live = self._live(items, validate)
        if not live.shape[0]:
            return 0
        if self._launcher is None:
            self._zero_torch(live)
        else:
            work, units = items_work(
                live,
                self._row_start,
                self._row_count,
                self._max_span,
                self.num_groups,
                launcher.BLOCK,  # read at call time: benchmarks/kernel_variants.py varies it
            )
            self._launcher.run(work, units)
        return int(live.shape[0])

    def _live(self, items: np.ndarray, validate: bool) -> np.ndarray:
        """The items that zero some byte."""
        items = np.asarray(items, dtype=np.int64).reshape(-1, 3)
        if validate:
            self.check_items(items)
        if items.shape[0] == 0:
            return items
        groups = items[:, 0]
        any_slots = np.asarray(self._any_slots, dtype=np.int64)[groups]
        live = (items[:, 2] < any_slots) & (self._row_count[groups] > 0)
        return items if live.all() else items[live]

    def _zero_torch(self, items: np.ndarray) -> None:
        """The torch path for live ``(group, block, first)`` items."""
        groups = items[:, 0]
        for g in np.unique(groups).tolist():
            sel = items[groups == g]
            self._torch[g].zero(sel[:, 1], sel[:, 2])

    def warmup(self) -> None:
        """Compile the kernel (and capture its graphs), touching no cache byte."""
        if self._launcher is not None:
            self._launcher.warmup()

    # ------------------------------------------ work encoded ahead (the worker)

    def rows_for(self, group: int, first: int) -> GroupRows | None:
        """Where the rows of an item of ``group`` zeroing from slot ``first``
        lie (any block: :func:`~kvtail_connector.ops.zero.plan.pack_line`
        packs its line); None where it zeroes nothing."""
        if first >= self._any_slots[group]:
            return None
        rows = (self._whole if first == 0 else self._tails)[group]
        return rows if rows.rows else None

    @property
    def launches_packed(self) -> bool:
        """:meth:`zero_packed` can launch (the Triton path)."""
        return self._launcher is not None

    def zero_packed(self, whole: bytes, tails: bytes) -> None:
        """Zero the items of packed lines (``pack_line`` with :meth:`rows_for`
        of this zeroer), whole blocks and tails apart, in one launch: a
        graph replay where they fit. The header states the widest shapes of
        any group, so lines need no per-call maxima. Needs
        :attr:`launches_packed`."""
        assert self._launcher is not None, "packed work exists on the Triton path only"
        if whole or tails:
            self._launcher.run(*packed_work(whole, tails, self._whole_shape, self._tail_shape))

    def stage(
        self, groups: Sequence[int], blocks_firsts: Sequence[tuple[int, int]]
    ) -> list[Callable[[], None] | None]:
        """Per group of ``groups``, a launch zeroing the ``(block, first slot)``
        items in that group, made ready now (None where it zeroes nothing):
        on Triton, groups of one row shape (the usual case: identical layers)
        share one work buffer, put on the device with one copy for all, each
        launch reading it with the group's own row table, so that a launch
        only enqueues the kernel (graph-capturable on CUDA). The launches
        record no event: call :meth:`record_done` after the last."""
        kernel_launcher = self._launcher
        if kernel_launcher is None:
            return [self._torch_launch(g, blocks_firsts) for g in groups]
        # Per row shape (the usual case: one): its work buffer, units and
        # offset in the one staged copy.
        buffers: dict[_OwnRows, tuple[bytes, int, int]] = {}
        offset = 0
        for own in dict.fromkeys(self._own_rows[g] for g in groups):
            work, units = same_items_work(blocks_firsts, own.tails, own.whole, own.any_slots)
            if units:
                # Each buffer starts 32-byte aligned (HEADER_WORDS + k * ITEM_COLS
                # int64), as the compiled kernel assumes of its work pointer.
                buffers[own] = (work, units, offset)
                offset += len(work) // 8
        if not buffers:
            return [None] * len(groups)
        base = kernel_launcher.stage(b"".join(work for work, _, _ in buffers.values()))
        launches: list[Callable[[], None] | None] = []
        for g in groups:
            found = buffers.get(self._own_rows[g])
            if found is None:
                launches.append(None)
                continue
            _, units, at = found
            launches.append(kernel_launcher.prepared(work_at(base, at), units, self._own_table(g)))
        return launches

    def _own_table(self, group: int) -> torch.Tensor:
        """``group``'s tail rows, then its whole-block rows: a fresh
        allocation (16-byte aligned, as the compiled kernel assumes)."""
        table = self._own_tables.get(group)
        if table is None:
            assert self._launcher is not None
            rows = self._launcher.rows
            tails, whole = self._tails[group], self._whole[group]
            table = self._own_tables[group] = torch.cat(
                [
                    rows[tails.start : tails.start + tails.rows],
                    rows[whole.start : whole.start + whole.rows],
                ]
            )
        return table

    def _torch_launch(
        self, group: int, blocks_firsts: Sequence[tuple[int, int]]
    ) -> Callable[[], None] | None:
        items = np.array([(group, b, f) for b, f in blocks_firsts], dtype=np.int64)
        live = self._live(items, validate=False)
        return functools.partial(self._zero_torch, live) if live.shape[0] else None

    def record_done(self) -> None:
        """Record :attr:`last_launch_done` behind every launch so far (CUDA)."""
        if self._launcher is not None:
            self._launcher.record_done()


def _implementation(requested: str, device: torch.device) -> Implementation:
    if requested == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if requested not in ("triton", "torch"):
        raise ValueError(f"implementation: expected 'auto', 'triton' or 'torch', got {requested!r}")
    if requested == "triton" and device.type != "cuda" and not launcher.interpreting():
        raise ValueError(
            "implementation: 'triton' needs CUDA caches, or TRITON_INTERPRET=1 for CPU caches"
        )
    return requested  # type: ignore[return-value]
