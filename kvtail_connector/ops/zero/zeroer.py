""":class:`KVZeroer`: zero whole blocks and tails of several cache groups at once.

Row tables are derived once from the caches; each :meth:`KVZeroer.zero` call
turns its items into one work buffer (a header and one line per item) and
one kernel launch on CUDA, or one vectorized torch pass per group elsewhere.
The worker's pre-encoded variants of that call live in ``ops/zero/_step_zeroer.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

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
from kvtail_connector.ops.zero.plan import Encoded, encoded_work, row_table, row_unit
from kvtail_connector.ops.zero.work_schema import ITEM_COLS, ITEM_COLUMN

CacheLike = torch.Tensor | RegionCache
Implementation = Literal["auto", "triton", "torch"]


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
        slot_rows: list[list[Row]] = []
        block_rows: list[list[Row]] = []
        all_geoms: list[CacheGeometry] = []
        for caches, pages in groups:
            pages_per_block = as_int("pages_per_block", pages, minimum=1)
            geoms = describe_caches(caches, pages_per_block)
            all_geoms.extend(geoms)
            self._geoms.append(geoms)
            self._pages.append(pages_per_block)
            self._num_blocks.append(min((g.num_pages // pages_per_block for g in geoms), default=0))
            # An empty view (a zero-sized H, N or C) has no byte to zero, and its
            # data_ptr may be 0: it gets no rows, so nothing is ever launched for it.
            live = [g for g in geoms if g.tensor.numel()]
            slot_rows.append(list(dict.fromkeys(r for g in live for r in g.rows(pages_per_block))))
            block_rows.append(whole_block_rows(live, pages_per_block))
        self.device = one_device(all_geoms)
        per_block = [
            [g.slots_per_page * p for g in gs]
            for gs, p in zip(self._geoms, self._pages, strict=True)
        ]
        # A first slot may reach the smallest block; past the largest one,
        # nothing is left to zero in any cache.
        self._max_first = np.array([min(x, default=0) for x in per_block], dtype=np.int64)
        self._any_slots = np.array([max(x, default=0) for x in per_block], dtype=np.int64)
        if implementation == "auto":
            implementation = "triton" if self.device.type == "cuda" else "torch"
        if implementation not in ("triton", "torch"):
            raise ValueError(
                f"implementation: expected 'auto', 'triton' or 'torch', got {implementation!r}"
            )
        if (
            implementation == "triton"
            and self.device.type != "cuda"
            and not launcher.interpreting()
        ):
            raise ValueError(
                "implementation: 'triton' needs CUDA caches, or TRITON_INTERPRET=1 for CPU caches"
            )
        self.implementation: Implementation = implementation
        if not hold_caches and implementation != "triton":
            raise ValueError(
                "hold_caches: False needs implementation='triton' "
                "(torch zeroes through the tensors)"
            )

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
            (int(start), int(count), -(-int(span) // launcher.BLOCK))
            for start, count, span in zip(
                self._row_start, self._row_count, self._max_span, strict=True
            )
        ]
        self._any_slots_list = [int(x) for x in self._any_slots]
        self._launcher: launcher.KernelLauncher | None = None
        self._torch: list[torch_path.GroupZeroing] = []
        if self.implementation == "torch":
            self._torch = [
                torch_path.GroupZeroing(geoms, pages)
                for geoms, pages in zip(self._geoms, self._pages, strict=True)
            ]
        if self.implementation == "triton":
            table = torch.from_numpy(row_table([r for rows in all_lists for r in rows]))
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

    def _encode(self, items: np.ndarray, *, validate: bool) -> Encoded:
        """Items as kernel work lines (numpy, all at once)."""
        live = self._live(items, validate)
        whole = live[:, 2] == 0
        parts = []
        for kind, sel in ((0, whole), (1, ~whole)):
            chosen = live[sel]
            slot = chosen[:, 0] + (self._n_groups if kind == 0 else 0)
            lines = np.empty((chosen.shape[0], ITEM_COLS), dtype=np.int64)
            lines[:, ITEM_COLUMN["block"]] = chosen[:, 1]
            lines[:, ITEM_COLUMN["first_slot"]] = chosen[:, 2]
            lines[:, ITEM_COLUMN["first_row"]] = self._row_start[slot]
            lines[:, ITEM_COLUMN["row_count"]] = self._row_count[slot]
            rows = int(self._row_count[slot].max()) if len(lines) else 0
            # Read at call time: benchmarks/kernel_variants.py varies BLOCK.
            chunks = -(-int(self._max_span[slot].max()) // launcher.BLOCK) if len(lines) else 0
            parts.append((lines, rows, chunks))
        (w, w_rows, w_chunks), (t, t_rows, t_chunks) = parts
        return Encoded(live, w, t, w_rows, w_chunks, t_rows, t_chunks)

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
        if self._launcher is None:
            live = self._live(items, validate)
            self._zero_torch(live)
            return int(live.shape[0])
        encoded = self._encode(items, validate=validate)
        if encoded.num_items == 0:
            return 0
        self._launcher.run(*encoded_work(encoded))
        return encoded.num_items

    def _zero_torch(self, items: np.ndarray) -> None:
        """The torch path for live ``(group, block, first)`` items."""
        if not items.shape[0]:
            return
        groups = items[:, 0]
        first_group = int(groups[0])
        if (groups == first_group).all():  # the usual case: one group per call
            self._torch[first_group].zero(items[:, 1], items[:, 2])
            return
        for g in np.unique(groups):
            sel = items[groups == g]
            self._torch[int(g)].zero(sel[:, 1], sel[:, 2])

    def warmup(self) -> None:
        """Compile the kernel (and capture its graphs), touching no cache byte."""
        if self._launcher is not None:
            self._launcher.warmup()
