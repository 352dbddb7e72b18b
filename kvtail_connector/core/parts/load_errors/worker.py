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

Each completion reaches vLLM once, also across failed passes: the pass in
progress is kept until its answer leaves the worker (:meth:`LoadErrorsWorker.begin`,
:meth:`LoadErrorsWorker.answered`), so that the next pass can settle one the
facade had to answer itself; completions a failed pass took out of a hold
without reporting them are owed (:meth:`LoadErrorsWorker.owe`), reported
failed by the next answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvtail_connector.core.metadata import LoadRecord
from kvtail_connector.core.parts.load_errors.ledger import InFlight, LoadErrorLedger
from kvtail_connector.core.parts.zeroing import RankCaches, StaleSlots


class FirstInvalid(NamedTuple):
    """A failed load's first block reported invalid."""

    group: int
    position: int  # in the load's block list of the group


class CompletionPass(NamedTuple):
    """A completion pass whose answer has not left the worker yet."""

    results: KVConnectorTransferResults  # the inner connector's
    finished_req_ids: set[str]


class LoadErrorsWorker:
    """The ledger of invalid blocks and the loads to report failed."""

    def __init__(self, rank: RankCaches, in_flight: InFlight) -> None:
        self._rank = rank
        self._ledger = LoadErrorLedger(in_flight)
        # Loads to report failed when they complete.
        self._failing: set[str] = set()
        # Completions taken out of a hold that no answer has carried yet.
        self._owed: set[str] = set()
        # The passes begun and not answered, the one in progress last.
        self._open: list[CompletionPass] = []

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

    def settle(self, record: LoadRecord) -> FirstInvalid | None:
        """Forget the completed load ``record``; its first invalid block, or None."""
        return _first_invalid(record, self._ledger.release(record.req_id))

    def stale_blocks(self, record: LoadRecord, invalid: FirstInvalid | None) -> StaleSlots:
        """Whole destination blocks from the first invalid one on (all, if none
        is named); never the blocks before it, which hold valid KV."""
        blocks = []
        for load in record.groups:
            start = invalid.position if invalid is not None and invalid.group == load.group else 0
            blocks.append((load.group, load.block_ids[start:]))
        return self._rank.stale_blocks(record.req_id, blocks)

    def report_failing(
        self, results: KVConnectorTransferResults, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        """Loads to report failed that complete now go in ``failed_recving``
        too; a request that finished without completing a load is forgotten.
        Owed completions go in both sets (kept until :meth:`answered`)."""
        owed = self._owed
        if not (self._failing or owed):
            return results
        now = self._failing.intersection(results.finished_recving)
        self._failing.difference_update(now)
        if finished_req_ids:
            self._failing.difference_update(finished_req_ids)
        if not (now or owed):
            return results
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=set(results.finished_recving) | owed,
            failed_recving=set(results.failed_recving) | now | owed,
        )

    def take(self, inner: Any) -> set[int]:
        """The runner's ``get_block_ids_with_load_errors``: the inner
        connector's ids (some fetched earlier, in this pass), each kept only
        for the load in flight that writes the block."""
        return self._ledger.take(inner)

    # ----------------------------------------------- the pass and its answer

    def begin(self, results: KVConnectorTransferResults, finished_req_ids: set[str]) -> None:
        """A completion pass starts on the inner connector's ``results``: kept
        until :meth:`answered` (begun again for the same ``results``, by the
        fallback of a pass that raised: kept once). Passes still kept when
        the next begins never answered (each and its fallback failed): see
        :attr:`unanswered`."""
        if not (self._open and self._open[-1].results is results):
            self._open.append(CompletionPass(results, finished_req_ids))

    @property
    def has_open(self) -> bool:
        """Some pass is kept: at the start of a pass, one that never answered."""
        return bool(self._open)

    @property
    def unanswered(self) -> list[CompletionPass]:
        """The passes before the one in progress whose answers never left the
        worker: for each, the facade reported exactly its completions failed
        (``every_completion_failed``)."""
        return self._open[:-1]

    def settled(self) -> None:
        """The unanswered passes were settled (their completions forgotten)."""
        del self._open[:-1]

    def owe(self, req_ids: Iterable[str]) -> None:
        """Completions taken out of a hold and never reported: the next
        answer reports them failed."""
        self._owed.update(req_ids)

    @property
    def owed(self) -> set[str]:
        """The completions owed (a copy)."""
        return set(self._owed)

    @property
    def owes(self) -> bool:
        return bool(self._owed)

    def answered(self) -> None:
        """The pass's answer leaves the worker, the owed completions in it."""
        self._owed = set()
        self._open.clear()

    def held(self) -> set[str]:
        """Requests this part holds for: the completions owed."""
        return set(self._owed)

    # ------------------------------------------------- contained failures

    def drain(self) -> set[int]:
        """``take`` failed: the ids fetched so far, unattributed."""
        return self._ledger.drain()

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
        return self._ledger.num_tracked + len(self._failing) + len(self._owed) + len(self._open)


def _first_invalid(record: LoadRecord, invalid: set[int]) -> FirstInvalid | None:
    """The load's first block in ``invalid``."""
    if not invalid:
        return None
    for load in record.groups:
        for i, block in enumerate(load.block_ids):
            if block in invalid:
                return FirstInvalid(load.group, i)
    return None
