"""The worker's completion passes: the runner's ``get_transfer_results``.

Each pass zeroes what completed (every part's work in one launch, before the
result returns: the scheduler cannot hand those blocks on before it sees
it), then lets each hold keep back what must wait (consumer tails: zeroing
not executed; the opt-in features: a digest not compared; load errors: loads
to report failed). Every completion reaches vLLM exactly once, whatever failed
before: a pass that raised is answered by :meth:`CompletionPasses.contain`,
and one whose fallback raised too by the facade
(:func:`~kvtail_connector.core.worker.every_completion_failed`), which the next
pass settles first.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvtail_connector.core.extension import WorkerExtra
from kvtail_connector.core.parts.consumer_tails.worker import ConsumerTailsWorker, Pending
from kvtail_connector.core.parts.load_errors.worker import LoadErrorsWorker
from kvtail_connector.core.parts.zeroing import RankCaches, StaleSlots
from kvtail_connector.core.policy import TailPolicy
from kvtail_connector.log import get_logger

logger = get_logger(__name__)


class CompletionPasses:
    """What the worker does with each ``get_transfer_results`` pass, over the
    parts the policy turns on (the worker's; none of their state is kept here).

    Args:
        rank: this rank's caches.
        policy: what this worker zeroes and holds.
        tails, errors: the worker's core parts.
        extra: the opt-in features' worker half, or None.
    """

    def __init__(
        self,
        rank: RankCaches,
        policy: TailPolicy,
        tails: ConsumerTailsWorker,
        errors: LoadErrorsWorker,
        extra: WorkerExtra | None,
    ) -> None:
        self._rank = rank
        self._policy = policy
        self._tails = tails
        self._errors = errors
        self._extra = extra
        # Clean completions may take the packed path (the probe reads items).
        self._bulk = policy.zeroes_tails and not policy.probes

    def answer(
        self, results: KVConnectorTransferResults, finished_req_ids: set[str], inner: Any
    ) -> KVConnectorTransferResults:
        """The runner's ``get_transfer_results``: the inner connector's
        ``results``, after zeroing what completed, with completions held back
        while their zeroing has not executed (``holds_completions``) and
        while the extra holds them (a digest not on the host).

        Every completion reaches vLLM exactly once, whatever failed before:
        a pass that raised is answered by :meth:`contain`, and one whose
        fallback raised too by the facade (``every_completion_failed``),
        which this pass settles first (:meth:`_settle_unanswered`);
        completions owed since then are reported failed here."""
        errors = self._errors
        if errors.has_open:
            # Kept before settling: should settling raise, this pass is
            # among those the next one settles.
            errors.begin(results, finished_req_ids)
            self._settle_unanswered()
        extra = self._extra
        if not (
            results.finished_recving or finished_req_ids or self._tails.num_held or errors.owes
        ) and (extra is None or extra.idle):
            # The usual pass: nothing completed or finished, nothing held.
            if errors.has_open:
                errors.answered()  # the pass begun to settle earlier ones
            return results
        errors.begin(results, finished_req_ids)
        self._tails.finished(finished_req_ids)
        zeroed: set[str] = set()
        if results.finished_recving:
            zeroed = self.zero_completed(results.finished_recving, results.failed_recving, inner)
        results = self._tails.hold(results, zeroed)
        if extra is not None:
            results = extra.hold(results)
        results = errors.report_failing(results, finished_req_ids)
        # Returned to vLLM: a later failed pass need not report these again
        # (until here, contain does).
        self._answered()
        return results

    def _answered(self) -> None:
        """The answer of the pass in progress leaves this worker: what its
        holds released, and what was owed, has reached vLLM."""
        self._tails.reported()
        if self._extra is not None:
            self._extra.reported()
        self._errors.answered()

    def zero_completed(
        self, finished_recving: Iterable[str], failed_recving: Iterable[str], inner: Any
    ) -> set[str]:
        """Zero the tails of completed loads (and failed loads' blocks) in one
        launch. Returns the requests it zeroed for where completions are held
        (``holds_completions``); otherwise what it returns is not read and may
        be empty."""
        tails, errors, rank = self._tails, self._errors, self._rank
        if not tails.loading:
            return set()
        errors.fetch(inner)
        done = tails.completed(finished_recving)
        if not done:
            return set()
        packed = [pending.packed for pending in done if pending.packed is not None]
        if (
            len(packed) < len(done)
            or failed_recving
            or errors.has_invalid
            or tails.any_abandoned
            or not self._bulk
            or not rank.launches_packed
        ):
            return self._complete_each(done, set(failed_recving))
        # The usual step: every load completed clean, with nothing but its
        # tail to zero, packed when it arrived: what _complete_each does for
        # such loads, in a few passes over the step's loads and one launch
        # (benchmarks/RESULTS.md, "Worker side on the GPU": completion of 64
        # loads against a bare launch).
        rank.zero_packed_tails(b"".join(packed), sum([pending.nbytes for pending in done]))
        # Counted once the launch returned: a failed one zeroed nothing.
        rank.count_tails(sum([pending.has_tail for pending in done]))
        if not tails.holds:
            return set()
        return {pending.record.req_id for pending in done if pending.packed}

    def _complete_each(self, done: list[Pending], failed: set[str]) -> set[str]:
        """Completed loads one by one: aborted ones dropped; with the KV cache
        released, reported failed; failed or invalid ones' blocks zeroed (where
        vLLM does not); the extra's work on the clean ones (digests launched,
        vouched tails checked); every tail zeroed in one launch. Returns the
        requests it zeroed for."""
        errors, rank, policy, tails = self._errors, self._rank, self._policy, self._tails
        batches: list[StaleSlots] = []
        clean: list[Pending] = []
        num_tails = 0  # requests
        for pending in done:
            record = pending.record
            req_id = record.req_id
            invalid = errors.settle(record)
            if tails.abandoned(req_id):
                continue
            if rank.released:
                # The KV memory is released (sleep mode): nothing can be
                # zeroed or verified, and what the load wrote does not survive
                # wake-up (vLLM discards the KV cache; only weights are kept).
                errors.fail((req_id,))
                logger.warning(
                    "KVTailConnector: request %s: KV load completed while the KV cache was "
                    "released (sleep mode): reported failed",
                    req_id,
                )
                continue
            if req_id in failed or invalid is not None:
                # Failures are counted once per request by the scheduler side.
                if policy.zeroes_failed_loads:
                    batches.append(errors.stale_blocks(record, invalid))
                continue
            clean.append(pending)
        settled: AbstractSet[str] = frozenset()
        extra = self._extra
        if extra is not None:
            completed = extra.completed([pending.record for pending in clean])
            extra.forget(pending.record.req_id for pending in done)
            settled = completed.settled
            batches += completed.to_zero
            num_tails += completed.num_tails
        if policy.zeroes_tails:
            for pending in clean:
                if pending.record.req_id in settled:
                    continue
                batch = rank.stale_tail(pending.record)
                if batch.items:
                    batches.append(batch)
                num_tails += pending.has_tail
        rank.zero(batches)
        # Counted once the launch returned: a failed one zeroed nothing.
        rank.count_tails(num_tails)
        return {batch.owner for batch in batches if batch.items}

    def contain(
        self, results: KVConnectorTransferResults, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        """The fallback of :meth:`answer` after an internal error:
        every completion of this pass, and every completion held back, is
        reported failed (nothing proves their tails zeroed or their digests
        compared), after the zeroing launched so far has executed (vLLM may
        hand the blocks to a new owner at once). So is every completion a
        hold released in this pass before it failed: nothing else would ever
        report it, and vLLM would wait for it forever (the holds keep them
        until told they were reported). State for them is dropped.

        Where this fails too, the facade reports this pass's own completions
        failed (``every_completion_failed``); what a hold had given up by
        then is owed, and the next pass settles the rest."""
        errors = self._errors
        errors.begin(results, finished_req_ids)
        if errors.unanswered:
            # answer failed while settling earlier passes.
            self._settle_unanswered()
        done = set(results.finished_recving)
        self._take_holds(done)
        done |= errors.owed
        self._drop_loads(done)
        errors.forget(done, finished_req_ids)
        self._answered()
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=done,
            failed_recving=set(results.failed_recving) | done,
        )

    def _settle_unanswered(self) -> None:
        """The passes before this one never answered: each failed, its
        fallback failed too, and the facade reported exactly that pass's
        completions failed (``every_completion_failed``). Those are forgotten
        everywhere, so that no hold releases one again (vLLM asserts on a
        completion it has seen, and at TP > 1 miscounts the ranks'); every
        other completion a hold keeps, or released in those passes, is owed:
        reported failed by the next answer, as their fallbacks would have."""
        errors = self._errors
        unanswered = errors.unanswered
        reported: set[str] = set()
        finished: set[str] = set()
        for unanswered_pass in unanswered:
            reported.update(unanswered_pass.results.finished_recving)
            finished.update(unanswered_pass.finished_req_ids)
        self._tails.finished(finished)
        self._take_holds(reported)
        forgotten = reported | errors.owed
        self._drop_loads(forgotten)
        errors.forget(forgotten, finished)
        errors.settled()

    def _take_holds(self, reported: set[str]) -> None:
        """Every completion a hold keeps, or released without it reaching
        vLLM, taken out once the zeroing launched so far has executed, and
        owed but those in ``reported`` (answered already: forgotten). Moved
        hold by hold: where a later hold raises, what an earlier one gave up
        is owed already, and nothing is taken before the wait returned."""
        event = self._rank.last_zeroing
        if event is not None:
            event.synchronize()
        self._errors.owe(self._tails.drain() - reported)
        if self._extra is not None:
            self._errors.owe(self._extra.drop_held() - reported)

    def _drop_loads(self, req_ids: set[str]) -> None:
        """Forget these loads in every part that keeps them."""
        self._tails.drop(req_ids)
        if self._extra is not None:
            self._extra.forget(req_ids)
