"""Producer claims, worker half.

On a producer: zero the tails of the remote-decode prompts that complete in
the step, in the hook ``TailPolicy.producer_hook`` names (after the step's
last KV write, before its output leaves the worker), and confirm which in the
step's worker metadata; the scheduler half vouches only for what every rank
confirmed.

On a consumer: a tail whose claim the scheduler half trusted (a bound,
matching ``kvtail`` entry; ``EntryStep.vouched``) is not zeroed, only
counted; with ``probe_stale_tails`` it is checked first, and a claim found
false is zeroed anyway, logged and reported (counted once per request on the
scheduler side, whichever rank found it).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet

import numpy as np

from kvtail_connector.core.metadata import LoadRecord
from kvtail_connector.core.parts.zeroing import RankCaches, StaleSlots
from kvtail_connector.core.probe import probe_items
from kvtail_connector.log import get_logger

logger = get_logger(__name__)


class ClaimsWorker:
    """This step's producer tails, those zeroed, and false claims found."""

    def __init__(self, rank: RankCaches) -> None:
        self._rank = rank
        # This step's prompt tails, encoded as they arrive (the hook launches);
        # None where no caches were registered then (encoded in the hook).
        self._producer_tails: list[tuple[LoadRecord, StaleSlots | None]] = []
        self._zeroed: list[str] = []
        # Requests whose vouched tail the probe found non-zero, on their way
        # to this step's worker metadata.
        self._false_vouches: list[str] = []

    # -------------------------------------------------------------- producer

    def bind(self, producer_tails: Iterable[LoadRecord]) -> None:
        rank = self._rank
        registered = rank.zeroer is not None
        for record in producer_tails:
            self._producer_tails.append((record, rank.stale_tail(record) if registered else None))

    def zero_producer_tails(self) -> None:
        """Zero the slots past each completing prompt in its last block, on the
        current stream; each request zeroed is confirmed in this step's worker
        metadata. Without registered caches (sleep mode) nothing is zeroed and
        nothing confirmed."""
        tails, self._producer_tails = self._producer_tails, []
        rank = self._rank
        if tails and rank.zeroer is not None:
            batches = [tail if tail is not None else rank.stale_tail(r) for r, tail in tails]
            # Not probed: the counters say what consumers received.
            rank.zero(batches, counter="producer_tail_bytes_zeroed", probe=False)
            self._zeroed.extend(b.owner for b in batches)

    def take_zeroed(self) -> list[str]:
        """The requests zeroed since the last call (for the worker metadata);
        tails bound but never zeroed (the hook did not run) are dropped."""
        if self._producer_tails:
            logger.debug("kvtail: %d producer tail(s) not zeroed", len(self._producer_tails))
            self._producer_tails = []
        zeroed, self._zeroed = self._zeroed, []
        return zeroed

    def drop(self) -> None:
        """A contained failure: nothing of this step is confirmed."""
        self._producer_tails = []
        self._zeroed = []

    # -------------------------------------------------------------- consumer

    def check_vouched(
        self, batches: list[StaleSlots], records: list[LoadRecord]
    ) -> tuple[list[StaleSlots], int]:
        """Vouched tails are not zeroed, only counted; with the probe on they
        are checked first, and those holding any non-zero byte are returned to
        be zeroed, with how many of them the caller counts as zeroed tails once
        launched (the producer's claim was false: a WARNING, reported in the
        worker metadata)."""
        if not batches:
            return [], 0
        rank = self._rank
        lined = [b for b in batches if b.items]
        if not rank.probe or not lined:
            self.count_vouched(sum(b.nbytes for b in batches), records)
            return [], 0
        found = probe_items(
            rank.sets,
            np.array([item for b in lined for item in b.items], dtype=np.int64),
            [b.owner for b in lined for _ in b.items],
        )
        false = {req for req, (nonzero, _) in found.items() if nonzero}
        honest = [r for r in records if r.req_id not in false]
        self.count_vouched(sum(b.nbytes for b in batches if b.owner not in false), honest)
        if rank.counts_requests:
            rank.stats.add("probed_tails", sum(rank.has_tail(r) for r in honest))
        for req_id in sorted(false):
            nonzero, nonfinite = found[req_id]
            logger.warning(
                "KVTailConnector: request %s: the producer vouched for a zero tail, yet it held "
                "%d non-zero byte(s) (%d non-finite value(s)); zeroing it. Is the producer's "
                'kvtail-connector healthy? (vouch_tails: "off" on either side stops trusting)',
                req_id,
                nonzero,
                nonfinite,
            )
        false_tails = sum(rank.has_tail(r) for r in records if r.req_id in false)
        # Counted once per request by the scheduler side, whichever rank found it.
        self._false_vouches.extend(false)
        return [b for b in lined if b.owner in false], false_tails

    def skip_vouched_reads(
        self, records: list[LoadRecord], vouched_ids: AbstractSet[str], *, trusted: bool
    ) -> list[LoadRecord]:
        """The READ loads of ``records`` still to zero (``vouched_ids``: those
        a claim covers). Where claims are ``trusted``, vouched ones are not
        zeroed (READs copy the producer's blocks, zeroed at the source), only
        their bytes counted (the probe's canary covers async loads only);
        otherwise their claims count as unused."""
        vouched = [r for r in records if r.req_id in vouched_ids]
        if not vouched:
            return records
        if not trusted:
            self.count_unused(vouched)
            return records
        self.count_vouched(sum(self._rank.stale_tail(r).nbytes for r in vouched), vouched)
        return [r for r in records if r.req_id not in vouched_ids]

    def count_vouched(self, nbytes: int, records: list[LoadRecord]) -> None:
        rank = self._rank
        rank.stats.add("vouched_tail_bytes", nbytes)
        if rank.counts_requests:
            rank.stats.add("vouched_tails", sum(rank.has_tail(r) for r in records))

    def count_unused(self, records: list[LoadRecord]) -> None:
        """Claims that matched, over tails zeroed anyway (``vouches_unused``)."""
        rank = self._rank
        if records and rank.counts_requests:
            rank.stats.add("vouches_unused", sum(rank.has_tail(r) for r in records))

    def take_false_vouches(self) -> frozenset[str]:
        if not self._false_vouches:
            return frozenset()
        false = frozenset(self._false_vouches)
        self._false_vouches.clear()
        return false

    def held(self) -> set[str]:
        return {r.req_id for r, _ in self._producer_tails}

    @property
    def num_tracked(self) -> int:
        return len(self._producer_tails) + len(self._zeroed) + len(self._false_vouches)
