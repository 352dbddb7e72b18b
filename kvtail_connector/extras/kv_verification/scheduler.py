"""KV verification (``verify_kv: digest``), scheduler half.

On a producer: ship every block of each remote-decode prompt the step
completes for the workers to digest, and when the request finishes keep its
params until ``update_connector_output`` brings the ranks' summed digest,
which the entry then carries (``dg``). On a consumer: the digest read from the
entry travels with the load (``EntryStep.checks``); the ranks' verdicts
are folded per load and counted once vLLM reports the load finished.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvtail_connector.core.metadata import GroupLoad
from kvtail_connector.core.parts.records import (
    LoadRecords,
    completing_prompts,
    is_prefill_leg,
    null_as_ours,
    state_loads,
)
from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.extras import entry_values
from kvtail_connector.extras.entries import FinishedParams, every_rank
from kvtail_connector.extras.metadata import (
    MISMATCH,
    VERIFIED,
    CheckedLoad,
    combined_verdict,
    report_of,
)
from kvtail_connector.log import get_logger

logger = get_logger(__name__)


class VerificationScheduler:
    """Producer: prompts from arrival to their digest. Consumer: verdicts.

    Args:
        records: the record builder (groups).
        stats: the counters this side reports.
        digests_prompts: this engine digests its remote-decode prompts.
        digest_every: one of every this many of them (``verify_kv: sample``).
    """

    def __init__(
        self,
        records: LoadRecords,
        stats: KVTailStats,
        *,
        digests_prompts: bool,
        digest_every: int = 1,
    ) -> None:
        self._records = records
        self._stats = stats
        self._digest = digests_prompts
        # Decided here alone, by arrival order: the first of each run of
        # ``digest_every`` prefill legs, whatever their params say.
        self._every = digest_every
        self._legs_seen = 0
        self._producing: dict[str, Any] = {}
        self._digesting: dict[str, int] = {}  # prompt length of those shipped
        self._finished = FinishedParams()
        # Consumer: the ranks' verdicts on loads that came with a digest,
        # and what differs where one found a mismatch, until vLLM reports
        # the load finished; the producer each load came from, for the log.
        self._verdicts: dict[str, str] = {}
        self._differs: dict[str, str] = {}
        self._producers: dict[str, str] = {}

    # -------------------------------------------------------------- producer

    def on_new_request(self, request: Any) -> None:
        if not (self._digest and is_prefill_leg(request)):
            return
        sampled = self._legs_seen % self._every == 0
        self._legs_seen += 1
        if sampled:
            self._producing[request.request_id] = request

    def digest_records(self, scheduler_output: Any, manager: Any) -> tuple[CheckedLoad, ...]:
        """Every block of ``[0, n)``, in each group with token tails, of the
        prompts this step completes."""
        if not self._producing:
            return ()
        records = []
        for req_id, _, n, block_ids in completing_prompts(
            scheduler_output, self._producing, manager
        ):
            records.append(self._record(req_id, n, block_ids))
            self._digesting[req_id] = n
        return tuple(records)

    def _record(self, req_id: str, n: int, block_ids: Any) -> CheckedLoad:
        groups = []
        for info in self._records.groups:
            if not info.has_tails:
                continue
            ids = null_as_ours(tuple(block_ids[info.group_id][: -(-n // info.effective_block)]))
            groups.append(GroupLoad(info.group_id, 0, ids))
        states = state_loads(self._records.groups, block_ids)
        return CheckedLoad(req_id, 0, n, tuple(groups), states=states)

    def consumer_states(self, block_ids: Any, loaded_groups: Any) -> tuple[GroupLoad, ...]:
        """The state blocks a load writes (state groups the inner connector
        loads): ``block_ids`` the request's, per group; ``loaded_groups`` the
        inner connector's ``get_loaded_kv_cache_group_ids``."""
        groups = self._records.groups
        if all(info.state_scratch is None for info in groups):
            return ()
        return state_loads(groups, block_ids, set(loaded_groups))

    def request_finished(self, request: Any, params: dict[str, Any] | None) -> None:
        req_id = request.request_id
        self._producing.pop(req_id, None)
        digested = self._digesting.pop(req_id, None)
        if digested is not None and isinstance(params, dict):
            self._finished.keep(req_id, params, digested)

    def granted(
        self, worker_meta: Any, workers: int
    ) -> dict[str, tuple[dict[str, Any], int, entry_values.Digest]]:
        """The requests finished in this call that every worker digested,
        with the summed digest; the others leave without one (their consumer
        verifies nothing)."""
        reported = every_rank(worker_meta, workers)
        parts = reported.digests if reported is not None else {}
        out = {}
        for req_id, (params, num_tokens) in self._finished.take().items():
            part = parts.get(req_id)
            digest = part.digest() if part is not None and part.ranks == workers else None
            if digest is None:
                logger.debug("kvtail: %s: not digested by every worker: no digest", req_id)
                continue
            out[req_id] = (params, num_tokens, digest)
        return out

    @property
    def has_provisional(self) -> bool:
        return bool(self._finished)

    def drop_provisional(self) -> None:
        self._finished.drop()

    # -------------------------------------------------------------- consumer

    def unrecorded(self) -> None:
        """A load with a digest wrote no group a digest covers, or tokens past
        the ones the digest covers (nothing would compare them)."""
        self._stats.add("digests_skipped", 1)

    def expect(self, req_id: str, params: Any) -> None:
        """A load that came with a digest: remember its producer (vLLM's
        ``remote_engine_id`` in its params, as far as it is a short string)
        for the mismatch's log line."""
        engine = params.get("remote_engine_id") if isinstance(params, dict) else None
        self._producers[req_id] = (
            engine if isinstance(engine, str) and len(engine) <= 128 else "unknown"
        )

    def count_verdicts(self, connector_output: Any, worker_meta: Any, in_flight: Any) -> None:
        """Fold this step's verdicts of the ranks; count each load once vLLM
        reports it finished (every rank then reported its verdict), and log a
        mismatch there, once per request."""
        report = report_of(worker_meta)
        if report is not None:
            for req_id, found in report.verdicts.items():
                if req_id in in_flight:
                    have = self._verdicts.get(req_id)
                    self._verdicts[req_id] = (
                        found if have is None else combined_verdict(have, found)
                    )
            for req_id, differs in report.differs.items():
                if req_id in in_flight:
                    self._differs.setdefault(req_id, differs)
        if not (self._verdicts or self._producers):
            return  # no load in flight came with a digest (most steps under sampling)
        for req_id in connector_output.finished_recving or ():
            verdict = self._verdicts.pop(req_id, None)
            differs = self._differs.pop(req_id, "")
            producer = self._producers.pop(req_id, None)
            if verdict is None:
                if producer is not None:
                    # It came with a digest no rank compared (a worker that
                    # could not digest its pages, a load that failed first).
                    self._stats.add("digests_skipped", 1)
                continue
            if verdict == MISMATCH:
                self._stats.add("digest_mismatches", 1)
                logger.warning(
                    "KVTailConnector: request %s: the KV loaded from producer engine %r differs "
                    "from what the producer digested (%s); the load is reported failed and "
                    "kv_load_failure_policy applies (vllm:kvtail_digest_mismatches counts these)",
                    req_id,
                    producer or "unknown",
                    differs or "no rank named what",
                )
            elif verdict == VERIFIED:
                self._stats.add("digests_verified", 1)
            else:
                self._stats.add("digests_skipped", 1)

    def loads_finished(self, req_ids: Iterable[str]) -> None:
        """Loads vLLM reported finished (or a contained failure dropped)."""
        if self._verdicts or self._differs or self._producers:
            for req_id in req_ids:
                self._verdicts.pop(req_id, None)
                self._differs.pop(req_id, None)
                self._producers.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        self._producing.pop(req_id, None)
        self._digesting.pop(req_id, None)
        self._finished.forget(req_id)

    def held(self) -> set[str]:
        return set(self._producing) | set(self._digesting)

    @property
    def num_tracked(self) -> int:
        return (
            len(self._producing)
            + len(self._digesting)
            + len(self._finished)
            + len(self._verdicts)
            + len(self._differs)
            + len(self._producers)
        )
