"""Consumer tails, worker half: each async load's tail, zeroed at its completion.

The records arrive in the step their load starts (:meth:`ConsumerTailsWorker.bind`),
their work lines built then, so completion costs a concatenation and a launch.
At completion (the runner's ``get_transfer_results``) the coordinator takes
them back (:meth:`ConsumerTailsWorker.completed`) and zeroes them with every
other part's work in one launch, *before* returning the result: the scheduler
cannot promote, free, reuse or CoW-copy those blocks before it sees it. What
that orders after the zeroing:

- every reader on the compute stream (the request's forward, CoW copies, a new
  owner's forward), on both model runners;
- transfers the inner connector starts in ``start_load_kv``: the fence
  (:meth:`~kvtail_connector.core.parts.zeroing.RankCaches.fence`) waits for
  earlier zeroing first;
- on the V1 runner everything else too: its connector hooks run before
  sampling, and the scheduler reads the step's output after it. The V2 runner
  copies the output before ``post_forward``, so the scheduler may act on a
  completion while its zeroing is still queued; where a new owner's KV can
  arrive without ``start_load_kv`` (MoRIIO WRITE, started by the consumer's
  scheduler) completions are held until their zeroing has executed
  (:mod:`~kvtail_connector.core.parts.consumer_tails.hold`), and loads whose
  request was aborted in flight are not zeroed at all
  (:meth:`ConsumerTailsWorker.completed`).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvtail_connector.core.metadata import NULL_BLOCK, LoadRecord
from kvtail_connector.core.parts.consumer_tails.hold import CompletionHold
from kvtail_connector.core.parts.zeroing import RankCaches
from kvtail_connector.log import get_logger

logger = get_logger(__name__)


@dataclass(slots=True)
class Pending:
    """A load in flight: its record, and its tail encoded when it arrived."""

    record: LoadRecord
    # The tail's lines (RankCaches.packed_tail), where its tail is all there
    # is to do at completion; None: completed one by one (an opt-in feature
    # acts on it, a whole block to zero, no caches registered when it arrived).
    packed: bytes | None
    nbytes: int  # what the packed lines zero
    has_tail: bool  # RankCaches.has_tail(record)


def _written(record: LoadRecord) -> Iterator[int]:
    for load in record.groups:
        for block in load.block_ids:
            if block != NULL_BLOCK:
                yield block


class ConsumerTailsWorker:
    """Async loads in flight until they complete, and completions held back.

    Args:
        rank: this rank's caches and zeroer.
        holds_completions: keep completions out of ``finished_recving`` until
            their zeroing has executed (``TailPolicy.holds_completions``).
    """

    def __init__(self, rank: RankCaches, *, holds_completions: bool) -> None:
        self._rank = rank
        self._loads: dict[str, Pending] = {}
        # Loads in flight whose request vLLM has already finished (aborted).
        self._abandoned: set[str] = set()
        self._hold = CompletionHold() if holds_completions else None

    def bind(self, loads: Iterable[LoadRecord], extra_acts_on: Container[str] = ()) -> None:
        """Keep ``loads``, their tails packed for the launch now, but those in
        ``extra_acts_on`` (the opt-in features act on them at completion)."""
        rank = self._rank
        for record in loads:
            packed, nbytes, has_tail = rank.packed_tail(record)
            if record.req_id in extra_acts_on:
                packed = None  # more than its tail to do
            # A new load of a reused id replaces the old one.
            self._loads[record.req_id] = Pending(record, packed, nbytes, has_tail)
            self._abandoned.discard(record.req_id)

    def drop(self, req_ids: Iterable[str]) -> None:
        """Forget these loads (their record is lost: reported failed instead)."""
        for req_id in req_ids:
            self._loads.pop(req_id, None)
            self._abandoned.discard(req_id)

    def in_flight(self) -> Iterator[tuple[str, Iterator[int]]]:
        """Each load in flight and the non-null blocks it writes (for the
        load-error ledger, which searches them only when ids are reported)."""
        for req_id, pending in self._loads.items():
            yield req_id, _written(pending.record)

    @property
    def loading(self) -> bool:
        return bool(self._loads)

    def finished(self, finished_req_ids: set[str]) -> None:
        """vLLM finished these requests: a load still in flight is abandoned."""
        if self._loads and finished_req_ids:
            self._abandoned |= self._loads.keys() & finished_req_ids

    def completed(self, finished_recving: Iterable[str]) -> list[Pending]:
        """The tracked loads among ``finished_recving``, forgotten here (a
        completion may be untracked: a block-aligned load has no record)."""
        done = [self._loads.pop(req_id, None) for req_id in finished_recving]
        return [pending for pending in done if pending is not None]

    @property
    def any_abandoned(self) -> bool:
        return bool(self._abandoned)

    def abandoned(self, req_id: str) -> bool:
        """Whether this completed load's request was finished while it loaded
        (then forgotten). Such a load is not zeroed: nothing reads its blocks
        as that request's KV again (async loads cache their blocks only on a
        live completion), and every next owner of a block either has it zeroed
        by vLLM at allocation (models that need zeroing), writes the slots it
        reads, or is itself a load whose tail is zeroed at its own completion.
        Zeroing it anyway could land after a new owner's transfer that
        bypasses the worker's fence (MoRIIO WRITE) and wipe it."""
        if req_id not in self._abandoned:
            return False
        self._abandoned.discard(req_id)
        logger.debug("kvtail: %s finished while loading: nothing to zero", req_id)
        return True

    # ------------------------------------------------------------- the hold

    def hold(
        self, results: KVConnectorTransferResults, zeroed: set[str]
    ) -> KVConnectorTransferResults:
        """``results`` with the completions just ``zeroed`` held back until
        their zeroing executed, and earlier ones whose zeroing has, released."""
        hold = self._hold
        if hold is None or not (zeroed or len(hold)):
            return results
        event = self._rank.last_zeroing
        if zeroed and event is not None:
            hold.withhold(zeroed, results.failed_recving, event)
        released, released_failed = hold.release()
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving={r for r in results.finished_recving if r not in hold} | released,
            failed_recving={r for r in results.failed_recving if r not in hold} | released_failed,
        )

    def reported(self) -> None:
        """What :meth:`hold` returned has reached vLLM."""
        if self._hold is not None:
            self._hold.reported()

    def drain(self) -> set[str]:
        """Every completion held, or released and not reported (after a
        contained failure: the caller reports them failed)."""
        if self._hold is None:
            return set()
        finished, _ = self._hold.drain()
        return finished

    def held(self) -> set[str]:
        return set(self._loads)

    @property
    def holds(self) -> bool:
        """Completions are held until their zeroing executed (see :meth:`hold`)."""
        return self._hold is not None

    @property
    def num_held(self) -> int:
        return len(self._hold) if self._hold is not None else 0

    @property
    def num_tracked(self) -> int:
        return len(self._loads) + len(self._abandoned) + self.num_held
