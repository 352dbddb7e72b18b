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
    load starts.
``get_loaded_kv_cache_group_ids``
    the answer vLLM got, kept for the allocation that follows.
``update_state_after_alloc``
    the entry reader first (:meth:`TailScheduler.read_entry`, before the
    inner update), then after the inner update: a synchronous READ goes to
    READ tails; an async load gets its record (consumer tails), with a
    trusted claim (producer claims) and the digest to verify (verification)
    attached.
``build_connector_meta``
    the step's async loads go to load errors (in flight) and their records
    into the metadata; producer claims and verification drop params left
    over; READ tails
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

from typing import Any

from kvtail_connector import entry
from kvtail_connector.connectors import InnerAdapter
from kvtail_connector.features.consumer_tails.scheduler import AllocatedLoad, ConsumerTailsScheduler
from kvtail_connector.features.entries import EntryReader, EntryWriter, binding_nodes
from kvtail_connector.features.kv_verification.scheduler import VerificationScheduler
from kvtail_connector.features.load_errors.scheduler import LoadErrorsScheduler
from kvtail_connector.features.load_starts import LoadStart, LoadStarts
from kvtail_connector.features.producer_claims.scheduler import ClaimsScheduler
from kvtail_connector.features.read_tails.scheduler import ReadTailsScheduler
from kvtail_connector.features.records import LoadRecords
from kvtail_connector.kvgroups import GroupInfo
from kvtail_connector.log import get_logger
from kvtail_connector.metadata import ExpectedDigest, GroupLoad, KVTailMetadata, KVTailWorkerMeta
from kvtail_connector.policy import TailPolicy
from kvtail_connector.stats import KVTailStats

logger = get_logger(__name__)


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
        self._num_workers = num_workers
        self._kv_cache_manager: Any = None
        nodes = binding_nodes(limits, min_block_size)
        self._records = LoadRecords(inner, groups, records_every_load=policy.records_every_load)
        self._starts = LoadStarts()
        self._errors = LoadErrorsScheduler(stats)
        self._tails = ConsumerTailsScheduler()
        # The request vLLM last asked get_loaded_kv_cache_group_ids for, and
        # the answer it got: the groups it keeps from zeroing in the
        # allocation that follows, which the load's record must cover.
        self._asked: tuple[Any, tuple[int, ...]] | None = None
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
                self._adapter,
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
        # completing prompts, params kept at the finish): None on a consumer.
        self._vouching = self._claims if policy.vouches_for_tails else None
        self._digesting = self._verify if policy.digests_prompts else None
        # The parts that hold requests (claims and verification in their
        # producer halves only), for held_requests.
        holders = (
            self._starts,
            self._errors,
            self._tails,
            self._reads,
            self._vouching,
            self._digesting,
        )
        self._holders = tuple(part for part in holders if part is not None)

    # ----------------------------------------------------------------- hooks

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Any) -> None:
        """A producer notes the remote-decode prefill legs it vouches for or digests."""
        if self._vouching is not None:
            self._vouching.on_new_request(request)
        if self._digesting is not None:
            self._digesting.on_new_request(request)

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
        """Before the inner ``update_state_after_alloc`` of a load: read the
        producer's entry once per allocation, while the params still hold
        what its binding covers (NIXL push rewrites ``remote_block_ids`` there)."""
        reader = self._reader
        if reader is None:
            return
        params = request.kv_transfer_params
        if type(params) is dict and entry.KEY not in params and not reader.counts_absence:
            return  # no entry, and its absence is not counted
        start = self._starts.get(request.request_id)
        if start is not None:
            reader.read(request, start.is_async)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """After the inner ``update_state_after_alloc`` (called by the facade),
        and after :meth:`read_entry` (called before it). vLLM calls it twice
        per load, the second time with nothing loaded."""
        req_id = request.request_id
        start = self._starts.pop(req_id)
        reading = self._reader.take(req_id) if self._reader is not None else None
        if start is None or num_external_tokens <= 0:
            return
        claim = reading.claim if reading is not None else None
        expected = reading.expected if reading is not None else None
        loaded = start.local + num_external_tokens
        try:
            if start.is_async:
                self._tails.add(self._allocated(request, blocks, start, loaded, claim, expected))
            elif self._reads is not None:
                # Other sync loads land in blocks vLLM zeroed first.
                self._reads.allocated(request, blocks, start.local, loaded, claim)
        except BaseException:
            self._starts.put_back(req_id, start)  # for contain_alloc
            raise

    def _allocated(
        self,
        request: Any,
        blocks: Any,
        start: LoadStart,
        loaded: int,
        claim: int | None,
        expected: ExpectedDigest | None,
    ) -> AllocatedLoad:
        """An async load of tokens ``[start.local, loaded)``: the blocks it
        writes and its record, with a trusted claim and the digest to verify."""
        req_id = request.request_id
        asked = self._asked
        if asked is not None and asked[0] is request:
            groups = asked[1]
            self._asked = None
        else:
            groups = self._records.loaded_groups(request)
        written = self._records.written(blocks, groups, start.local, loaded)
        verify = self._verify
        if expected is not None and expected.num_tokens < loaded and verify is not None:
            verify.unrecorded()  # tokens [n, loaded) would go uncompared yet counted verified
            expected = None
        if not self._policy.zeroes_tails and expected is None:
            return AllocatedLoad(req_id, written, None)
        record = self._records.from_written(
            req_id, written, start.local, loaded, groups, keep=expected is not None
        )
        if record is None:
            if expected is not None and verify is not None:
                verify.unrecorded()  # no group a digest covers
            return AllocatedLoad(req_id, written, None)
        claims = self._claims
        if (
            claim is not None
            and self._policy.zeroes_tails
            and claims is not None
            and claims.used(request, claim, record, self._policy.trusts_load_claims)
        ):
            record = record._replace(vouched=True)
        if expected is not None:
            states = self._states(blocks, groups, expected)
            record = record._replace(expected=expected, states=states)
        return AllocatedLoad(req_id, written, record)

    def _states(
        self, blocks: Any, loaded_groups: Any, expected: ExpectedDigest
    ) -> tuple[GroupLoad, ...]:
        """The state blocks a load to verify writes, where its digest has states."""
        verify = self._verify
        if verify is None or expected.digest.states is None:
            return ()
        return verify.consumer_states(blocks.get_block_ids(), loaded_groups)

    def build_connector_meta(self, scheduler_output: Any, inner_meta: Any) -> KVTailMetadata:
        """``inner_meta``: what the inner ``build_connector_meta`` returned."""
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
        allocated = self._tails.peek()
        loads = tuple(load.record for load in allocated if load.record is not None)
        meta = KVTailMetadata(
            inner=inner_meta,
            loads=loads,
            read_loads=read_loads,
            producer_tails=producer,
            producer_digests=digests,
            failing=tuple(self._errors.failing),
        )
        if loads or read_loads or producer:
            logger.debug(
                "kvtail: shipping %d load(s), %d READ load(s), %d producer tail(s)",
                len(loads),
                len(read_loads),
                len(producer),
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
        self.forget(request.request_id, keep_params=True)
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
            self._reader.take(req_id)
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
        return KVTailMetadata(inner=inner_meta, failing=self._errors.take_failing())

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

    def forget(self, req_id: str, *, keep_params: bool = False) -> None:
        """``req_id`` finished (``keep_params``: normally, its producer params
        still to be granted), or ``on_new_request`` / ``request_finished``
        failed for it (no claim for it)."""
        self._starts.pop(req_id)
        asked = self._asked
        if asked is not None and asked[0].request_id == req_id:
            self._asked = None  # asked for an allocation that never came
        if self._reader is not None:
            self._reader.forget(req_id)
        if keep_params:
            return
        if self._vouching is not None:
            self._vouching.forget(req_id)
        if self._digesting is not None:
            self._digesting.forget(req_id)

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
        parts = (
            self._starts,
            self._errors,
            self._tails,
            self._reads,
            self._claims,
            self._verify,
            self._reader,
        )
        return sum(part.num_tracked for part in parts if part is not None)
