"""Producer claims and the KV digest on the scheduler side: the features that
travel in the ``kvtail`` entry, as one :class:`~kvtail_connector.core.extension.SchedulerExtra`.

A producer notes its remote-decode prefill legs, ships the records its
workers zero or digest, and when the request finishes writes one entry into
its params with what every worker confirmed (:class:`EntryWriter`). A
consumer reads the entry once per allocation (:class:`EntryReader`); a bound
claim may vouch for the load's tail and a digest be checked against it (both
shipped in the step's :class:`~kvtail_connector.extras.metadata.EntryStep`,
by request), and the workers' verdicts and false vouches are counted per load.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import Any

from kvtail_connector.core.extension import BuildRecord
from kvtail_connector.core.metadata import GroupLoad, LoadRecord
from kvtail_connector.core.parts.records import LoadRecords
from kvtail_connector.core.policy import TailPolicy
from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.extras import entry, entry_values
from kvtail_connector.extras.entries import EntryReader, EntryWriter, binding_nodes
from kvtail_connector.extras.kv_verification.scheduler import VerificationScheduler
from kvtail_connector.extras.metadata import EntryStep, ExpectedDigest, LoadCheck, report_of
from kvtail_connector.extras.producer_claims.scheduler import ClaimsScheduler


class EntryFeatures:
    """Producer claims and KV verification, both halves, as the policy turns them on.

    Args:
        records: the core's record builder (groups, tail indices).
        policy: what this engine does.
        stats: the counters this side reports.
        geometry: this engine's tail geometry, as the entry states it.
        num_workers: workers whose outputs vLLM aggregates per step (each
            must confirm a producer tail or digest).
        limits: what an entry can hold on this engine (its model).
        min_block_size: the smallest block size of this engine's KV cache
            groups (bounds the block ids a transfer's binding can hold).
        key: the shared entry key (``entry_key_env``), or None.
    """

    def __init__(
        self,
        records: LoadRecords,
        policy: TailPolicy,
        stats: KVTailStats,
        *,
        geometry: entry_values.Geometry | None,
        num_workers: int = 1,
        limits: entry_values.Limits = entry_values.UNBOUNDED,
        min_block_size: int = 16,
        key: bytes | None = None,
    ) -> None:
        self._policy = policy
        self._num_workers = num_workers
        nodes = binding_nodes(limits, min_block_size)
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
            ClaimsScheduler(records, stats, vouch=policy.vouches_for_tails)
            if policy.vouches_for_tails or policy.checks_claims
            else None
        )
        self._verify = (
            VerificationScheduler(
                records,
                stats,
                digests_prompts=policy.digests_prompts,
                digest_every=policy.digest_every,
            )
            if policy.digests_prompts or policy.verifies_loads
            else None
        )
        # The producer halves (requests noted at arrival, records of
        # completing prompts, params kept at the finish): None on a consumer.
        self._vouching = self._claims if policy.vouches_for_tails else None
        self._digesting = self._verify if policy.digests_prompts else None
        # The loads recorded since the last step payload: those whose tail a
        # claim covers, and those to check against a digest.
        self._vouched: set[str] = set()
        self._checks: dict[str, LoadCheck] = {}

    # ----------------------------------------------------------- producer

    def on_new_request(self, request: Any) -> None:
        if self._vouching is not None:
            self._vouching.on_new_request(request)
        if self._digesting is not None:
            self._digesting.on_new_request(request)

    def step_payload(self, scheduler_output: Any, manager: Any) -> EntryStep | None:
        vouching, digesting = self._vouching, self._digesting
        self._drop_provisional()
        vouched, self._vouched = self._vouched, set()
        checks, self._checks = self._checks, {}
        step = EntryStep(
            producer_tails=vouching.producer_records(scheduler_output, manager) if vouching else (),
            producer_digests=(
                digesting.digest_records(scheduler_output, manager) if digesting else ()
            ),
            vouched=frozenset(vouched),
            checks=checks,
        )
        return step if step else None

    def request_finished(self, request: Any, params: dict[str, Any] | None) -> None:
        if self._reader is not None:
            self._reader.forget(request.request_id)
        if self._vouching is not None:
            self._vouching.request_finished(request, params)
        if self._digesting is not None:
            self._digesting.request_finished(request, params)

    # ----------------------------------------------------------- consumer

    def before_allocation(self, request: Any, is_async: bool) -> None:
        reader = self._reader
        if reader is None:
            return
        params = request.kv_transfer_params
        if type(params) is dict and entry.KEY not in params and not reader.counts_absence:
            return  # no entry, and its absence is not counted
        reader.read(request, is_async)

    def async_load(
        self, request: Any, loaded: int, blocks: Any, groups: tuple[int, ...], build: BuildRecord
    ) -> LoadRecord | None:
        reading = self._reader.take(request.request_id) if self._reader is not None else None
        claim = reading.claim if reading is not None else None
        expected = reading.expected if reading is not None else None
        verify = self._verify
        if expected is not None and expected.num_tokens < loaded and verify is not None:
            verify.unrecorded()  # tokens [n, loaded) would go uncompared yet counted verified
            expected = None
        record = build(expected is not None)
        if record is None:
            if expected is not None and verify is not None:
                verify.unrecorded()  # no group a digest covers
            return None
        claims, policy = self._claims, self._policy
        if (
            claim is not None
            and policy.zeroes_tails
            and claims is not None
            and claims.used(request, claim, record, policy.trusts_load_claims)
        ):
            self._vouched.add(record.req_id)
        if expected is not None and verify is not None:
            self._checks[record.req_id] = LoadCheck(
                expected, self._states(blocks, groups, expected)
            )
            verify.expect(record.req_id, request.kv_transfer_params)
        return record

    def _states(
        self, blocks: Any, loaded_groups: Any, expected: ExpectedDigest
    ) -> tuple[GroupLoad, ...]:
        """The state blocks a load to verify writes, where its digest has states."""
        verify = self._verify
        if verify is None or expected.digest.states is None:
            return ()
        return verify.consumer_states(blocks.get_block_ids(), loaded_groups)

    def sync_load(self, request: Any) -> int | None:
        """The prompt length a bound claim of this READ covers, or None."""
        reading = self._reader.take(request.request_id) if self._reader is not None else None
        return reading.claim if reading is not None else None

    def read_load(self, request: Any, allocated: Any, record: LoadRecord) -> None:
        claims = self._claims
        if claims is not None and claims.used(
            request, allocated, record, self._policy.trusts_read_claims
        ):
            self._vouched.add(record.req_id)

    def update_connector_output(
        self, connector_output: Any, worker_meta: Any, in_flight: Any
    ) -> None:
        """Grant the producer claims and digests of requests finished in this
        call, then count the loads' false vouches and verdicts."""
        claims, verify = self._claims, self._verify
        if self._writer is not None and (
            (claims is not None and claims.has_provisional)
            or (verify is not None and verify.has_provisional)
        ):
            workers = self._num_workers
            self._writer.send_all(
                claims.granted(worker_meta, workers) if claims is not None else {},
                verify.granted(worker_meta, workers) if verify is not None else {},
            )
        if not in_flight:
            return
        report = report_of(worker_meta)
        if claims is not None and report is not None and report.false_vouches:
            claims.count_false_vouches(report.false_vouches, in_flight)
        if verify is not None and self._policy.verifies_loads:
            verify.count_verdicts(connector_output, worker_meta, in_flight)

    def loads_finished(self, req_ids: Iterable[str]) -> None:
        req_ids = tuple(req_ids)
        if self._verify is not None:
            self._verify.loads_finished(req_ids)
        if self._claims is not None:
            self._claims.loads_finished(req_ids)

    # ------------------------------------------------- contained failures

    def contain_alloc(self, req_id: str) -> None:
        if self._reader is not None:
            self._reader.take(req_id)

    def contain_meta(self) -> None:
        self._vouched = set()
        self._checks = {}
        self._drop_provisional()  # as step_payload would have

    def contain_output(self, connector_output: Any) -> None:
        self._drop_provisional()
        self.loads_finished(connector_output.finished_recving or ())

    def _drop_provisional(self) -> None:
        """Params left by an update_from_output that had no connector output
        have left the engine: no entry is added to them after that."""
        if self._vouching is not None:
            self._vouching.drop_provisional()
        if self._digesting is not None:
            self._digesting.drop_provisional()

    def forget(self, req_id: str) -> None:
        if self._reader is not None:
            self._reader.forget(req_id)
        if self._vouching is not None:
            self._vouching.forget(req_id)
        if self._digesting is not None:
            self._digesting.forget(req_id)

    # ----------------------------------------------------------- accounting

    def held(self) -> AbstractSet[str]:
        """The producer halves' requests (claims and digests in flight to an entry)."""
        held: set[str] = set()
        for part in (self._vouching, self._digesting):
            if part is not None:
                held.update(part.held())
        return held

    @property
    def num_tracked(self) -> int:
        parts = (self._reader, self._claims, self._verify)
        marks = len(self._vouched) + len(self._checks)
        return marks + sum(part.num_tracked for part in parts if part is not None)
