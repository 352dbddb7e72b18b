"""Consumer tails, scheduler half: one record per async load, shipped once.

At ``update_state_after_alloc`` the wrapper knows everything a worker needs
to find the load's stale tail; it keeps the allocation as given
(:data:`Allocation`) and builds the step's records in one pass when the
metadata is built (:class:`~kvtail_connector.features.records.LoadRecords`).
The record goes into this step's metadata (``KVTailMetadata.loads``) and the
scheduler keeps nothing about it afterwards. The record also carries what
other parts attach to the load (a trusted claim, the digest to verify).

Why one pass at the metadata: vLLM calls ``update_state_after_alloc`` once
per load between its own per-request work, so each call ran the record's
code cold (2-3 x its cost back to back, measured by ``bench_host.py``).
What the record is built from (block ids, group ids, token counts) is read
from vLLM at the allocation, while its blocks are in cache; the pass reads
nothing vLLM may have changed since (vLLM 0.33 may allocate a deferred load
in ``update_from_output``, a schedule before the metadata).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

from kvtail_connector.metadata import ExpectedDigest, GroupLoad, LoadRecord

# An async load's ``update_state_after_alloc``, until the metadata: all that
# its record needs, read from vLLM at the allocation. A plain tuple (one per
# load, built on vLLM's per-request path), in this order:
#   request        vLLM's Request
#   local          tokens computed locally before the load
#   loaded         tokens computed once it lands
#   loaded_groups  the inner connector's get_loaded_kv_cache_group_ids
#   written        per loaded group, the ids of the blocks written
#   states         the state blocks it writes, where verified with states
#   claim          the producer's zero-tail claim, if read
#   expected       the digest to verify, if read
#   req_id         the request's id (read at the allocation: at the metadata
#                  the request object is out of cache)
Allocation = tuple[
    Any,
    int,
    int,
    Any,
    tuple[tuple[int, ...], ...],
    tuple[GroupLoad, ...],
    "int | None",
    "ExpectedDigest | None",
    str,
]


class ConsumerTailsScheduler:
    """This step's async loads (allocations, then records), until its metadata is built."""

    def __init__(self) -> None:
        # The allocations not yet recorded; the alloc hook appends to this
        # very list (it is cleared in place, never replaced).
        self.allocations: list[Allocation] = []
        # The step's records (the scheduler's one pass appends in place: what
        # add does); cleared in place, never replaced.
        self.records: list[LoadRecord] = []

    def take_allocations(self) -> list[Allocation]:
        taken = self.allocations[:]
        self.allocations.clear()
        return taken

    def add(self, record: LoadRecord) -> None:
        self.records.append(record)

    @property
    def pending(self) -> tuple[LoadRecord, ...]:
        return tuple(self.records)

    def clear(self) -> None:
        """Forget the records and the allocations not yet recorded."""
        self.records.clear()
        self.allocations.clear()

    def holding(self) -> tuple[Sized, ...]:
        """The containers :meth:`held` reads, live (never replaced): empty
        together exactly when :meth:`held` is."""
        return (self.records, self.allocations)

    def held(self) -> set[str]:
        held = {r.req_id for r in self.records}
        if self.allocations:
            held.update(a[8] for a in self.allocations)
        return held

    @property
    def num_tracked(self) -> int:
        return len(self.records) + len(self.allocations)
