"""Scheduler side: note where each load ends, ship it to the workers once.

At ``get_num_new_matched_tokens`` the wrapper learns the local computed count
and whether the inner load is async; at ``update_state_after_alloc`` it gets
the blocks and the external token count. That is everything a worker needs to
find the load's stale tail, so a :class:`LoadRecord` goes into this step's
metadata and the scheduler keeps nothing about the request afterwards.
"""

from __future__ import annotations

from typing import Any

from kvtail_connector import _compat
from kvtail_connector.connectors import InnerAdapter
from kvtail_connector.kvgroups import GroupInfo
from kvtail_connector.log import get_logger
from kvtail_connector.metadata import NULL_BLOCK, GroupLoad, KVTailMetadata, LoadRecord
from kvtail_connector.policy import TailPolicy
from kvtail_connector.stats import KVTailStats
from kvtail_connector.tails import tail_block

logger = get_logger(__name__)


class TailScheduler:
    """The wrapper's scheduler-side state around the inner connector.

    Args:
        inner: the wrapped connector (scheduler role).
        groups: tail facts per KV cache group.
        policy: what to record (``zero_tails``, ``record_every_load``,
            ``zero_read_tails``) and whether to exclude READ destinations.
        adapter: what differs for this inner connector.
    """

    def __init__(
        self,
        inner: Any,
        groups: tuple[GroupInfo, ...],
        policy: TailPolicy,
        *,
        adapter: InnerAdapter,
        stats: KVTailStats,
    ) -> None:
        self._inner = inner
        self._groups = groups
        self._policy = policy
        self._adapter = adapter
        self._stats = stats
        # req_id -> (local computed tokens, load is async) from the latest
        # get_num_new_matched_tokens with a positive hit; consumed at alloc.
        self._matched: dict[str, tuple[int, bool]] = {}
        self._pending: list[LoadRecord] = []
        # READ loads allocated this step: (request, blocks, local, loaded). Their
        # records wait for build_connector_meta, which knows the step's tokens.
        self._pending_reads: list[tuple[Any, Any, int, int]] = []
        # Every async load until vLLM reports it finished: the blocks it
        # writes (to map invalid block ids to requests), and whether its
        # failure was counted already (errors may precede the completion).
        self._in_flight: dict[str, frozenset[int]] = {}
        self._failed: set[str] = set()

    # ----------------------------------------------------------------- hooks

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        count, load_async = self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
        if count:
            self._matched[request.request_id] = (num_computed_tokens, bool(load_async))
        else:
            self._matched.pop(request.request_id, None)
        return count, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._inner.update_state_after_alloc(request, blocks, num_external_tokens)
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or matched is None:
            return
        local, load_async = matched
        if load_async:
            self._in_flight[request.request_id] = frozenset(
                self._written_blocks(request, blocks, local, local + num_external_tokens)
            )
        if load_async and not self._policy.zero_tails:
            return
        if not load_async:
            if self._policy.zero_read_tails:
                self._pending_reads.append((request, blocks, local, local + num_external_tokens))
            return  # other sync loads land in blocks vLLM zeroed first
        record = self._record(request, blocks, local, local + num_external_tokens)
        if record is not None:
            self._pending.append(record)

    def build_connector_meta(self, scheduler_output: Any) -> KVTailMetadata:
        inner_meta = self._inner.build_connector_meta(scheduler_output)
        exclude = self._policy.exclude_reads and bool(scheduler_output.new_block_ids_to_zero)
        read_loads: tuple[LoadRecord, ...] = ()
        if exclude or self._pending_reads:
            # request id -> every block its READ writes this step (all groups)
            reads = {
                req_id: {b for ids in per_group for b in ids}
                for req_id, per_group in self._adapter.read_destinations(inner_meta)
            }
            if exclude:
                self._drop_read_destinations(scheduler_output, reads)
            if self._pending_reads:
                read_loads = self._read_records(scheduler_output.num_scheduled_tokens, reads)
        meta = KVTailMetadata(inner=inner_meta, loads=tuple(self._pending), read_loads=read_loads)
        if self._pending or read_loads:
            logger.debug(
                "kvtail: shipping %d load(s), %d READ load(s)", len(self._pending), len(read_loads)
            )
        self._pending.clear()
        return meta

    def request_finished(self, request: Any) -> None:
        self._matched.pop(request.request_id, None)

    def update_connector_output(self, connector_output: Any) -> None:
        """Count each failed async load once: reported in ``failed_recving``,
        or holding a block of ``invalid_block_ids`` (both aggregated over the
        workers by vLLM), then forget the loads reported finished."""
        if not self._in_flight:
            return
        failed = set(connector_output.failed_recving or ()) & self._in_flight.keys()
        invalid = connector_output.invalid_block_ids
        if invalid:
            failed.update(
                r for r, blocks in self._in_flight.items() if not blocks.isdisjoint(invalid)
            )
        new = failed - self._failed
        if new:
            self._stats.add("failed_loads", len(new))
            self._failed |= new
        for req_id in connector_output.finished_recving or ():
            if self._in_flight.pop(req_id, None) is not None:
                self._failed.discard(req_id)

    def held_requests(self) -> int:
        """Requests this side holds state for (the ``held_requests`` gauge)."""
        held = self._matched.keys() | self._in_flight.keys()
        held.update(r.req_id for r in self._pending)
        held.update(req.request_id for req, *_ in self._pending_reads)
        return len(held)

    # ---------------------------------------------------------------- helpers

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
        records = []
        for request, blocks, local, loaded in self._pending_reads:
            dests = reads.get(request.request_id)
            step = num_scheduled.get(request.request_id, 0)
            if not dests or step <= 0:
                continue
            valid = min(loaded + step, int(request.num_prompt_tokens))
            record = self._record(request, blocks, local, valid, tails_only=True)
            if record is not None and any(
                load.block_ids[k - load.first_block] in dests
                for load in record.groups
                if (k := self._tail_index(record.num_loaded, load.group)) is not None
            ):
                records.append(record)
        self._pending_reads.clear()
        return tuple(records)

    def _tail_index(self, num_loaded: int, group: int) -> int | None:
        tail = tail_block(num_loaded, self._groups[group].effective_block)
        return None if tail is None else tail[0]

    def _written_blocks(self, request: Any, blocks: Any, local: int, loaded: int) -> list[int]:
        """The non-null blocks a load of tokens ``[local, loaded)`` writes, all groups."""
        block_ids = blocks.get_block_ids()
        out: list[int] = []
        for gid in self._inner.get_loaded_kv_cache_group_ids(request):
            eb = self._groups[gid].effective_block
            out.extend(b for b in block_ids[gid][local // eb : -(-loaded // eb)])
        return [b for b in out if b != _compat.NULL_BLOCK_ID]

    def _record(
        self, request: Any, blocks: Any, local: int, loaded: int, *, tails_only: bool = False
    ) -> LoadRecord | None:
        block_ids = blocks.get_block_ids()
        loaded_groups = self._inner.get_loaded_kv_cache_group_ids(request)
        entries = []
        any_tail = False
        for gid in loaded_groups:
            info = self._groups[gid]
            if not info.has_tails:
                continue
            eb = info.effective_block
            any_tail = any_tail or tail_block(loaded, eb) is not None
            first = local // eb
            last = -(-loaded // eb)  # one past the last block the load writes
            ids = tuple(block_ids[gid][first:last])
            if _compat.NULL_BLOCK_ID in ids:  # sliding-window gaps: vLLM's null block
                ids = tuple(NULL_BLOCK if i == _compat.NULL_BLOCK_ID else i for i in ids)
            entries.append(GroupLoad(group=gid, first_block=first, block_ids=ids))
        if not entries or not (any_tail or (self._policy.record_every_load and not tails_only)):
            return None  # block-aligned: nothing stale to zero, nothing to watch
        return LoadRecord(request.request_id, local, loaded, tuple(entries))

    def _drop_read_destinations(self, scheduler_output: Any, reads: dict[str, set[int]]) -> None:
        """Synchronous READs overwrite their destination blocks; zeroing them too
        can land after the RDMA READ. vLLM allows a sync READ connector to drop
        them (KVConnectorBase_V1.build_connector_meta); do it for every group."""
        dests = set().union(*reads.values())
        if not dests:
            return
        before = scheduler_output.new_block_ids_to_zero
        kept = [b for b in before if b not in dests]
        removed = len(before) - len(kept)
        if removed:
            scheduler_output.new_block_ids_to_zero = kept
            self._stats.add("read_blocks_exempted", removed)
            logger.debug("kvtail: %d READ destination block(s) kept from zeroing", removed)

    @property
    def num_tracked(self) -> int:
        """Requests with wrapper state (0 when idle: the leak check)."""
        return (
            len(self._matched)
            + len(self._pending)
            + len(self._pending_reads)
            + len(self._in_flight)
            + len(self._failed)
        )
