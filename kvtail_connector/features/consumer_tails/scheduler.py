"""Consumer tails, scheduler half: one record per async load, shipped once.

At ``update_state_after_alloc`` the wrapper knows everything a worker needs
to find the load's stale tail (:class:`~kvtail_connector.features.records.LoadRecords`);
the record goes into this step's metadata (``KVTailMetadata.loads``) and the
scheduler keeps nothing about it afterwards. The record also carries what
other parts attach to the load (a trusted claim, the digest to verify).
"""

from __future__ import annotations

from kvtail_connector.metadata import LoadRecord


class ConsumerTailsScheduler:
    """This step's load records, until its metadata is built."""

    def __init__(self) -> None:
        self._pending: list[LoadRecord] = []

    def add(self, record: LoadRecord) -> None:
        self._pending.append(record)

    @property
    def pending(self) -> tuple[LoadRecord, ...]:
        return tuple(self._pending)

    def clear(self) -> None:
        self._pending.clear()

    def held(self) -> set[str]:
        return {r.req_id for r in self._pending}

    @property
    def num_tracked(self) -> int:
        return len(self._pending)
