"""Producer claims, scheduler half.

On a producer: note the remote-decode prefill legs as they arrive, ship a
tail record for each prompt the step completes (the workers zero it in that
step), and when the request finishes keep its params until the
``update_connector_output`` of the same ``update_from_output`` call says
whether every worker confirmed the zeroing; then the entry vouches for it
(:class:`~kvtail_connector.extras.entries.EntryWriter`). That the two calls
come in one step is vLLM's (``Scheduler.update_from_output`` finishes
requests, then updates the connector with the step's output); params left
over by a step without connector output have left the engine and are dropped
at the next ``build_connector_meta``.

On a consumer: decide whether a bound claim read from the entry lets the
workers skip a tail (``EntryStep.vouched``), and count each false claim a
worker's probe found once per request.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import Any

from kvtail_connector import _compat
from kvtail_connector.core.metadata import GroupLoad, LoadRecord
from kvtail_connector.core.parts.records import LoadRecords, completing_prompts, is_prefill_leg
from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.core.tails import tail_block
from kvtail_connector.extras.entries import FinishedParams, decline, every_rank
from kvtail_connector.log import get_logger

logger = get_logger(__name__)


class ClaimsScheduler:
    """Producer: requests from arrival to their claim. Consumer: false claims found.

    Args:
        records: the record builder (groups, tail indices).
        stats: the counters this side reports.
        vouch: this engine vouches for its prompt tails (a producer).
    """

    def __init__(self, records: LoadRecords, stats: KVTailStats, *, vouch: bool) -> None:
        self._records = records
        self._stats = stats
        self._vouch = vouch
        self._producing: dict[str, Any] = {}
        self._claims: dict[str, tuple[int, int]] = {}  # (prompt length, preemptions then)
        self._finished = FinishedParams()
        # Consumer: in-flight loads whose false vouch was counted already
        # (several ranks may find the same one, in different steps).
        self._false_vouched: set[str] = set()

    # -------------------------------------------------------------- producer

    def on_new_request(self, request: Any) -> None:
        if self._vouch and is_prefill_leg(request):
            self._producing[request.request_id] = request

    def producer_records(self, scheduler_output: Any, manager: Any) -> tuple[LoadRecord, ...]:
        """Tail records of the prompts this step completes: in each group with
        token tails, the block holding the prompt's last token, when that
        block is partial. A block-aligned prompt ships an empty record (its
        tail is trivially clean; every worker still confirms it)."""
        if not self._producing:
            return ()
        records = []
        groups_info = self._records.groups
        for req_id, request, n, block_ids in completing_prompts(
            scheduler_output, self._producing, manager
        ):
            groups = []
            for info in groups_info:
                tail = tail_block(n, info.effective_block) if info.has_tails else None
                if tail is None:
                    continue
                ids = block_ids[info.group_id]
                if tail[0] >= len(ids) or ids[tail[0]] == _compat.NULL_BLOCK_ID:
                    break  # not a block this step writes: no claim
                groups.append(GroupLoad(info.group_id, tail[0], (ids[tail[0]],)))
            else:
                records.append(LoadRecord(req_id, 0, n, tuple(groups)))
                self._claims[req_id] = (n, int(request.num_preemptions))
        return tuple(records)

    def request_finished(self, request: Any, params: dict[str, Any] | None) -> None:
        req_id = request.request_id
        self._producing.pop(req_id, None)
        claim = self._claims.pop(req_id, None)
        if claim is None or not isinstance(params, dict):
            return
        num_tokens, preemptions = claim
        # Preempted since (async scheduling can preempt it after the step
        # that zeroed its tail was scheduled): its blocks were freed; no claim.
        if request.num_preemptions == preemptions and request.num_computed_tokens >= num_tokens:
            self._finished.keep(req_id, params, num_tokens)

    def granted(self, worker_meta: Any, workers: int) -> dict[str, tuple[dict[str, Any], int]]:
        """The requests finished in this call whose tail every worker zeroed
        in the step just processed; the others leave without a claim (their
        consumer zeroes as if P were plain vLLM)."""
        reported = every_rank(worker_meta, workers)
        confirmed = reported.confirmed if reported is not None else {}
        out = {}
        for req_id, found in self._finished.take().items():
            # Distinct ranks: a step's outputs replayed (0.33 fault tolerance)
            # repeat a rank's confirmation, never add one.
            if len(confirmed.get(req_id, ())) != workers:
                logger.debug("kvtail: %s: tail not confirmed by every worker: no claim", req_id)
                continue
            out[req_id] = found
        return out

    @property
    def has_provisional(self) -> bool:
        return bool(self._finished)

    def drop_provisional(self) -> None:
        self._finished.drop()

    # -------------------------------------------------------------- consumer

    def used(self, request: Any, claim: int | None, record: LoadRecord, trusted: bool) -> bool:
        """Whether a claim lets this consumer skip the tail of ``record``
        (zeroed from token ``record.num_loaded``): the claim's clean tail
        starts there and claims are trusted on this path. A matching claim
        over a tail this consumer zeroes anyway is counted ``vouches_unused``
        (as ``vouched_tails``, only where there is a tail)."""
        if claim is None:
            return False
        if claim != record.num_loaded:
            decline(self._stats, request, f"claim for {claim} tokens, load of {record.num_loaded}")
            return False
        if not trusted:
            tail_index = self._records.tail_index
            if any(tail_index(record.num_loaded, g.group) is not None for g in record.groups):
                self._stats.add("vouches_unused", 1)
            return False
        return True

    def count_false_vouches(self, found: frozenset[str], in_flight: Any) -> None:
        """``false_vouches`` once per load, whichever rank(s) found it (vLLM
        sums every worker's stats; the ranks report ids, counted here)."""
        new = (found & in_flight) - self._false_vouched
        if new:
            self._stats.add("false_vouches", len(new))
            self._false_vouched |= new

    def loads_finished(self, req_ids: Iterable[str]) -> None:
        if self._false_vouched:
            self._false_vouched.difference_update(req_ids)

    def forget(self, req_id: str) -> None:
        self._producing.pop(req_id, None)
        self._claims.pop(req_id, None)
        self._finished.forget(req_id)

    def held(self) -> AbstractSet[str]:
        return self._producing.keys()

    @property
    def num_tracked(self) -> int:
        return (
            len(self._producing)
            + len(self._claims)
            + len(self._finished)
            + len(self._false_vouched)
        )
