"""Load errors, worker half: invalid blocks by owner, failed loads' blocks
zeroed, and loads the wrapper reports failed itself.

A failed or partially invalid load is recomputed by vLLM (or fails the
request, ``kv_load_failure_policy``). Where vLLM does not re-zero its blocks
(``TailPolicy.zeroes_failed_loads``) every destination slot from the first
invalid block on is zeroed, so nothing stale survives the recompute; the
blocks before it hold valid KV and are never touched.

A load whose record a contained internal error lost (here or on the
scheduler side), or that completed while sleep mode had released the KV
cache, is reported in ``failed_recving`` with its completion: vLLM's
contract has a failed load reported finished too, and its failure policy then
applies instead of a read of a tail nobody zeroed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvtail_connector.features.load_errors.ledger import InFlight, LoadErrorLedger
from kvtail_connector.features.zeroing import Item, RankZeroing
from kvtail_connector.metadata import LoadRecord


class LoadErrorsWorker:
    """The ledger of invalid blocks and the loads to report failed."""

    def __init__(self, rank: RankZeroing, in_flight: InFlight) -> None:
        self._rank = rank
        self._ledger = LoadErrorLedger(in_flight)
        # Loads to report failed when they complete.
        self._failing: set[str] = set()

    def bind(self, loads: Iterable[LoadRecord], failing: Iterable[str]) -> None:
        """This step's async loads, tracked; ``failing``: loads the scheduler
        side lost the record of."""
        if failing:
            self._failing.update(failing)
        ledger = self._ledger
        if ledger.has_invalid:
            for record in loads:
                ledger.new_load(record.req_id)

    def fail(self, req_ids: Iterable[str]) -> None:
        """Report these loads failed when they complete; forget their blocks."""
        for req_id in req_ids:
            self._failing.add(req_id)
            self._ledger.release(req_id)

    # ------------------------------------------------------------ completion

    def fetch(self, inner: Any) -> None:
        """A completing load's invalid blocks arrive at the latest in this
        pass: fetched now, before the runner asks for them."""
        self._ledger.fetch(inner)

    @property
    def has_invalid(self) -> bool:
        return self._ledger.has_invalid

    def settle(self, record: LoadRecord) -> tuple[int, int] | None:
        """Forget the completed load ``record``; (group, index in its block
        list) of its first invalid block, or None."""
        return _first_invalid(record, self._ledger.release(record.req_id))

    def items(self, record: LoadRecord, invalid: tuple[int, int] | None) -> list[Item]:
        """Whole destination blocks from the first invalid one on (all, if none
        is named); never the blocks before it, which hold valid KV."""
        rank = self._rank
        items: list[Item] = []
        for load in record.groups:
            start = invalid[1] if invalid is not None and invalid[0] == load.group else 0
            items += rank.block_items(load.group, load.block_ids[start:])
        return items

    def report_failing(
        self, results: KVConnectorTransferResults, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        """Loads to report failed that complete now go in ``failed_recving``
        too; a request that finished without completing a load is forgotten."""
        if not self._failing:
            return results
        now = self._failing.intersection(results.finished_recving)
        self._failing.difference_update(now)
        if finished_req_ids:
            self._failing.difference_update(finished_req_ids)
        if not now:
            return results
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=set(results.failed_recving) | now,
        )

    def take(self, inner: Any) -> set[int]:
        """The runner's ``get_block_ids_with_load_errors``: the inner
        connector's ids (some fetched earlier, in this pass), each kept only
        for the load in flight that writes the block."""
        return self._ledger.take(inner)

    # ------------------------------------------------- contained failures

    def drain(self) -> set[int]:
        """``take`` failed: the ids fetched so far, unattributed."""
        return self._ledger.drain()

    def failing_among(self, req_ids: Iterable[str]) -> set[str]:
        return self._failing.intersection(req_ids)

    def forget(self, req_ids: Iterable[str], finished_req_ids: set[str]) -> None:
        """After a contained failure at completion: ``req_ids`` were reported
        failed; requests vLLM finished need nothing reported."""
        for req_id in req_ids:
            self._ledger.release(req_id)
            self._failing.discard(req_id)
        if finished_req_ids:
            self._failing.difference_update(finished_req_ids)

    @property
    def num_tracked(self) -> int:
        return self._ledger.num_tracked + len(self._failing)


def _first_invalid(record: LoadRecord, invalid: set[int]) -> tuple[int, int] | None:
    """(group, index in its block list) of the load's first invalid block."""
    if not invalid:
        return None
    for load in record.groups:
        for i, block in enumerate(load.block_ids):
            if block in invalid:
                return load.group, i
    return None
