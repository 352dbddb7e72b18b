"""Scheduler side: routes vLLM's scheduler-side connector hooks to the feature parts.

:class:`TailScheduler` holds no feature state: each feature is a part
(``kvtail_connector/features/<feature>/scheduler.py``) built from the policy,
present only where the policy turns it on. What the parts share: the load's
start (:class:`~kvtail_connector.features.load_starts.LoadStarts`), the
record builder (:class:`~kvtail_connector.features.records.LoadRecords`) and
the ``kvtail`` entry (:mod:`~kvtail_connector.features.entries`). The order,
hook by hook:

``on_new_request``
    producer claims, verification (each notes the prefill legs it serves).
``get_num_new_matched_tokens``
    load starts (the facade stores in :attr:`TailScheduler.load_starts`).
``update_state_after_alloc``
    the entry reader first (:meth:`TailScheduler.read_entry`, before the
    inner update, where the params hold an entry), then after the inner
    update: a synchronous READ goes to READ tails; an async load is kept as
    allocated (consumer tails). The per-load hooks run once per request
    inside vLLM's loop, each of our calls ~0.1–0.3 µs there: the facade
    reads this side's dicts in place rather than call for what they hold.
``build_connector_meta``
    the step's async loads, in one pass: each to load errors (in flight),
    then its record (consumer tails) with a trusted claim (producer claims)
    and the digest to verify (verification) attached; producer claims and
    verification drop params left over; READ tails
    (records, and vLLM's zero list without READ destinations, set last);
    producer claims (tail records), verification (digest records); consumer
    tails and load errors (``failing``) fill the metadata.
``request_finished``
    load starts, the entry reader, producer claims, verification (params
    kept until the connector output of the same ``update_from_output``).
``update_connector_output``
    producer claims and verification grant, the entry writer writes; then,
    for loads in flight: producer claims (false claims), verification
    (verdicts), load errors (failures counted, finished loads forgotten).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtail_connector import entry
from kvtail_connector.connectors import InnerAdapter
from kvtail_connector.features.consumer_tails.scheduler import Allocation, ConsumerTailsScheduler
from kvtail_connector.features.entries import NOTHING, EntryReader, EntryWriter, binding_nodes
from kvtail_connector.features.kv_verification.scheduler import VerificationScheduler
from kvtail_connector.features.load_errors.scheduler import LoadErrorsScheduler
from kvtail_connector.features.load_starts import LoadStarts
from kvtail_connector.features.producer_claims.scheduler import ClaimsScheduler
from kvtail_connector.features.read_tails.scheduler import ReadTailsScheduler
from kvtail_connector.features.records import LoadRecords
from kvtail_connector.kvgroups import GroupInfo
from kvtail_connector.log import get_logger
from kvtail_connector.metadata import ExpectedDigest, GroupLoad, KVTailMetadata, KVTailWorkerMeta
from kvtail_connector.policy import TailPolicy
from kvtail_connector.stats import KVTailStats

logger = get_logger(__name__)

# Contains an internal error in one load's record: (the error, the request id).
RecordFailed = Callable[[Exception, str], None]


class TailScheduler:
    """The wrapper's scheduler side: the parts the policy turns on, in order.

    Args:
        inner: the wrapped connector (scheduler role).
        groups: tail facts per KV cache group.
        policy: what this engine does (see :class:`~kvtail_connector.policy.TailPolicy`).
        adapter: what differs for this inner connector.
        stats: the counters this side reports.
        geometry: this engine's tail geometry, as the ``kvtail`` entry states
            it (a producer's claim holds for it; a consumer trusts only a claim
            made for the same).
        num_workers: workers whose outputs vLLM aggregates per step (each
            must confirm a producer tail).
        limits: what a ``kvtail`` entry can hold on this engine (its model).
        min_block_size: the smallest block size of this engine's KV cache
            groups (bounds the block ids a transfer's binding can hold).
        key: the shared entry key (``entry_key_env``), or None.
    """

    def __init__(
        self,
        inner: Any,
        groups: tuple[GroupInfo, ...],
        policy: TailPolicy,
        *,
        adapter: InnerAdapter,
        stats: KVTailStats,
        geometry: entry.Geometry | None = None,
        num_workers: int = 1,
        limits: entry.Limits = entry.UNBOUNDED,
        min_block_size: int = 16,
        key: bytes | None = None,
    ) -> None:
        self._policy = policy
        self._adapter = adapter  # what differs for the inner connector (READ destinations)
        self._stats = stats
        self._num_workers = num_workers
        self._kv_cache_manager: Any = None
        nodes = binding_nodes(limits, min_block_size)
        self._records = LoadRecords(inner, groups, records_every_load=policy.records_every_load)
        self._starts = LoadStarts()
        self._matched = self._starts.by_request
        self._errors = LoadErrorsScheduler(stats)
        self._tails = ConsumerTailsScheduler()
        self._allocations = self._tails.allocations
        # (request, its get_loaded_kv_cache_group_ids) as vLLM last asked it
        # (set by the facade): the groups vLLM exempted from zeroing.
        self.asked_loaded: tuple[Any, Any] | None = None
        producer = policy.vouches_for_tails or policy.digests_prompts
        self._writer = (
            EntryWriter(geometry, binding_nodes=nodes, key=key, stats=stats) if producer else None
        )
        self._reader = (
            EntryReader(
                policy,
                geometry=geometry,
                limits=limits,
                binding_nodes=nodes,
                key=key,
                stats=stats,
            )
            if policy.checks_claims or policy.verifies_loads
            else None
        )
        self._readings = self._reader.readings if self._reader is not None else None
        # The facade's per-load hooks read these in place (a call less each,
        # and each call costs ~0.2 µs run cold inside vLLM's request loop):
        # the match's dict (LoadStarts.by_request) and the readings not yet
        # taken by an allocation (both empty: an allocation with nothing
        # loaded has nothing to forget); whether to call read_entry before an
        # allocation's inner update: where a reader is on and the params
        # hold an entry, or its absence is counted.
        self.load_starts = self._matched
        self.load_readings: dict[str, Any] = self._readings if self._readings is not None else {}
        self.reads_entries = self._reader is not None
        self.reads_absent_entries = self._reader is not None and self._reader.counts_absence
        self._claims = (
            ClaimsScheduler(self._records, stats, vouch=policy.vouches_for_tails)
            if policy.vouches_for_tails or policy.checks_claims
            else None
        )
        self._verify = (
            VerificationScheduler(self._records, stats, digests_prompts=policy.digests_prompts)
            if policy.digests_prompts or policy.verifies_loads
            else None
        )
        self._reads = (
            ReadTailsScheduler(
                self._records,
                adapter,
                stats,
                zeroes_read_tails=policy.zeroes_read_tails,
                excludes_reads=policy.excludes_reads,
                trusts_read_claims=policy.trusts_read_claims,
                claims=self._claims,
            )
            if policy.zeroes_read_tails or policy.excludes_reads
            else None
        )
        # The parts' producer halves (requests noted at arrival, records of
        # completing prompts, params kept at the finish): None on a consumer,
        # whose per-request and per-step hooks skip them.
        self._vouching = self._claims if policy.vouches_for_tails else None
        self._digesting = self._verify if policy.digests_prompts else None
        # Whether on_new_request does anything (the facade skips it otherwise).
        self.notes_arrivals = self._vouching is not None or self._digesting is not None
        # The parts that hold requests (claims and verification in their
        # producer halves only), and their containers, for held_requests.
        holders = (
            self._starts,
            self._errors,
            self._tails,
            self._reads,
            self._vouching,
            self._digesting,
        )
        self._holders = tuple(part for part in holders if part is not None)
        self._holding = tuple(c for part in self._holders for c in part.holding())

    # ----------------------------------------------------------------- hooks

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Any) -> None:
        """A producer notes the remote-decode prefill legs it vouches for or digests."""
        if self._vouching is not None:
            self._vouching.on_new_request(request)
        if self._digesting is not None:
            self._digesting.on_new_request(request)

    def read_entry(self, request: Any) -> None:
        """Before the inner ``update_state_after_alloc`` of a load (the facade
        calls this first, where :attr:`reads_entries` and the params hold an
        entry, are no dict, or :attr:`reads_absent_entries`): read the
        producer's entry once per allocation, while the params still hold
        what its binding covers."""
        reader = self._reader
        assert reader is not None
        start = self._matched.get(request.request_id)
        if start is not None:
            reader.read(request, bool(start[1]))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """After the inner ``update_state_after_alloc`` (called by the facade),
        and after :meth:`read_entry` (called before it).

        Runs twice per load inside vLLM's per-request loop (the second time
        with nothing loaded), each line cold there: an async load is kept
        as allocated, its record built with the step's others
        (:meth:`_record_allocations`)."""
        req_id = request.request_id
        # Forgotten here; put back should this raise (contain_alloc reads it).
        start = self._matched.pop(req_id, None)
        readings = self._readings
        # Most loads have no reading (no entry): the dict is empty.
        reading = readings.pop(req_id, None) if readings else None
        if start is None or num_external_tokens <= 0:
            return  # nothing loaded (vLLM's second call, once a load is done)
        try:
            claim, expected = reading if reading is not None else NOTHING
            local, load_async = start
            if load_async:
                # What vLLM asked right before this allocation, where it did
                # (0.32, 0.33); otherwise the inner connector is asked here.
                asked = self.asked_loaded
                if asked is not None and asked[0] is request:
                    groups = asked[1]
                    self.asked_loaded = None
                else:
                    groups = self._records.loaded_groups(request)
                loaded = local + num_external_tokens
                # Every id now (the record then depends on nothing vLLM may
                # change); the record later.
                written = self._records.written(blocks, groups, local, loaded)
                states = self._states(blocks, groups, expected) if expected is not None else ()
                # A plain tuple in Allocation's field order (a NamedTuple costs
                # 0.1 µs more to build; nothing reads it by field name).
                self._allocations.append(
                    (request, local, loaded, groups, written, states, claim, expected, req_id)
                )
            elif self._reads is not None:
                # Other sync loads land in blocks vLLM zeroed first.
                self._reads.allocated(request, blocks, local, local + num_external_tokens, claim)
        except BaseException:
            self._matched[req_id] = start
            raise

    def _record_allocations(self, failed: RecordFailed | None) -> None:
        """The records of the step's async loads, in one pass. A load whose
        record fails is reported failed by the workers at its completion;
        ``failed`` contains the error (else it is raised, and the loads not
        yet recorded stay for :meth:`contain_meta`).

        Counted here, not at the allocation: a claim declined or unused, a
        digest skipped. Where vLLM 0.33 allocates a deferred load in
        ``update_from_output`` (HiSparse), they reach the stats of the next
        ``update_from_output`` (the load cannot complete before that)."""
        allocations = self._tails.take_allocations()
        # A load with neither a claim nor a digest (most) is recorded inline:
        # in flight (LoadErrorsScheduler.started) and its record kept
        # (ConsumerTailsScheduler.add) in place, no call per load but the
        # record's own; others go through _record.
        in_flight, pending = self._errors.in_flight_by_request, self._tails.records
        from_written, zeroes = self._records.from_written, self._policy.zeroes_tails
        k, n = 0, len(allocations)
        while k < n:
            handled = False
            try:
                try:
                    for k in range(k, n):  # noqa: B020 (k: where one raised)
                        allocation = allocations[k]
                        _, local, loaded, loaded_groups, written, _, claim, expected, req_id = (
                            allocation
                        )
                        if claim is not None or expected is not None:
                            self._record(allocation)
                            continue
                        in_flight[req_id] = written
                        if zeroes:
                            record = from_written(req_id, written, local, loaded, loaded_groups)
                            if record is not None:
                                pending.append(record)
                    k = n
                except Exception as exc:
                    req_id = allocations[k][8]
                    self._errors.lost(req_id, allocations[k][4])
                    handled = True
                    if failed is None:
                        raise
                    failed(exc, req_id)
                    k += 1
            except BaseException:
                # Not contained: the loads not yet recorded (this one too
                # where it was not marked lost) wait for contain_meta.
                self._tails.allocations.extend(allocations[k + 1 if handled else k :])
                raise

    def _record(self, allocation: Allocation) -> None:
        request, local, loaded, loaded_groups, written, states, claim, expected, req_id = allocation
        records, policy = self._records, self._policy
        if expected is not None and expected.num_tokens < loaded and self._verify is not None:
            # Tokens [n, loaded) would go uncompared yet counted verified.
            self._verify.unrecorded()
            expected = None
        keep = expected is not None
        self._errors.started(req_id, written)
        if not policy.zeroes_tails and not keep:
            return
        record = records.from_written(req_id, written, local, loaded, loaded_groups, keep=keep)
        if record is None:
            if expected is not None and self._verify is not None:
                self._verify.unrecorded()  # no group a digest covers
            return
        claims = self._claims
        if (
            claim is not None
            and policy.zeroes_tails
            and claims is not None
            and claims.used(request, claim, record, policy.trusts_load_claims)
        ):
            record = record._replace(vouched=True)
        if expected is not None:
            record = record._replace(expected=expected, states=states)
        self._tails.add(record)

    def _states(
        self, blocks: Any, loaded_groups: Any, expected: ExpectedDigest
    ) -> tuple[GroupLoad, ...]:
        """The state blocks a load to verify writes, where its digest has states."""
        verify = self._verify
        if verify is None or expected.digest.states is None:
            return ()
        return verify.consumer_states(blocks.get_block_ids(), loaded_groups)

    def build_connector_meta(
        self, scheduler_output: Any, inner_meta: Any, failed: RecordFailed | None = None
    ) -> KVTailMetadata:
        """``inner_meta``: what the inner ``build_connector_meta`` returned;
        ``failed``: contains an error in one load's record (see
        :meth:`_record_allocations`)."""
        if self._tails.allocations:
            self._record_allocations(failed)
        vouching, digesting, manager = self._vouching, self._digesting, self._kv_cache_manager
        # Params left by an update_from_output that had no connector output:
        # they have left the engine; no entry is added to them after that.
        if vouching is not None:
            vouching.drop_provisional()
        if digesting is not None:
            digesting.drop_provisional()
        read_loads, kept = (
            self._reads.build(scheduler_output, inner_meta)
            if self._reads is not None
            else ((), None)
        )
        producer = vouching.producer_records(scheduler_output, manager) if vouching else ()
        digests = digesting.digest_records(scheduler_output, manager) if digesting else ()
        loads = self._tails.pending
        meta = KVTailMetadata(
            inner=inner_meta,
            loads=loads,
            read_loads=read_loads,
            producer_tails=producer,
            producer_digests=digests,
            failing=self._errors.take_failing() if self._errors.failing else (),
        )
        if loads or read_loads or producer:
            logger.debug(
                "kvtail: shipping %d load(s), %d READ load(s), %d producer tail(s)",
                len(loads),
                len(read_loads),
                len(producer),
            )
        if loads:
            self._tails.clear()
        if kept is not None:
            # Last: should anything above raise, vLLM's zero list is untouched
            # and it zeroes the READ destinations as without the wrapper.
            scheduler_output.new_block_ids_to_zero = kept
        return meta

    def request_finished(self, request: Any, params: dict[str, Any] | None) -> None:
        """``params``: what the inner connector's ``request_finished`` returned,
        the very dict vLLM puts into the request's output."""
        req_id = request.request_id
        self._matched.pop(req_id, None)
        asked = self.asked_loaded
        if asked is not None and asked[0] is request:
            self.asked_loaded = None  # asked for an allocation that never came
        reader = self._reader
        if reader is not None and (reader.seen or reader.readings):
            reader.forget(req_id)
        if self._vouching is not None:
            self._vouching.request_finished(request, params)
        if self._digesting is not None:
            self._digesting.request_finished(request, params)

    def update_connector_output(
        self, connector_output: Any, worker_meta: KVTailWorkerMeta | None = None
    ) -> None:
        """Grant the producer claims and digests of requests finished in this
        call, then count each failed async load once, then forget the loads
        reported finished.

        ``worker_meta``: the wrapper's worker metadata of the step being
        processed (aggregated over the workers), unwrapped by the facade.
        """
        claims, verify, errors = self._claims, self._verify, self._errors
        if self._writer is not None and (
            (claims is not None and claims.has_provisional)
            or (verify is not None and verify.has_provisional)
        ):
            workers = self._num_workers
            self._writer.send_all(
                claims.granted(worker_meta, workers) if claims is not None else {},
                verify.granted(worker_meta, workers) if verify is not None else {},
            )
        if not errors.in_flight:
            return
        if claims is not None and worker_meta is not None and worker_meta.false_vouches:
            claims.count_false_vouches(worker_meta.false_vouches, errors.in_flight)
        if verify is not None and self._policy.verifies_loads:
            verify.count_verdicts(connector_output, worker_meta, errors.in_flight)
        done = errors.settle(connector_output)
        if claims is not None and done:
            claims.loads_finished(done)

    # ------------------------------------------------- contained failures
    # The fallbacks the facade runs after an internal error in a hook
    # (kvtail_connector.containment): minimal, and never half a claim.

    def contain_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """``update_state_after_alloc`` failed: the load may have no record.
        An async load is reported failed by the workers when it completes
        (and counted in ``failed_loads``: tracked in flight). A synchronous
        READ never completes in ``finished_recving`` and its destinations
        leave vLLM's zero list: it stays a pending READ, without a claim
        (the entry is not read again), so its tail is still zeroed."""
        req_id = request.request_id
        start = self._starts.pop(req_id)
        if self._reader is not None:
            self._reader.drop(req_id)
        if num_external_tokens <= 0 or start is None:
            return  # no load the wrapper would have recorded
        local, load_async = start
        if load_async:
            self._errors.lost(req_id)
        elif self._reads is not None:
            self._reads.allocated(request, blocks, local, local + num_external_tokens, None)

    @property
    def pending_loads(self) -> list[str]:
        """Requests whose load record waits for this step's metadata."""
        return [
            *self._errors.failing,
            *(r.req_id for r in self._tails.pending),
            *(a[8] for a in self._tails.allocations),
        ]

    def contain_meta(self, inner_meta: Any) -> KVTailMetadata:
        """``build_connector_meta`` failed: the inner metadata, untouched; the
        step's pending async loads are reported failed at completion, its
        READ and producer records are not shipped (no claim is made)."""
        for allocation in self._tails.take_allocations():
            # Now among the failing, its blocks in flight (invalid ones match).
            self._errors.lost(allocation[8], allocation[4])
        failing = tuple(self.pending_loads)
        self._errors.take_failing()
        self._tails.clear()
        if self._reads is not None:
            self._reads.clear()
        return KVTailMetadata(inner=inner_meta, failing=failing)

    def contain_output(self, connector_output: Any) -> None:
        """``update_connector_output`` failed: no claim from this call; loads
        reported finished are forgotten."""
        claims, verify = self._claims, self._verify
        if self._vouching is not None:
            self._vouching.drop_provisional()
        if self._digesting is not None:
            self._digesting.drop_provisional()
        finished = tuple(connector_output.finished_recving or ())
        for req_id in finished:
            self._errors.finished((req_id,))
            if verify is not None:
                verify.load_finished(req_id)
        if claims is not None:
            claims.loads_finished(finished)

    def forget(self, req_id: str) -> None:
        """``on_new_request`` or ``request_finished`` failed: no claim for it."""
        self._starts.pop(req_id)
        asked = self.asked_loaded
        if asked is not None and asked[0].request_id == req_id:
            self.asked_loaded = None
        if self._reader is not None:
            self._reader.forget(req_id)
        if self._vouching is not None:
            self._vouching.forget(req_id)
        if self._digesting is not None:
            self._digesting.forget(req_id)

    # ----------------------------------------------------------- accounting

    def _parts(self) -> tuple[Any, ...]:
        parts = (self._starts, self._errors, self._tails, self._reads, self._claims, self._verify)
        return tuple(p for p in parts if p is not None)

    def held_requests(self) -> int:
        """Requests this side holds state for (the ``held_requests`` gauge).

        Asked every step: where every part's containers are empty (their
        truth, no call into a part) the answer is 0 at once."""
        if not any(self._holding):
            return 0
        held = []
        for part in self._holders:
            if ids := part.held():
                held.append(ids)
        # Each part's ids are distinct: a union only where two parts hold some.
        return len(held[0]) if len(held) == 1 else len(set().union(*held))

    @property
    def num_tracked(self) -> int:
        """Entries every part still holds (0 when idle: the leak check)."""
        reader = self._reader.num_tracked if self._reader is not None else 0
        return reader + sum(p.num_tracked for p in self._parts())
