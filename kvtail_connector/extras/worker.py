"""Producer claims and the KV digest on the worker side, as one
:class:`~kvtail_connector.core.extension.WorkerExtra`.

A producer's ranks zero (:class:`ClaimsWorker`) and digest
(:class:`VerificationWorker`) the prompts its step completes, in the producer
hook, and report both in :class:`~kvtail_connector.extras.metadata.EntryReport`.
A consumer's ranks get, per step, which loads a claim covers and which to
check (:class:`~kvtail_connector.extras.metadata.EntryStep`, by request), and
keep that beside the core's records until the load completes or is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvtail_connector.core.cache_sets import CacheSet
from kvtail_connector.core.extension import Completed
from kvtail_connector.core.metadata import LoadRecord
from kvtail_connector.core.parts.zeroing import RankCaches
from kvtail_connector.core.policy import TailPolicy
from kvtail_connector.extras.kv_verification.placement import HeadPlacement
from kvtail_connector.extras.kv_verification.rank_states import state_sets
from kvtail_connector.extras.kv_verification.worker import VerificationWorker
from kvtail_connector.extras.metadata import CheckedLoad, EntryReport, EntryStep
from kvtail_connector.extras.producer_claims.worker import ClaimsWorker

_NO_STEP = EntryStep()


class EntryFeaturesWorker:
    """The claims and verification halves this rank runs, as the policy turns them on.

    Args:
        rank: this rank's caches and zeroer (shared with the core).
        policy: what this engine does.
        rank_id: this worker's rank (its confirmations are counted by id).
        heads: this rank's TP placement of the KV heads (``verify_kv``).
    """

    def __init__(
        self, rank: RankCaches, policy: TailPolicy, *, rank_id: int, heads: HeadPlacement
    ) -> None:
        self._rank = rank
        self._zeroes_tails = policy.zeroes_tails
        self._ranks = frozenset({rank_id})
        self._claims = (
            ClaimsWorker(rank) if policy.vouches_for_tails or policy.checks_claims else None
        )
        self._verify = (
            VerificationWorker(heads, verifies_loads=policy.verifies_loads)
            if policy.digests_prompts or policy.verifies_loads
            else None
        )
        # Async loads in flight: those whose tail a claim covers, those to check.
        self._vouched: set[str] = set()
        self._checks: dict[str, CheckedLoad] = {}
        # READ loads bound whose tail a claim covers (taken when they start).
        self._vouched_reads: set[str] = set()

    # ------------------------------------------------------------ lifecycle

    def register(
        self, sets: list[CacheSet], kv_caches: Mapping[str, Any], kv_cache_config: Any
    ) -> None:
        if self._verify is not None:
            states = state_sets(kv_caches, kv_cache_config, self._rank.groups)
            self._verify.register(sets, states)

    def release(self) -> None:
        if self._verify is not None:
            self._verify.release()

    def restore(self) -> None:
        if self._verify is not None:
            self._verify.restore()

    def forget_released(self) -> None:
        if self._verify is not None:
            self._verify.forget_released()

    # ----------------------------------------------------------------- step

    def bind(
        self, payload: Any, loads: tuple[LoadRecord, ...], read_loads: tuple[LoadRecord, ...]
    ) -> AbstractSet[str]:
        step = payload if isinstance(payload, EntryStep) else _NO_STEP
        if self._claims is not None:
            self._claims.bind(step.producer_tails)
        checked: list[CheckedLoad] = []
        acting: set[str] = set()
        if not (step.vouched or step.checks or self._vouched or self._checks):
            # The usual step under sampling: no load of it is vouched for or
            # checked, and no earlier mark can be replaced (bench_worker_gpu.py,
            # "a step with no sampled request").
            loads = ()
        for record in loads:
            req_id = record.req_id
            # A new load of a reused id replaces the old one.
            self._vouched.discard(req_id)
            self._checks.pop(req_id, None)
            if req_id in step.vouched:
                self._vouched.add(req_id)
                acting.add(req_id)
            check = step.checks.get(req_id)
            if check is not None:
                load = CheckedLoad(*record, expected=check.expected, states=check.states)
                self._checks[req_id] = load
                checked.append(load)
                acting.add(req_id)
        if step.vouched and read_loads:
            self._vouched_reads |= step.vouched & {r.req_id for r in read_loads}
        if self._verify is not None and (step.producer_digests or checked):
            self._verify.bind(step.producer_digests, checked)
        return acting

    def produce(self) -> None:
        """Zero the step's prompt tails, then digest the prompts (the zeroing
        writes only slots past them)."""
        if self._claims is not None:
            self._claims.zero_producer_tails()
        if self._verify is not None:
            self._verify.digest_prompts()

    def reads_to_zero(self, records: list[LoadRecord], *, trusted: bool) -> list[LoadRecord]:
        vouched, self._vouched_reads = self._vouched_reads, set()
        if self._claims is None or not vouched:
            return records
        return self._claims.skip_vouched_reads(records, vouched, trusted=trusted)

    # ------------------------------------------------------------ completion

    def completed(self, records: list[LoadRecord]) -> Completed:
        """Check the loads that came with a digest (launched before the pass's
        zeroing: disjoint slots); vouched tails are not zeroed, only counted,
        or probed and zeroed where the claim was false."""
        if self._verify is not None and self._checks:
            checks = [self._checks[r.req_id] for r in records if r.req_id in self._checks]
            if checks:
                self._verify.check(checks)
        claims = self._claims
        if not (self._zeroes_tails and claims is not None and self._vouched):
            return Completed()
        vouched = [r for r in records if r.req_id in self._vouched]
        if not vouched:
            return Completed()
        rank = self._rank
        false, false_tails = claims.check_vouched([rank.stale_tail(r) for r in vouched], vouched)
        return Completed(frozenset(r.req_id for r in vouched), false, false_tails)

    def forget(self, req_ids: Iterable[str]) -> None:
        if self._vouched or self._checks or self._vouched_reads:
            for req_id in req_ids:
                self._vouched.discard(req_id)
                self._checks.pop(req_id, None)
                self._vouched_reads.discard(req_id)

    def hold(self, results: KVConnectorTransferResults) -> KVConnectorTransferResults:
        return self._verify.hold(results) if self._verify is not None else results

    def reported(self) -> None:
        if self._verify is not None:
            self._verify.reported()

    def drop_held(self) -> set[str]:
        return self._verify.drop_held() if self._verify is not None else set()

    @property
    def idle(self) -> bool:
        return self._verify is None or self._verify.idle

    # ------------------------------------------------------------ reporting

    def report(self) -> EntryReport | None:
        """None on a step with nothing to report (the usual one): the scheduler
        reads a missing report as nothing reported (``report_of``)."""
        claims, verify = self._claims, self._verify
        if verify is not None and not verify.has_report:
            verify = None
        zeroed = claims.take_zeroed() if claims is not None else []
        report = EntryReport(
            confirmed=dict.fromkeys(zeroed, self._ranks),
            digests=verify.take_parts() if verify is not None else {},
            verdicts=verify.take_verdicts() if verify is not None else {},
            false_vouches=claims.take_false_vouches() if claims is not None else frozenset(),
            differs=verify.take_differs() if verify is not None else {},
        )
        return report if report else None

    def drop(self) -> None:
        if self._claims is not None:
            self._claims.drop()
        if self._verify is not None:
            self._verify.drop()

    def held(self) -> set[str]:
        held: set[str] = set()
        for part in (self._claims, self._verify):
            if part is not None:
                held |= part.held()
        return held

    @property
    def num_tracked(self) -> int:
        parts = (self._claims, self._verify)
        marks = len(self._vouched) + len(self._checks) + len(self._vouched_reads)
        return marks + sum(p.num_tracked for p in parts if p is not None)
