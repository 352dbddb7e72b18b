"""The worker's launch paths: items encoded as they arrive, launched once per step.

Package-private (for ``kvtail_connector.worker`` and ``read_tails``): the
public way in is :meth:`KVZeroer.zero`. These paths zero exactly what it
would, but split the work so that the launch itself costs the least host
time:

- :meth:`StepZeroer.line` encodes one item in pure Python when its load
  record arrives; :meth:`StepZeroer.zero_lines` launches a step's lines at
  once;
- :meth:`StepZeroer.stage_groups` puts one launch per layer on the device
  with one copy; each :meth:`StagedGroups.launch` then only enqueues the
  kernel (graph-capturable on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from kvtail_connector.ops.zero.launcher import work_at
from kvtail_connector.ops.zero.plan import Line, line_work, same_items_work, tail_work
from kvtail_connector.ops.zero.zeroer import KVZeroer

# What encoding needs of a group: any-cache slots, (count, chunks) of its tail
# rows and of its whole-block rows.
_GroupFacts = tuple[int, tuple[int, int], tuple[int, int]]


@dataclass
class StagedGroups:
    """One staged launch per group (see :meth:`StepZeroer.stage_groups`).

    ``launch(k)`` only enqueues the kernel over the k-th group's part of one
    work buffer already on the device.
    """

    zeroer: StepZeroer
    base: torch.Tensor | None  # the device work buffer; None on the torch path
    spans: list[tuple[int, int] | None]  # per group: (offset, work units); None: nothing
    lines: list[list[Line]]  # per group, for the torch path (empty on Triton)

    def __post_init__(self) -> None:
        # Each group's launch, made ready once: a launch per layer only enqueues.
        base, launcher = self.base, self.zeroer._launcher
        self._launches: list[Callable[[], None] | None] = [
            None
            if base is None or span is None or launcher is None
            else launcher.bound_staged(work_at(base, span[0]), span[1])
            for span in self.spans
        ]

    def has_work(self, k: int) -> bool:
        return self.spans[k] is not None

    @property
    def units(self) -> int:
        """Work units of every staged launch together."""
        return sum(span[1] for span in self.spans if span is not None)

    def launch(self, k: int, *, record_event: bool = True) -> None:
        """Zero the k-th group's items. ``record_event=False``: the caller calls
        :meth:`StepZeroer.record_done` after the last launch of a series."""
        launch = self._launches[k]
        if launch is None:
            if self.spans[k] is not None:  # the torch path
                self.zeroer.zero_lines(self.lines[k])
            return
        launch()
        if record_event:
            self.zeroer.record_done()


class SharedTails(NamedTuple):
    """One work buffer of tails that several groups' launches read, each with
    its own row table (see :meth:`StepZeroer.stage_shared`)."""

    work: torch.Tensor  # on the device
    launch: Callable[[Any, torch.Tensor], None]  # (work, a group's table): no event


class StepZeroer(KVZeroer):
    """A :class:`KVZeroer` with the worker's pre-encoded launch paths.

    Items given to these paths are trusted (the worker derives them from
    the caches it registered): validate with :meth:`check_items` if not.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Per tuple of staged groups: their shared encoding facts, or None.
        self._uniform: dict[tuple[int, ...], _GroupFacts | None] = {}

    def line(self, group: int, block: int, first: int) -> Line | None:
        """One item as a kernel work line, built without numpy (for callers
        that assemble items one at a time); None when nothing is left to zero."""
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
        self._launcher.run_lines(lines)
        return len(lines)

    @property
    def launches_packed(self) -> bool:
        """:meth:`zero_packed` is available (the Triton path)."""
        return self._launcher is not None

    def tail_shape(self) -> tuple[int, int]:
        """The most rows and chunks a tail line of any group has: a header
        with these covers every tail line (the kernel skips the rows and
        chunks a line lacks), so packed lines need no per-step maximum."""
        facts = self._line_facts[: self._n_groups]
        return max((f[1] for f in facts), default=0), max((f[2] for f in facts), default=0)

    def zero_packed(self, packed: bytes, n_tail: int, rows: int, chunks: int) -> None:
        """Zero ``n_tail`` tail lines given packed (their work columns as the
        kernel's buffer holds them, joined; at least their largest row and
        chunk counts) in one launch: a graph replay where a slot holds them.
        Needs :attr:`launches_packed`."""
        assert self._launcher is not None, "packed work exists on the Triton path only"
        self._launcher.run_packed(packed, n_tail, rows, chunks)

    def stage_groups(
        self, groups: Sequence[int], blocks_firsts: Sequence[tuple[int, int]]
    ) -> StagedGroups:
        """Stage, for each of ``groups``, a later launch zeroing the same
        ``(block, first slot)`` items in that group, with one host-to-device copy.

        For layers that land one at a time (one group per layer). Groups of one
        geometry (the usual case: identical layers) are encoded together in
        numpy; others line by line.
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
        # Every segment starts 32-byte aligned (HEADER_WORDS + k * ITEM_COLS
        # int64), as the compiled kernel assumes of its work pointer.
        base = self._launcher.stage(np.concatenate([seg[0] for seg in segments if seg]))
        return StagedGroups(self, base, spans, [])

    def layer_tables(self, groups: Sequence[int]) -> list[torch.Tensor] | None:
        """Per group of ``groups``, a row table of its own holding only that
        group's tail rows (first row 0), for :meth:`stage_shared`; None where
        the groups differ in geometry or this is the torch path. Built once:
        each is a fresh allocation (16-byte aligned, as the kernel assumes)."""
        if self._launcher is None or self._uniform_facts(tuple(groups)) is None:
            return None
        rows = self._launcher.rows
        return [
            rows[start : start + count].clone()
            for start, count, _ in map(self._line_facts.__getitem__, groups)
        ]

    def stage_shared(
        self, groups: Sequence[int], blocks_firsts: Sequence[tuple[int, int]]
    ) -> SharedTails | None:
        """Stage one work buffer zeroing the ``(block, first slot)`` tails in
        any of ``groups`` (one geometry, :meth:`layer_tables`), each launch
        reading it with that group's own table: a layer's launch then costs
        the kernel launch alone, and staging one copy, whatever the layers.
        None where it cannot (a whole block, whose rows the tables lack;
        nothing to zero; groups of different geometry; the torch path): use
        :meth:`stage_groups`."""
        facts = self._uniform_facts(tuple(groups))
        launcher = self._launcher
        if facts is None or launcher is None or not blocks_firsts:
            return None
        any_slots, (count, chunks), _ = facts
        bf = np.asarray(blocks_firsts, dtype=np.int64).reshape(-1, 2)
        if not count or (bf[:, 1] == 0).any():
            return None
        tails = bf[bf[:, 1] < any_slots]
        if not len(tails):
            return None
        work, units = tail_work(tails, count, chunks)
        return SharedTails(launcher.stage(work), launcher.launch_with(units))

    def record_done(self) -> None:
        """Record :attr:`last_launch_done` behind every launch so far (CUDA)."""
        if self._launcher is not None:
            self._launcher.record_done()

    def _group_lines(self, group: int, blocks_firsts: Sequence[tuple[int, int]]) -> list[Line]:
        """The live lines of ``(block, first slot)`` items in ``group``."""
        return [ln for ln in (self.line(group, b, f) for b, f in blocks_firsts) if ln]

    def _uniform_facts(self, groups: tuple[int, ...]) -> _GroupFacts | None:
        """What encoding needs of ``groups`` if they all share it, else None
        (cached: callers stage the same groups step after step)."""
        if groups not in self._uniform:
            n = self._n_groups
            facts = [
                (
                    self._any_slots_list[g],
                    (self._line_facts[g][1], self._line_facts[g][2]),
                    (self._line_facts[n + g][1], self._line_facts[n + g][2]),
                )
                for g in groups
            ]
            self._uniform[groups] = facts[0] if all(f == facts[0] for f in facts) else None
        return self._uniform[groups]
