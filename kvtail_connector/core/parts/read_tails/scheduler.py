"""MoRIIO READ tails, scheduler half: READ destinations out of vLLM's zero
list, and a record for each READ whose tail block the READ overwrites.

Synchronous READs overwrite their destination blocks; zeroing them too can
land after the RDMA READ and wipe the KV. vLLM allows a sync READ connector to
drop them from ``new_block_ids_to_zero`` (``KVConnectorBase_V1.build_connector_meta``).
MoRIIO does so itself only on Mamba hybrids, for every attention group (Mamba
pages are never on the list); on other models that need zeroing this part
drops them, from every group (``TailPolicy.excludes_reads``). Either way the
READ brings the producer's stale tail with it: its record goes to the
workers, which zero it, in every attention group, once the READ has landed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtail_connector.connectors import InnerAdapter
from kvtail_connector.core.extension import SchedulerExtra
from kvtail_connector.core.metadata import LoadRecord
from kvtail_connector.core.parts.records import LoadRecords
from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.log import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class _PendingRead:
    """A READ of tokens ``[local, loaded)`` of ``request`` into ``blocks``;
    ``allocated``: what the extra said of it at the allocation."""

    request: Any
    blocks: Any
    local: int
    loaded: int
    allocated: Any


class ReadTailsScheduler:
    """READ loads allocated this step, until its metadata is built.

    Args:
        records: the record builder.
        adapter: what differs for this inner connector (its READ destinations).
        stats: the counters this side reports.
        zeroes_read_tails: ship READ tail records (``TailPolicy.zeroes_read_tails``).
        excludes_reads: drop READ destinations from vLLM's zero list
            (``TailPolicy.excludes_reads``).
        extra: the opt-in features (told of each READ's record: a producer
            claim may cover its tail), or None.
    """

    def __init__(
        self,
        records: LoadRecords,
        adapter: InnerAdapter,
        stats: KVTailStats,
        *,
        zeroes_read_tails: bool,
        excludes_reads: bool,
        extra: SchedulerExtra | None,
    ) -> None:
        self._records = records
        self._adapter = adapter
        self._stats = stats
        self._zero = zeroes_read_tails
        self._exclude = excludes_reads
        self._extra = extra
        # Their records wait for build_connector_meta, which knows the step's tokens.
        self._pending: list[_PendingRead] = []

    def allocated(self, request: Any, blocks: Any, local: int, loaded: int, allocated: Any) -> None:
        """A READ of tokens ``[local, loaded)`` was allocated (``allocated``:
        what the extra said of it, for :meth:`SchedulerExtra.read_load`)."""
        if self._zero:
            self._pending.append(_PendingRead(request, blocks, local, loaded, allocated))

    def build(
        self, scheduler_output: Any, inner_meta: Any
    ) -> tuple[tuple[LoadRecord, ...], list[int] | None]:
        """``(READ records, vLLM's zero list without READ destinations or None
        where unchanged)``; the caller sets the list, last."""
        exclude = self._exclude and bool(scheduler_output.new_block_ids_to_zero)
        if not (exclude or self._pending):
            return (), None
        # request id -> every block its READ writes this step (all groups)
        reads = {
            req_id: {b for ids in per_group for b in ids}
            for req_id, per_group in self._adapter.read_destinations(inner_meta)
        }
        kept = self._without_read_destinations(scheduler_output, reads) if exclude else None
        records: tuple[LoadRecord, ...] = ()
        if self._pending:
            records = self._read_records(scheduler_output.num_scheduled_tokens, reads)
        return records, kept

    def _read_records(
        self, num_scheduled: dict[str, int], reads: dict[str, set[int]]
    ) -> tuple[LoadRecord, ...]:
        """Records of this step's READ loads whose tail block the READ overwrites.

        A READ copies whole producer blocks: the producer's KV, valid for its
        whole prompt, and its stale tail after it. ``num_loaded`` is therefore
        the prompt length (MoRIIO reads all but the last prompt token, which
        this step recomputes into the same slot, with the same KV). The step's
        forward may write past it: vLLM pads a new decode to ``1 + k`` rows
        under speculative decoding, and on 0.32 a layer's READ can land after
        the backend wrote them (KV update before attention), putting the
        producer's tail back there; those slots hold nothing valid either way.
        A tail block the READ does not write was zeroed by vLLM, and 0.32's
        MoRIIO also "matches" consumer requests with no remote prefill:
        neither gets a record.
        """
        out = []
        builder = self._records
        for read in self._pending:
            request = read.request
            dests = reads.get(request.request_id)
            step = num_scheduled.get(request.request_id, 0)
            if not dests or step <= 0:
                continue
            valid = min(read.loaded + step, int(request.num_prompt_tokens))
            record = builder.record(request, read.blocks, read.local, valid, tails_only=True)
            if record is not None and any(
                load.block_ids[k - load.first_block] in dests
                for load in record.groups
                if (k := builder.tail_index(record.num_loaded, load.group)) is not None
            ):
                if self._extra is not None:
                    self._extra.read_load(request, read.allocated, record)
                out.append(record)
        self._pending.clear()
        return tuple(out)

    def _without_read_destinations(
        self, scheduler_output: Any, reads: dict[str, set[int]]
    ) -> list[int] | None:
        dests = set().union(*reads.values())
        if not dests:
            return None
        before = scheduler_output.new_block_ids_to_zero
        kept = [b for b in before if b not in dests]
        removed = len(before) - len(kept)
        if not removed:
            return None
        self._stats.add("read_blocks_exempted", removed)
        logger.debug("kvtail: %d READ destination block(s) kept from zeroing", removed)
        return kept

    def clear(self) -> None:
        self._pending.clear()

    def held(self) -> set[str]:
        return {read.request.request_id for read in self._pending}

    @property
    def num_tracked(self) -> int:
        return len(self._pending)
