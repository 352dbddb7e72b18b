"""What the worker-side parts share to zero: this rank's caches, and one launch per step.

Every part that zeroes (consumer tails, failed loads, producer claims, READ
tails) describes what a request leaves stale as :class:`StaleSlots`, built by
:class:`RankCaches` where the request becomes known, and launches a step's
work through :meth:`RankCaches.zero`: a step's zeroing of every part is one
launch, one byte count and one CUDA event (``start_load_kv``'s fence waits
for it). Nothing here holds per-request state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvtail_connector.core.cache_sets import CacheSet, TailBytes
from kvtail_connector.core.kvgroups import GroupInfo
from kvtail_connector.core.metadata import NULL_BLOCK, GroupLoad, LoadRecord
from kvtail_connector.core.probe import probe_items
from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.core.tails import first_stale_slot
from kvtail_connector.log import get_logger
from kvtail_connector.ops import KVZeroer
from kvtail_connector.ops.zero.plan import GroupRows, pack_line

logger = get_logger(__name__)

Item = tuple[int, int, int]  # (cache set index, manager block, first slot to zero)


@dataclass(frozen=True)
class RankPlacement:
    """Where this worker sits in decode context parallelism."""

    dcp_rank: int = 0
    dcp_world_size: int = 1
    interleave: int = 1


@dataclass(slots=True)
class StaleSlots:
    """What one request leaves stale on this rank, encoded for the kernel
    where it becomes known, so that a step's launch only joins bytes.

    Attributes:
        owner: the request.
        items: ``(cache set, block, first slot)`` of each stale run; what the
            probe reads and the torch path zeroes.
        whole, tails: the items' kernel work lines (``plan.pack_line``),
            whole blocks and tails apart, as the kernel orders them.
        nbytes: the bytes they zero.
    """

    owner: str
    items: list[Item]
    whole: bytes
    tails: bytes
    nbytes: int


class _SetTail(NamedTuple):
    """One cache set's part of a tail of ``n`` valid tokens, but its block."""

    set_index: int
    first: int  # first stale slot
    rows: GroupRows  # where its rows lie (pack_line)
    nbytes: int


class RankCaches:
    """This rank's cache sets and zeroer, what each load leaves stale on
    them, and the event behind their last zeroing.

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
        self._block_tokens = tuple(g.effective_block for g in groups)
        self.placement = placement
        self.stats = stats
        self.probe = probe
        self.counts_requests = counts_requests
        self.zeroer: KVZeroer | None = None
        self.sets: list[CacheSet] = []
        self._tail_bytes = TailBytes((), ())
        # Per group, the indices of its sets.
        self._sets_of_group: dict[int, list[int]] = {}
        # (group, valid tokens in the tail block) -> its sets' parts of the
        # tail: a load's tail costs a lookup per group, whatever the layers.
        self._set_tails: dict[tuple[int, int], tuple[_SetTail, ...]] = {}
        # Recorded behind the latest launch of any part: start_load_kv's fence.
        self.last_zeroing: torch.cuda.Event | None = None
        # Sleep mode: the zeroer unregister_kv_caches put away (see release()).
        self._released: tuple[KVZeroer | None] | None = None

    # ------------------------------------------------------------ lifecycle

    def register(self, sets: list[CacheSet]) -> None:
        """Map ``sets`` (non-empty) and warm the zeroer up; supersedes any
        zeroer put away by sleep mode."""
        self._released = None
        self.sets = sets
        self.zeroer = KVZeroer([(s.caches, s.pages_per_block) for s in sets])
        self._sets_of_group = {}
        for i, s in enumerate(sets):
            self._sets_of_group.setdefault(s.group_id, []).append(i)
        self._tail_bytes = TailBytes.of(sets)
        self._set_tails = {}
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

    # ---------------------------------------------------- what loads leave stale

    def _tail_block(self, record: LoadRecord, load: GroupLoad) -> tuple[int, int] | None:
        """``(block, valid tokens)`` of ``load``'s partially loaded block, unless
        the load ends on a block boundary or that block is the null block."""
        k, n = divmod(record.num_loaded, self._block_tokens[load.group])
        index = k - load.first_block
        if not n or not 0 <= index < len(load.block_ids):
            return None
        block = load.block_ids[index]
        return None if block == NULL_BLOCK else (block, n)

    def has_tail(self, record: LoadRecord) -> bool:
        """Whether ``record`` leaves a stale tail in some group: the same answer
        on every rank (a DCP rank whose share of the block is full has none of
        its own to zero, yet the request still counts once)."""
        for load in record.groups:
            if self.groups[load.group].has_tails and self._tail_block(record, load):
                return True
        return False

    def tail_items(self, record: LoadRecord) -> list[Item]:
        """The never-written slots of ``record``'s last block on this rank, per
        cache set, as plain items: what the reference path zeroes, apart from
        the zeroer's encoding."""
        items = []
        for load in record.groups:
            tail = self._tail_block(record, load)
            if tail is not None:
                block, n = tail
                items += [(s, block, first) for s, first in self._first_stale_slots(load.group, n)]
        return items

    def stale_tail(self, record: LoadRecord) -> StaleSlots:
        """:meth:`tail_items` encoded (nothing where no caches are registered)."""
        items: list[Item] = []
        whole: list[bytes] = []
        tails: list[bytes] = []
        nbytes = 0
        for load in record.groups:
            tail = self._tail_block(record, load) if self.zeroer is not None else None
            if tail is None:
                continue
            block, n = tail
            for part in self._tail_parts(load.group, n):
                items.append((part.set_index, block, part.first))
                (tails if part.first else whole).append(pack_line(block, part.first, part.rows))
                nbytes += part.nbytes
        return StaleSlots(record.req_id, items, b"".join(whole), b"".join(tails), nbytes)

    def packed_tail(self, record: LoadRecord) -> tuple[bytes | None, int, bool]:
        """:meth:`stale_tail`'s tail lines (None: a whole-block line, or no
        caches), their bytes and :meth:`has_tail`, in one pass, for
        :meth:`zero_packed_tails`. Tuned: bind runs it per load, at 1.0 µs
        against 2.1 µs for those two (CPU, 64 loads of 80 layers), under
        bind's budget of 2 µs per load (``benchmarks/RESULTS.md``, "Worker
        side on the GPU": bind, 64 loads, per load; 0.9-1.9 µs on the H200's
        host)."""
        packed = b""
        nbytes = 0
        has_tail = False
        packable = self.zeroer is not None
        for load in record.groups:
            k, n = divmod(record.num_loaded, self._block_tokens[load.group])
            index = k - load.first_block
            if not n or not 0 <= index < len(load.block_ids):
                continue
            block = load.block_ids[index]
            if block == NULL_BLOCK:
                continue
            has_tail = has_tail or self.groups[load.group].has_tails
            if not packable:
                continue
            for part in self._tail_parts(load.group, n):
                packable = packable and part.first > 0  # a whole block: not a tail line
                packed += pack_line(block, part.first, part.rows)
                nbytes += part.nbytes
        return (packed if packable else None), nbytes, has_tail

    def _tail_parts(self, group: int, n: int) -> tuple[_SetTail, ...]:
        """Each set's part of a tail of ``n`` valid tokens in ``group``, where
        it has something to zero (needs the zeroer); kept per (group, n)."""
        parts = self._set_tails.get((group, n))
        if parts is None:
            zeroer = self.zeroer
            assert zeroer is not None
            found = []
            for set_index, first in self._first_stale_slots(group, n):
                rows = zeroer.rows_for(set_index, first)
                if rows is not None:
                    nbytes = self._tail_bytes(set_index, first)
                    found.append(_SetTail(set_index, first, rows, nbytes))
            parts = self._set_tails[(group, n)] = tuple(found)
        return parts

    def _first_stale_slots(self, group: int, n: int) -> Iterator[tuple[int, int]]:
        """``(set index, first stale slot)`` per set of ``group``, for a tail
        of ``n`` valid tokens."""
        info, placement = self.groups[group], self.placement
        sharded = info.dcp_size > 1
        for set_index in self._sets_of_group.get(group, ()):
            first = first_stale_slot(
                n,
                dcp_rank=placement.dcp_rank if sharded else 0,
                dcp_world_size=info.dcp_size,
                interleave=placement.interleave if sharded else 1,
                tokens_per_state=self.sets[set_index].tokens_per_state,
            )
            yield set_index, first

    def stale_blocks(
        self, owner: str, blocks_by_group: Iterable[tuple[int, Sequence[int]]]
    ) -> StaleSlots:
        """Whole blocks (the non-null ones) of each ``(group, blocks)``, in every
        set of the group (nothing where no caches are registered)."""
        items: list[Item] = []
        lines: list[bytes] = []
        nbytes = 0
        zeroer = self.zeroer
        if zeroer is None:
            return StaleSlots(owner, items, b"", b"", nbytes)
        for group, blocks in blocks_by_group:
            for set_index in self._sets_of_group.get(group, ()):
                rows = zeroer.rows_for(set_index, 0)
                if rows is None:
                    continue
                for block in blocks:
                    if block != NULL_BLOCK:
                        items.append((set_index, block, 0))
                        lines.append(pack_line(block, 0, rows))
                        nbytes += self._tail_bytes(set_index, 0)
        return StaleSlots(owner, items, b"".join(lines), b"", nbytes)

    # ------------------------------------------------------------- launching

    def zero(
        self,
        batches: Sequence[StaleSlots],
        counter: str = "tail_bytes_zeroed",
        *,
        probe: bool = True,
    ) -> None:
        """One launch for every item of ``batches`` (probed first where the
        probe is on and ``probe``); bytes counted once launched."""
        zeroer = self.zeroer
        if zeroer is None or not any([b.items for b in batches]):
            return
        if probe and self.probe:
            owners = [b.owner for b in batches for _ in b.items]
            items = np.array([item for b in batches for item in b.items], dtype=np.int64)
            self.report_found(probe_items(self.sets, items, owners))
        if zeroer.launches_packed:
            zeroer.zero_packed(
                b"".join([b.whole for b in batches]), b"".join([b.tails for b in batches])
            )
        else:
            items = np.array([item for b in batches for item in b.items], dtype=np.int64)
            zeroer.zero(items, validate=False)
        self._launched(counter, sum([b.nbytes for b in batches]))

    @property
    def launches_packed(self) -> bool:
        """:meth:`zero_packed_tails` can launch (caches registered, the Triton path)."""
        return self.zeroer is not None and self.zeroer.launches_packed

    def zero_packed_tails(self, tails: bytes, nbytes: int) -> None:
        """One launch for :meth:`packed_tail` lines, joined; ``nbytes`` counted
        once launched. Not probed. Needs :attr:`launches_packed`."""
        zeroer = self.zeroer
        assert zeroer is not None
        if tails:
            zeroer.zero_packed(b"", tails)
            self._launched("tail_bytes_zeroed", nbytes)

    def _launched(self, counter: str, nbytes: int) -> None:
        self.stats.add(counter, nbytes)
        # Recorded behind the launch by the zeroer: start_load_kv's fence.
        self.last_zeroing = self.zeroer.last_launch_done if self.zeroer is not None else None
        logger.debug("kvtail: zeroed %d byte(s) of stale slots in one launch", nbytes)

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
