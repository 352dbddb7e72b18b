"""What the worker-side parts share: this rank's caches and its step zeroer.

Every part that zeroes (consumer tails, failed loads, producer claims, READ
tails) builds its work through :class:`RankZeroing` and launches through it,
so a step's zeroing of every part is one launch, one byte count and one CUDA
event (``start_load_kv``'s fence waits for it). It holds no per-request state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import compress
from typing import Any, NamedTuple

import numpy as np
import torch

from kvtail_connector.cache_sets import CacheSet, TailBytes
from kvtail_connector.kvgroups import GroupInfo
from kvtail_connector.log import get_logger
from kvtail_connector.metadata import NULL_BLOCK, LoadRecord
from kvtail_connector.ops.zero._step_zeroer import StepZeroer
from kvtail_connector.ops.zero.plan import ITEM_STRUCT, Line, packed_line, packed_lines
from kvtail_connector.probe import probe_items
from kvtail_connector.stats import KVTailStats
from kvtail_connector.tails import first_stale_slot, tail_block

logger = get_logger(__name__)

Item = tuple[int, int, int]  # (cache set index, manager block, first slot to zero)
# What packing one tail line needs but its block: (first slot, first row, rows).
_PackFacts = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class RankPlacement:
    """Where this worker sits in decode context parallelism."""

    dcp_rank: int = 0
    dcp_world_size: int = 1
    interleave: int = 1


class Zeroing(NamedTuple):
    """Kernel work lines for one request, and the bytes they zero (a tuple:
    one per load, on the per-step path).

    ``packed``, ``rows``, ``chunks``: the lines' work columns as the kernel's
    buffer holds them and their largest row and chunk counts, set together
    with ``packable`` (by :func:`_zeroing` only) where every line is a tail: a
    step's launch then joins bytes, whatever the number of loads.
    """

    owner: str
    lines: list[Line]
    nbytes: int
    packed: bytes = b""
    rows: int = 0
    chunks: int = 0
    packable: bool = False


def _zeroing(owner: str, lines: list[Line], nbytes: int) -> Zeroing:
    if not lines:  # nothing to launch: joins as no bytes
        return Zeroing(owner, lines, nbytes, packable=True)
    if len(lines) == 1:  # the usual load: one cache set
        line = lines[0]
        if not line.item[2]:
            return Zeroing(owner, lines, nbytes)
        return Zeroing(owner, lines, nbytes, packed_line(line), line.rows, line.chunks, True)
    if not all(ln.item[2] for ln in lines):  # a whole block: line_work orders it first
        return Zeroing(owner, lines, nbytes)
    return Zeroing(
        owner,
        lines,
        nbytes,
        packed_lines(lines),
        max([ln.rows for ln in lines]),
        max([ln.chunks for ln in lines]),
        True,
    )


@dataclass(frozen=True)
class _SetInfo:
    index: int  # zeroer group
    tokens_per_state: int | Fraction


class RankZeroing:
    """This rank's cache sets, its zeroer and the event behind its last launch.

    Args:
        groups: tail facts per KV cache group.
        placement: this rank's DCP placement.
        stats: the counters this side reports.
        probe: count stale bytes before zeroing (``probe_stale_tails``).
        counts_requests: this rank reports the per-request counters (one
            rank per request: vLLM sums every worker's stats).
    """

    def __init__(
        self,
        groups: tuple[GroupInfo, ...],
        placement: RankPlacement,
        stats: KVTailStats,
        *,
        probe: bool,
        counts_requests: bool,
    ) -> None:
        self.groups = groups
        # Per group, for the per-load paths (GroupInfo computes them).
        self._block_tokens = tuple(g.effective_block for g in groups)
        self._has_tails = tuple(g.has_tails for g in groups)
        self.placement = placement
        self.stats = stats
        self.probe = probe
        self.counts_requests = counts_requests
        self.zeroer: StepZeroer | None = None
        self.sets: list[CacheSet] = []
        self.tail_bytes = TailBytes((), ())
        self._sets_of_group: dict[int, list[_SetInfo]] = {}
        # (group, valid tokens in the tail block) -> what each of its sets'
        # lines needs but the block: (set, first slot, line facts, bytes).
        self._tail_facts: dict[
            tuple[int, int], list[tuple[int, int, tuple[int, int, int], int]]
        ] = {}
        # (group, valid tokens) -> (its sets' tail lines but the block, their
        # bytes; None: some set's line is a whole block, not packable).
        self._pack_facts: dict[tuple[int, int], tuple[_PackFacts | None, int]] = {}
        # The widest tail line of any set: the header of every packed launch.
        self._tail_shape = (0, 0)
        # Recorded behind the latest launch of any part: start_load_kv's fence.
        self.last_zeroing: torch.cuda.Event | None = None
        # Sleep mode: the zeroer unregister_kv_caches put away (see release()).
        self._released: tuple[StepZeroer | None] | None = None

    # ------------------------------------------------------------ lifecycle

    def register(self, sets: list[CacheSet]) -> None:
        """Map ``sets`` (non-empty) and warm the zeroer up; supersedes any
        zeroer put away by sleep mode."""
        self._released = None
        self.sets = sets
        self.zeroer = StepZeroer([(s.caches, s.pages_per_block) for s in sets])
        self._sets_of_group = {}
        for i, s in enumerate(sets):
            self._sets_of_group.setdefault(s.group_id, []).append(_SetInfo(i, s.tokens_per_state))
        self.tail_bytes = TailBytes.of(sets)
        self._tail_facts = {}
        self._pack_facts = {}
        self._tail_shape = self.zeroer.tail_shape()
        self.zeroer.warmup()

    @property
    def released(self) -> bool:
        """Sleep mode released the KV memory: nothing can be zeroed or read."""
        return self._released is not None

    def release(self) -> None:
        self._released = (self.zeroer,)
        self.zeroer = None

    def restore(self) -> None:
        if self._released is not None:
            (self.zeroer,) = self._released
            self._released = None

    def forget_released(self) -> None:
        """New caches supersede what sleep mode put away (never restored)."""
        self._released = None

    def fence(self) -> None:
        """Before the inner connector starts a load, earlier zeroing has executed.

        A transfer that bypasses the stream (RDMA) into a block freed and
        reallocated since could otherwise land before a zeroing of that block
        enqueued in an earlier step.
        """
        event = self.last_zeroing
        if event is not None and not event.query():
            event.synchronize()

    def mark_zeroed(self) -> None:
        """Zeroing was just enqueued on the current stream without the
        zeroer's launch (the reference path): the fence waits for it too,
        as for a launch (CUDA; nothing to wait for elsewhere)."""
        zeroer = self.zeroer
        if zeroer is not None:
            zeroer.record_done()
            event = zeroer.last_launch_done
            if event is not None:  # no launcher (the torch path): none recorded
                self.last_zeroing = event

    # ------------------------------------------------------------------ work

    def zeroing(self, owner: str, items: list[Item]) -> Zeroing:
        """Work lines for ``items``, built in Python: a handful of items per
        request, where numpy costs more."""
        zeroer = self.zeroer
        if zeroer is None or not items:
            return Zeroing(owner, [], 0)
        lines = [ln for ln in (zeroer.line(*item) for item in items) if ln is not None]
        tail_bytes = self.tail_bytes
        nbytes = sum(tail_bytes(g, first) for g, _, first in (ln.item for ln in lines))
        return _zeroing(owner, lines, nbytes)

    def tail_zeroing(self, record: LoadRecord) -> Zeroing:
        """``zeroing(record.req_id, tail_items(record))``."""
        return self.tail_work(record)[0]

    def tail_work(self, record: LoadRecord) -> tuple[Zeroing, bool]:
        """``(tail_zeroing(record), has_tail(record))`` in one pass, from facts
        kept per (group, valid tokens): a record costs a few tuples, whatever
        the layers."""
        encode = self.zeroer is not None
        lines: list[Line] = []
        nbytes = 0
        has_tail = False
        block_tokens = self._block_tokens
        for load in record.groups:
            k, n = divmod(record.num_loaded, block_tokens[load.group])
            if not n:
                continue
            idx = k - load.first_block
            if not 0 <= idx < len(load.block_ids):
                continue
            block = load.block_ids[idx]
            if block == NULL_BLOCK:
                continue
            has_tail = has_tail or self._has_tails[load.group]
            if not encode:
                continue
            facts = self._tail_facts.get((load.group, n))
            if facts is None:
                facts = self._tail_facts[(load.group, n)] = self._facts_of(load.group, n)
            for index, first, (start, count, chunks), size in facts:
                lines.append(
                    Line((index, block, first), (block, first, start, count), count, chunks)
                )
                nbytes += size
        return _zeroing(record.req_id, lines, nbytes), has_tail

    def tail_pack(self, record: LoadRecord) -> tuple[bytes | None, int, bool]:
        """``(packed, nbytes, has_tail)`` of ``record``'s tail: its lines packed
        as the kernel's work buffer holds them (:meth:`zero_packed`; None where
        they cannot be: no caches registered, or a line zeroes a whole block),
        the bytes they zero, and :meth:`has_tail`. One pass over the record's
        groups, from facts kept per (group, valid tokens), whatever the layers."""
        if self.zeroer is None or not self._tail_shape[0]:
            return None, 0, self.has_tail(record)
        packed = b""
        nbytes = 0
        has_tail = False
        # Per load on the bind path: locals, each field read once.
        block_tokens, has_tails, pack_facts = self._block_tokens, self._has_tails, self._pack_facts
        pack, num_loaded = ITEM_STRUCT.pack, record.num_loaded
        for group, first_block, block_ids in record.groups:
            k, n = divmod(num_loaded, block_tokens[group])
            if not n:
                continue
            idx = k - first_block
            if not 0 <= idx < len(block_ids):
                continue
            block = block_ids[idx]
            if block == NULL_BLOCK:
                continue
            has_tail = has_tail or has_tails[group]
            found = pack_facts.get((group, n))
            if found is None:
                found = pack_facts[(group, n)] = self._pack_facts_of(group, n)
            facts, size = found
            if facts is None:
                return None, 0, self.has_tail(record)
            for first, start, count in facts:
                packed += pack(block, first, start, count)
            nbytes += size
        return packed, nbytes, has_tail

    def _pack_facts_of(self, group: int, n: int) -> tuple[_PackFacts | None, int]:
        facts = self._tail_facts.get((group, n))
        if facts is None:
            facts = self._tail_facts[(group, n)] = self._facts_of(group, n)
        if any(not first for _, first, _, _ in facts):  # a whole-block line
            return None, 0
        return (
            tuple((first, start, count) for _, first, (start, count, _), _ in facts),
            sum(size for *_, size in facts),
        )

    def zero_packed(self, packed: bytes, nbytes: int) -> None:
        """One launch for tail lines packed by :meth:`tail_pack` (joined), under
        the widest tail shape; ``nbytes`` counted once launched. Needs
        :attr:`launches_packed`."""
        n = len(packed) // ITEM_STRUCT.size
        if not n:
            return
        zeroer = self.zeroer
        assert zeroer is not None
        zeroer.zero_packed(packed, n, *self._tail_shape)
        self.stats.add("tail_bytes_zeroed", nbytes)  # launched
        # Recorded behind the launch by the zeroer: start_load_kv's fence.
        self.last_zeroing = zeroer.last_launch_done
        logger.debug("kvtail: zeroed %d tail item(s) in one launch", n)

    @property
    def launches_packed(self) -> bool:
        """:meth:`zero_packed` can launch (caches registered, the Triton path)."""
        zeroer = self.zeroer
        return zeroer is not None and zeroer.launches_packed

    def _facts_of(self, group: int, n: int) -> list[tuple[int, int, tuple[int, int, int], int]]:
        zeroer = self.zeroer
        assert zeroer is not None
        info = self.groups[group]
        sharded = info.dcp_size > 1
        placement = self.placement
        out = []
        for s in self._sets_of_group.get(group, ()):
            first = first_stale_slot(
                n,
                dcp_rank=placement.dcp_rank if sharded else 0,
                dcp_world_size=info.dcp_size,
                interleave=placement.interleave if sharded else 1,
                tokens_per_state=s.tokens_per_state,
            )
            line = zeroer.line(s.index, 0, first)
            if line is not None:
                _, (_, _, start, count), _, chunks = line
                out.append(
                    (s.index, first, (start, count, chunks), self.tail_bytes(s.index, first))
                )
        return out

    def tail_items(self, record: LoadRecord) -> list[Item]:
        """The never-written slots of ``record``'s last block, per cache set."""
        items = []
        placement = self.placement
        for load in record.groups:
            info = self.groups[load.group]
            tail = tail_block(record.num_loaded, info.effective_block)
            if tail is None:
                continue
            k, n = tail
            idx = k - load.first_block
            if not 0 <= idx < len(load.block_ids):
                continue
            block = load.block_ids[idx]
            if block == NULL_BLOCK:
                continue
            sharded = info.dcp_size > 1
            for s in self._sets_of_group.get(load.group, ()):
                first = first_stale_slot(
                    n,
                    dcp_rank=placement.dcp_rank if sharded else 0,
                    dcp_world_size=info.dcp_size,
                    interleave=placement.interleave if sharded else 1,
                    tokens_per_state=s.tokens_per_state,
                )
                items.append((s.index, block, first))
        return items

    def block_items(self, group: int, blocks: Any) -> list[Item]:
        """Whole ``blocks`` of ``group`` (non-null ones), in every set of the group."""
        sets = self._sets_of_group.get(group, ())
        return [(s.index, b, 0) for b in blocks if b != NULL_BLOCK for s in sets]

    def has_tail(self, record: LoadRecord) -> bool:
        """Whether ``record`` leaves a stale tail in some group: the same answer
        on every rank (a DCP rank whose share of the block is full has none of
        its own to zero, yet the request still counts once)."""
        for load in record.groups:
            info = self.groups[load.group]
            tail = tail_block(record.num_loaded, info.effective_block)
            if info.has_tails and tail is not None:
                idx = tail[0] - load.first_block
                if 0 <= idx < len(load.block_ids) and load.block_ids[idx] != NULL_BLOCK:
                    return True
        return False

    def zero(
        self,
        batches: Sequence[Zeroing],
        counter: str = "tail_bytes_zeroed",
        *,
        probe: bool = True,
    ) -> set[str]:
        """One launch for every line of ``batches`` (probed first where the
        probe is on and ``probe``); bytes counted once launched. Returns the
        owners of the batches with lines (none where nothing is registered)."""
        zeroer = self.zeroer
        if zeroer is None or not batches:
            return set()
        owners, lines, nbytes, packed, rows, chunks, packable = zip(*batches, strict=True)
        n = sum(map(len, lines))
        if not n:
            return set()
        flat: list[Line] | None = None
        if probe and self.probe:
            flat = [ln for group in lines for ln in group]
            self.report_found(
                probe_items(
                    self.sets,
                    np.array([ln.item for ln in flat], dtype=np.int64),
                    [b.owner for b in batches for _ in b.lines],
                )
            )
        if all(packable) and zeroer.launches_packed:
            zeroer.zero_packed(b"".join(packed), n, max(rows), max(chunks))
        else:
            zeroer.zero_lines(flat if flat is not None else [ln for g in lines for ln in g])
        self.stats.add(counter, sum(nbytes))  # launched
        # Recorded behind the launch by the zeroer: start_load_kv's fence.
        self.last_zeroing = zeroer.last_launch_done
        logger.debug("kvtail: zeroed %d tail item(s) in one launch", n)
        return set(compress(owners, lines))

    # ------------------------------------------------------------- counting

    def count_tails(self, requests: int) -> None:
        """Per-request counters, on the counting rank only."""
        if requests and self.counts_requests:
            self.stats.add("tails_zeroed", requests)
            if self.probe:
                self.stats.add("probed_tails", requests)

    def report_found(self, found: dict[str, tuple[int, int]]) -> None:
        """The probe's findings, per request: ``(non-zero bytes, non-finite values)``."""
        for req_id, (nonzero, nonfinite) in found.items():
            self.stats.add("stale_nonzero_bytes", nonzero)
            self.stats.add("stale_nonfinite_values", nonfinite)
            if nonfinite:
                logger.warning(
                    "KVTailConnector: request %s: the loaded KV's stale tail held %d non-finite "
                    "value(s) (%d non-zero bytes); zeroing them before any read",
                    req_id,
                    nonfinite,
                    nonzero,
                )
