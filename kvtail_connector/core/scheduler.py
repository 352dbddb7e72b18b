"""Scheduler side: routes vLLM's scheduler-side connector hooks to the core
parts and to the extra.

:class:`TailScheduler` holds no feature state. The core parts
(``kvtail_connector/core/parts/<feature>/scheduler.py``) are built from the
policy, present only where it turns them on, and share the load's start
(:class:`~kvtail_connector.core.parts.load_starts.LoadStarts`) and the record
builder (:class:`~kvtail_connector.core.parts.records.LoadRecords`). What the
opt-in features add (producer claims, KV verification: the ``kvtail``
entry) comes as one :class:`~kvtail_connector.core.extension.SchedulerExtra`,
which the assembly builds; this module imports none of it. The order, hook
by hook:

``on_new_request``
    the extra (a producer notes the prefill legs it serves).
``get_num_new_matched_tokens``
    load starts.
``get_loaded_kv_cache_group_ids``
    the answer vLLM got, kept for the allocation that follows.
``update_state_after_alloc``
    the extra first (:meth:`TailScheduler.read_entry`, before the inner
    update: it reads the entry), then after the inner update: a synchronous
    READ goes to READ tails (with what the extra says of it); an async load
    gets its record (consumer tails), which the extra may keep, mark or
    attach to.
``build_connector_meta``
    the extra's step records (producer tails, producer digests); READ tails
    (records, and vLLM's zero list without READ destinations, set last); the
    step's async loads go to load errors (in flight) and their records into
    the metadata, with the loads to report failed.
``request_finished``
    load starts, the extra (params kept until the connector output of the
    same ``update_from_output``).
``update_connector_output``
    the extra (grants, then false claims and verdicts of loads in flight),
    then load errors (failures counted, finished loads forgotten).
"""

from __future__ import annotations

from typing import Any

from kvtail_connector.connectors import InnerAdapter
from kvtail_connector.core.extension import SchedulerExtra
from kvtail_connector.core.kvgroups import GroupInfo
from kvtail_connector.core.metadata import KVTailMetadata, KVTailWorkerMeta, LoadRecord
from kvtail_connector.core.parts.consumer_tails.scheduler import (
    AllocatedLoad,
    ConsumerTailsScheduler,
)
from kvtail_connector.core.parts.load_errors.scheduler import LoadErrorsScheduler
from kvtail_connector.core.parts.load_starts import LoadStart, LoadStarts
from kvtail_connector.core.parts.read_tails.scheduler import ReadTailsScheduler
from kvtail_connector.core.parts.records import LoadRecords
from kvtail_connector.core.policy import TailPolicy
from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.log import get_logger

logger = get_logger(__name__)


class TailScheduler:
    """The wrapper's scheduler side: the core parts the policy turns on, in
    order, and the extra (producer claims, KV verification) where one is given.

    Args:
        inner: the wrapped connector (scheduler role).
        groups: tail facts per KV cache group.
        policy: what this engine does (see :class:`~kvtail_connector.core.policy.TailPolicy`).
        adapter: what differs for this inner connector.
        stats: the counters this side reports.
        records: the record builder, shared with the extra (built here if None).
        extra: what the opt-in features add
            (:class:`~kvtail_connector.core.extension.SchedulerExtra`), or None.
    """

    def __init__(
        self,
        inner: Any,
        groups: tuple[GroupInfo, ...],
        policy: TailPolicy,
        *,
        adapter: InnerAdapter,
        stats: KVTailStats,
        records: LoadRecords | None = None,
        extra: SchedulerExtra | None = None,
    ) -> None:
        self._policy = policy
        self._adapter = adapter  # what differs for the inner connector (READ destinations)
        self._kv_cache_manager: Any = None
        self._records = records or LoadRecords(
            inner, groups, records_every_load=policy.records_every_load
        )
        self._extra = extra
        self._starts = LoadStarts()
        self._errors = LoadErrorsScheduler(stats)
        self._tails = ConsumerTailsScheduler()
        # The request vLLM last asked get_loaded_kv_cache_group_ids for, and
        # the answer it got: the groups it keeps from zeroing in the
        # allocation that follows, which the load's record must cover.
        self._asked: tuple[Any, tuple[int, ...]] | None = None
        self._reads = (
            ReadTailsScheduler(
                self._records,
                self._adapter,
                stats,
                zeroes_read_tails=policy.zeroes_read_tails,
                excludes_reads=policy.excludes_reads,
                extra=extra,
            )
            if policy.zeroes_read_tails or policy.excludes_reads
            else None
        )
        holders = (self._starts, self._errors, self._tails, self._reads, extra)
        self._holders = tuple(part for part in holders if part is not None)

    # ----------------------------------------------------------------- hooks

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Any) -> None:
        """A producer notes the remote-decode prefill legs it vouches for or digests."""
        if self._extra is not None:
            self._extra.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int, count: int | None, load_async: bool
    ) -> None:
        """The inner connector matched ``count`` external tokens after
        ``num_computed_tokens`` local ones: kept to the allocation."""
        self._starts.matched(request.request_id, num_computed_tokens, count, load_async)

    def get_loaded_kv_cache_group_ids(self, request: Any, groups: Any) -> Any:
        """vLLM asked which groups ``request``'s load writes and got ``groups``
        (the inner connector's answer): kept as a tuple for the allocation
        that follows. Returns what vLLM reads: ``groups`` as given, or the
        tuple an iterator was spent into."""
        if type(groups) is tuple:
            self._asked = (request, groups)
            return groups
        try:
            it = iter(groups)
        except TypeError:
            # No iterable (vLLM only tests membership): the allocation asks
            # again, and contains what that raises.
            self._asked = None
            return groups
        kept = tuple(it)  # what the inner's iterable raises is its own
        self._asked = (request, kept)
        return kept if it is groups else groups

    def read_entry(self, request: Any) -> None:
        """Before the inner ``update_state_after_alloc`` of a load: the extra
        reads the producer's entry, while the params still hold what its
        binding covers (NIXL push rewrites ``remote_block_ids`` there)."""
        if self._extra is None:
            return
        start = self._starts.get(request.request_id)
        if start is not None:
            self._extra.before_allocation(request, start.is_async)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """After the inner ``update_state_after_alloc`` (called by the facade),
        and after :meth:`read_entry` (called before it). vLLM calls it twice
        per load, the second time with nothing loaded."""
        req_id = request.request_id
        start = self._starts.pop(req_id)
        if start is None or num_external_tokens <= 0:
            return
        loaded = start.local + num_external_tokens
        try:
            if start.is_async:
                self._tails.add(self._allocated(request, blocks, start, loaded))
            else:
                # A READ (other sync loads land in blocks vLLM zeroed first).
                allocated = self._extra.sync_load(request) if self._extra is not None else None
                if self._reads is not None:
                    self._reads.allocated(request, blocks, start.local, loaded, allocated)
        except BaseException:
            self._starts.put_back(req_id, start)  # for contain_alloc
            raise

    def _allocated(self, request: Any, blocks: Any, start: LoadStart, loaded: int) -> AllocatedLoad:
        """An async load of tokens ``[start.local, loaded)``: the blocks it
        writes and its record (the extra's, where one is given)."""
        req_id = request.request_id
        asked = self._asked
        if asked is not None and asked[0] is request:
            groups = asked[1]
            self._asked = None
        else:
            groups = self._records.loaded_groups(request)
        written = self._records.written(blocks, groups, start.local, loaded)
        zeroes_tails = self._policy.zeroes_tails

        def build(keep: bool) -> LoadRecord | None:
            if not (zeroes_tails or keep):
                return None
            return self._records.from_written(
                req_id, written, start.local, loaded, groups, keep=keep
            )

        extra = self._extra
        record = (
            extra.async_load(request, loaded, blocks, groups, build)
            if extra is not None
            else build(False)
        )
        return AllocatedLoad(req_id, written, record)

    def build_connector_meta(self, scheduler_output: Any, inner_meta: Any) -> KVTailMetadata:
        """``inner_meta``: what the inner ``build_connector_meta`` returned."""
        read_loads, kept = (
            self._reads.build(scheduler_output, inner_meta)
            if self._reads is not None
            else ((), None)
        )
        allocated = self._tails.peek()
        loads = tuple(load.record for load in allocated if load.record is not None)
        meta = KVTailMetadata(
            inner=inner_meta,
            loads=loads,
            read_loads=read_loads,
            failing=tuple(self._errors.failing),
            extra=(
                self._extra.step_payload(scheduler_output, self._kv_cache_manager)
                if self._extra is not None
                else None
            ),
        )
        if loads or read_loads:
            logger.debug(
                "kvtail: shipping %d load(s), %d READ load(s)", len(loads), len(read_loads)
            )
        # Shipped: nothing below may raise (dict writes only). Until here a
        # failure leaves every load pending for contain_meta, and vLLM's zero
        # list untouched (it then zeroes the READ destinations as without
        # the wrapper).
        for load in self._tails.take():
            self._errors.started(load.req_id, load.written)
        self._errors.take_failing()
        if kept is not None:
            scheduler_output.new_block_ids_to_zero = kept
        return meta

    def request_finished(self, request: Any, params: dict[str, Any] | None) -> None:
        """``params``: what the inner connector's ``request_finished`` returned,
        the very dict vLLM puts into the request's output."""
        self._drop(request.request_id)
        if self._extra is not None:
            self._extra.request_finished(request, params)

    def update_connector_output(
        self, connector_output: Any, worker_meta: KVTailWorkerMeta | None = None
    ) -> None:
        """The extra grants and counts first, then each failed async load is
        counted once and the loads reported finished are forgotten.

        ``worker_meta``: the wrapper's worker metadata of the step being
        processed (aggregated over the workers), unwrapped by the facade.
        """
        errors, extra = self._errors, self._extra
        if extra is not None:
            extra.update_connector_output(connector_output, worker_meta, errors.in_flight)
        if not errors.in_flight:
            return
        done = errors.settle(connector_output)
        if extra is not None and done:
            extra.loads_finished(done)

    # ------------------------------------------------- contained failures
    # The fallbacks the facade runs after an internal error in a hook
    # (kvtail_connector.core.containment): minimal, and never half a claim.

    def contain_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """``update_state_after_alloc`` failed: the load may have no record.
        An async load is reported failed by the workers when it completes
        (and counted in ``failed_loads``: tracked in flight). A synchronous
        READ never completes in ``finished_recving`` and its destinations
        leave vLLM's zero list: it stays a pending READ, without a claim
        (the entry is not read again), so its tail is still zeroed."""
        req_id = request.request_id
        start = self._starts.pop(req_id)
        if self._extra is not None:
            self._extra.contain_alloc(req_id)
        if num_external_tokens <= 0 or start is None:
            return  # no load the wrapper would have recorded
        if start.is_async:
            self._errors.lost(req_id)
        elif self._reads is not None:
            self._reads.allocated(
                request, blocks, start.local, start.local + num_external_tokens, None
            )

    @property
    def pending_loads(self) -> list[str]:
        """Requests whose load record waits for this step's metadata."""
        return [*self._errors.failing, *self._tails.held()]

    def contain_meta(self, inner_meta: Any) -> KVTailMetadata:
        """``build_connector_meta`` failed: the inner metadata, untouched; the
        step's pending async loads are reported failed at completion, its
        READ and producer records are not shipped (no claim is made)."""
        for load in self._tails.take():
            if load.record is None:
                # Nothing for the workers to zero or check: in flight as shipped.
                self._errors.started(load.req_id, load.written)
            else:
                # Now among the failing, its blocks in flight (invalid ones match).
                self._errors.lost(load.req_id, load.written)
        if self._reads is not None:
            self._reads.clear()
        if self._extra is not None:
            self._extra.contain_meta()
        return KVTailMetadata(inner=inner_meta, failing=self._errors.take_failing())

    def contain_output(self, connector_output: Any) -> None:
        """``update_connector_output`` failed: no claim from this call; loads
        reported finished are forgotten."""
        # The extra first: it drops the params left for a grant before
        # anything below can raise on a malformed output.
        if self._extra is not None:
            self._extra.contain_output(connector_output)
        for req_id in tuple(connector_output.finished_recving or ()):
            self._errors.finished((req_id,))

    def forget(self, req_id: str) -> None:
        """``on_new_request`` or ``request_finished`` failed for ``req_id``:
        no claim for it."""
        self._drop(req_id)
        if self._extra is not None:
            self._extra.forget(req_id)

    def _drop(self, req_id: str) -> None:
        """The core's state of a request that ended: its match, and the
        answer vLLM got for an allocation that never came."""
        self._starts.pop(req_id)
        if self._asked is not None and self._asked[0].request_id == req_id:
            self._asked = None

    # ----------------------------------------------------------- accounting

    def held_requests(self) -> int:
        """Requests this side holds state for (the ``held_requests`` gauge)."""
        held = [ids for part in self._holders if (ids := part.held())]
        if len(held) <= 1:
            return len(held[0]) if held else 0
        return len(set().union(*held))

    @property
    def num_tracked(self) -> int:
        """Entries every part still holds (0 when idle: the leak check)."""
        parts = (self._starts, self._errors, self._tails, self._reads, self._extra)
        return sum(part.num_tracked for part in parts if part is not None)
