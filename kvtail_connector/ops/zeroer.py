""":class:`KVZeroer`: zero whole blocks and tails of several cache groups at once.

Row tables are derived once from the caches; each call turns its items into
one work buffer (a header and one line per item) and one kernel launch on
CUDA, or one vectorized torch pass per group elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from kvtail_connector.ops import launcher as L
from kvtail_connector.ops import torch_path
from kvtail_connector.ops.geometry import (
    CacheGeometry,
    RegionCache,
    Row,
    describe_caches,
    whole_block_rows,
)
from kvtail_connector.ops.integers import as_int
from kvtail_connector.ops.work import (
    Encoded,
    Line,
    line_work,
    parts_work,
    row_table,
    row_unit,
    same_items_work,
)

CacheLike = torch.Tensor | RegionCache
Backend = Literal["auto", "triton", "torch"]


@dataclass
class Prepared:
    """A staged launch: the work buffer is on the device; ``launch`` only enqueues it.

    Graph-capturable on CUDA (the staging copy happened in ``prepare``).
    """

    zeroer: KVZeroer
    items: np.ndarray  # validated live items (group, block, first)
    work: torch.Tensor | None  # None on the torch backend
    units: int

    @property
    def num_items(self) -> int:
        return int(self.items.shape[0])

    def launch(self) -> None:
        if self.work is None:
            self.zeroer._zero_torch(self.items)
        else:
            assert self.zeroer._launcher is not None, "triton backend has a launcher"
            self.zeroer._launcher.launch_staged(self.work, self.units)


@dataclass
class StagedGroups:
    """One staged launch per group (see :meth:`KVZeroer.stage_groups`).

    ``launch(k)`` only enqueues the kernel over the k-th group's part of one
    work buffer already on the device.
    """

    zeroer: KVZeroer
    base: torch.Tensor | None  # the device work buffer; None on the torch backend
    spans: list[tuple[int, int] | None]  # per group: (offset, work units); None: nothing
    lines: list[list[Line]]  # per group, for the torch backend (empty on Triton)

    def has_work(self, k: int) -> bool:
        return self.spans[k] is not None

    def launch(self, k: int, *, record_event: bool = True) -> None:
        """Zero the k-th group's items. ``record_event=False``: the caller calls
        :meth:`KVZeroer.record_done` after the last launch of a series."""
        span = self.spans[k]
        if span is None:
            return
        if self.base is None:
            self.zeroer.zero_lines(self.lines[k])
            return
        launcher = self.zeroer._launcher
        assert launcher is not None, "triton backend has a launcher"
        offset, units = span
        launcher.launch_staged(L.work_at(self.base, offset), units, record_event=record_event)


class KVZeroer:
    """Zero whole blocks and block tails across cache groups in one launch.

    Args:
        groups: per cache group, ``(caches, pages_per_block)``. ``caches`` are
            per-layer ``[B, H, N, C]`` views (any strides and dtype) or
            :class:`RegionCache` s; ``B = num_blocks * pages_per_block``.
            Groups may share tensors; each group reaches all of its caches.
        backend: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``),
            ``"torch"``, or ``"auto"``: Triton on CUDA, torch otherwise.
        use_graphs: on CUDA, replay small launches from CUDA graphs.
        hold_caches: keep references to the caches (the default). ``False``
            (Triton backend only) keeps nothing but their addresses and
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
        backend: Backend = "auto",
        use_graphs: bool = True,
        hold_caches: bool = True,
    ) -> None:
        self._geoms: list[list[CacheGeometry]] = []
        self._pages: list[int] = []
        self._num_blocks: list[int] = []
        # Per group: rows for tails (one per region and page) and rows for
        # whole blocks (merged spans); both live in one row table.
        slot_rows: list[list[Row]] = []
        block_rows: list[list[Row]] = []
        devices: set[torch.device] = set()
        for caches, pages in groups:
            pages_per_block = as_int("pages_per_block", pages, minimum=1)
            geoms = describe_caches(caches, pages_per_block)
            devices.update(g.tensor.device for g in geoms)
            self._geoms.append(geoms)
            self._pages.append(pages_per_block)
            self._num_blocks.append(min((g.num_pages // pages_per_block for g in geoms), default=0))
            # An empty view (a zero-sized H, N or C) has no byte to zero, and its
            # data_ptr may be 0: it gets no rows, so nothing is ever launched for it.
            live = [g for g in geoms if g.tensor.numel()]
            slot_rows.append(list(dict.fromkeys(r for g in live for r in g.rows(pages_per_block))))
            block_rows.append(whole_block_rows(live, pages_per_block))
        if len(devices) > 1:
            raise ValueError(
                f"caches: all caches must be on one device, got {sorted(map(str, devices))}"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        per_block = [
            [g.slots_per_page * p for g in gs]
            for gs, p in zip(self._geoms, self._pages, strict=True)
        ]
        # A first slot may reach the smallest block; past the largest one,
        # nothing is left to zero in any cache.
        self._max_first = np.array([min(x, default=0) for x in per_block], dtype=np.int64)
        self._any_slots = np.array([max(x, default=0) for x in per_block], dtype=np.int64)
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        if backend not in ("triton", "torch"):
            raise ValueError(f"backend: expected 'auto', 'triton' or 'torch', got {backend!r}")
        if backend == "triton" and self.device.type != "cuda" and not L.interpreting():
            raise ValueError(
                "backend: 'triton' needs CUDA caches, or TRITON_INTERPRET=1 for CPU caches"
            )
        self.backend: Backend = backend
        if not hold_caches and backend != "triton":
            raise ValueError("hold_caches: False needs the 'triton' backend (torch zeroes tensors)")

        # Row ranges: index g for group g's slot rows, n_groups + g for its block rows.
        all_lists = slot_rows + block_rows
        self._n_groups = len(slot_rows)
        self._row_count = np.array([len(rows) for rows in all_lists], dtype=np.int64)
        self._row_start = np.zeros_like(self._row_count)
        self._row_start[1:] = np.cumsum(self._row_count)[:-1]
        self._max_span = np.array(
            [
                max((r.n_slots * r.run // row_unit(r) for r in rows), default=0)
                for rows in all_lists
            ],
            dtype=np.int64,
        )
        self.num_rows = sum(len(rows) for rows in slot_rows)
        # The same facts as Python ints, for line() (no numpy per item).
        self._line_facts = [
            (int(start), int(count), -(-int(span) // L.BLOCK))
            for start, count, span in zip(
                self._row_start, self._row_count, self._max_span, strict=True
            )
        ]
        self._any_slots_list = [int(x) for x in self._any_slots]
        self._uniform: dict[
            tuple[int, ...], tuple[int, tuple[int, int], tuple[int, int]] | None
        ] = {}
        self._launcher: L.KernelLauncher | None = None
        if self.backend == "triton":
            table = torch.from_numpy(row_table([r for rows in all_lists for r in rows]))
            self._launcher = L.KernelLauncher(
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
        return int(self._max_first[group])

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
        limit = self._max_first[groups]
        bad = (firsts < 0) | (firsts > limit)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"{name}: first slot {int(firsts[i])} out of range [0, {int(limit[i])}] "
                f"(pages_per_block * slots per page)"
            )

    # ----------------------------------------------------------------- launch

    def _live(self, items: np.ndarray, validate: bool) -> np.ndarray:
        items = np.asarray(items, dtype=np.int64).reshape(-1, 3)
        if validate:
            self.check_items(items)
        if items.shape[0] == 0:
            return items
        groups = items[:, 0]
        live = (items[:, 2] < self._any_slots[groups]) & (self._row_count[groups] > 0)
        return items if live.all() else items[live]

    def encode(self, items: np.ndarray, *, validate: bool = True) -> Encoded:
        """Turn items into kernel work lines once, ahead of the launch.

        Callers that know their items before they must zero them (the worker,
        when load records arrive) encode early, so the launch itself only
        concatenates: see :meth:`zero_encoded`.
        """
        live = self._live(items, validate)
        whole = live[:, 2] == 0
        parts = []
        for kind, sel in ((0, whole), (1, ~whole)):
            chosen = live[sel]
            slot = chosen[:, 0] + (self._n_groups if kind == 0 else 0)
            lines = np.empty((chosen.shape[0], L.ITEM_COLS), dtype=np.int64)
            lines[:, 0] = chosen[:, 1]
            lines[:, 1] = chosen[:, 2]
            lines[:, 2] = self._row_start[slot]
            lines[:, 3] = self._row_count[slot]
            rows = int(lines[:, 3].max()) if len(lines) else 0
            chunks = -(-int(self._max_span[slot].max()) // L.BLOCK) if len(lines) else 0
            parts.append((lines, rows, chunks))
        (w, w_rows, w_chunks), (t, t_rows, t_chunks) = parts
        return Encoded(live, w, t, w_rows, w_chunks, t_rows, t_chunks)

    def line(self, group: int, block: int, first: int) -> Line | None:
        """One item as a kernel work line, built without numpy (for callers
        that assemble items one at a time); None when nothing is left to zero.
        The item is trusted: validate with :meth:`check_items` if it is not."""
        if first >= self._any_slots_list[group]:
            return None
        start, count, chunks = self._line_facts[group + (self._n_groups if first == 0 else 0)]
        if count == 0:
            return None
        return Line((group, block, first), (block, first, start, count), count, chunks)

    def zero_lines(self, lines: Sequence[Line]) -> int:
        """Zero the items of ``lines`` in one launch. Returns items zeroed."""
        if not lines:
            return 0
        if self._launcher is None:
            self._zero_torch(np.array([ln.item for ln in lines], dtype=np.int64))
            return len(lines)
        self._launcher.run(*line_work(lines))
        return len(lines)

    def stage_groups(
        self, groups: Sequence[int], blocks_firsts: Sequence[tuple[int, int]]
    ) -> StagedGroups:
        """Stage, for each of ``groups``, a later launch zeroing the same
        ``(block, first slot)`` items in that group, with one host-to-device copy.

        For layers that land one at a time (one group per layer). Groups of one
        geometry (the usual case: identical layers) are encoded together in
        numpy; others line by line. Items are trusted, as for :meth:`line`.
        """
        none: list[tuple[int, int] | None] = [None] * len(groups)
        if not groups or not blocks_firsts:
            return StagedGroups(self, None, none, [])
        if self._launcher is None:
            lines = [self._group_lines(g, blocks_firsts) for g in groups]
            return StagedGroups(self, None, [(0, 0) if x else None for x in lines], lines)
        uniform = self._uniform_facts(tuple(groups))
        if uniform is not None:
            index = np.asarray(groups, dtype=np.int64)
            starts = (self._row_start[index], self._row_start[self._n_groups + index])
            segments = same_items_work(starts, blocks_firsts, *uniform)
        else:
            batches = [self._group_lines(g, blocks_firsts) for g in groups]
            segments = [line_work(batch) if batch else None for batch in batches]
        spans: list[tuple[int, int] | None] = []
        offset = 0
        for seg in segments:
            if seg is None:
                spans.append(None)
            else:
                spans.append((offset, seg[1]))
                offset += seg[0].size
        if offset == 0:
            return StagedGroups(self, None, none, [])
        # Every segment starts 32-byte aligned (8 + 4k int64), as the compiled
        # kernel assumes of its work pointer (16-byte divisibility).
        base = self._launcher.stage(np.concatenate([seg[0] for seg in segments if seg]))
        return StagedGroups(self, base, spans, [])

    def _group_lines(self, group: int, blocks_firsts: Sequence[tuple[int, int]]) -> list[Line]:
        """The live lines of ``(block, first slot)`` items in ``group``."""
        return [ln for ln in (self.line(group, b, f) for b, f in blocks_firsts) if ln]

    def _uniform_facts(
        self, groups: tuple[int, ...]
    ) -> tuple[int, tuple[int, int], tuple[int, int]] | None:
        """What encoding needs of ``groups`` if they all share it, else None
        (cached: callers stage the same groups step after step)."""
        if groups not in self._uniform:
            facts = [
                (
                    self._any_slots_list[g],
                    (self._line_facts[g][1], self._line_facts[g][2]),
                    (
                        self._line_facts[self._n_groups + g][1],
                        self._line_facts[self._n_groups + g][2],
                    ),
                )
                for g in groups
            ]
            self._uniform[groups] = facts[0] if all(f == facts[0] for f in facts) else None
        return self._uniform[groups]

    def record_done(self) -> None:
        """Record :attr:`last_launch_done` behind every launch so far (CUDA)."""
        if self._launcher is not None:
            self._launcher.record_done()

    def zero_encoded(self, parts: Sequence[Encoded]) -> int:
        """Zero everything ``parts`` describe, in one launch. Returns items zeroed."""
        parts = [p for p in parts if p.num_items]
        if not parts:
            return 0
        if self._launcher is None:
            self._zero_torch(np.concatenate([p.items for p in parts]))
        else:
            self._launcher.run(*parts_work(parts))
        return sum(p.num_items for p in parts)

    def prepare(self, items: np.ndarray, *, validate: bool = True) -> Prepared | None:
        """Validate and stage ``items`` for one launch; None if nothing to zero."""
        encoded = self.encode(items, validate=validate)
        if encoded.num_items == 0:
            return None
        if self._launcher is None:
            return Prepared(self, encoded.items, None, 0)
        work, units = parts_work([encoded])
        return Prepared(self, encoded.items, self._launcher.stage(work), units)

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
        return self.zero_encoded([self.encode(items, validate=validate)])

    def _zero_torch(self, items: np.ndarray) -> None:
        groups = items[:, 0]
        for g in np.unique(groups):
            sel = items[groups == g]
            torch_path.zero_group(self._geoms[int(g)], self._pages[int(g)], sel[:, 1], sel[:, 2])

    def warmup(self) -> None:
        """Compile the kernel (and capture its graphs), touching no cache byte."""
        if self._launcher is not None:
            self._launcher.warmup()
