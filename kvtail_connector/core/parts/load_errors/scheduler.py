"""Load errors, scheduler half: every async load in flight, and each failed
load counted once.

A load fails when a worker reports it in ``failed_recving`` or when it holds
a block of ``invalid_block_ids`` (both aggregated over the workers by vLLM);
errors may precede the completion, so a load's failure is remembered until
vLLM reports it finished. A load whose record a contained internal error
lost is shipped to the workers as ``failing``: they report it failed when it
completes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from kvtail_connector import _compat
from kvtail_connector.core.stats import KVTailStats


class LoadErrorsScheduler:
    """Loads in flight (the blocks each writes), failures counted, records lost."""

    def __init__(self, stats: KVTailStats) -> None:
        self._stats = stats
        # request -> ids per group of the blocks its load writes
        self._in_flight: dict[str, tuple[Sequence[int], ...]] = {}
        self._failed: set[str] = set()
        self._failing: list[str] = []

    def started(self, req_id: str, blocks: tuple[Sequence[int], ...]) -> None:
        """An async load of ``req_id`` writing ``blocks`` (ids per group, a
        window's gap as :data:`~kvtail_connector.core.metadata.NULL_BLOCK`, which
        no reported id matches) is in flight. Kept as given: they are searched
        only when invalid blocks are reported."""
        self._in_flight[req_id] = blocks

    def lost(self, req_id: str, blocks: tuple[Sequence[int], ...] = ()) -> None:
        """The async load of ``req_id`` has no record: the workers report it
        failed when it completes (counted in ``failed_loads``: in flight, with
        ``blocks`` where known and not yet given to :meth:`started`)."""
        self._in_flight.setdefault(req_id, blocks)
        self._failing.append(req_id)

    @property
    def failing(self) -> list[str]:
        """Loads lost since the last metadata."""
        return self._failing

    def take_failing(self) -> tuple[str, ...]:
        failing = tuple(self._failing)
        self._failing.clear()
        return failing

    @property
    def in_flight(self) -> Any:
        """The ids of the loads in flight (a set-like view)."""
        return self._in_flight.keys()

    def settle(self, connector_output: Any) -> list[str]:
        """Count this step's new failures; forget the loads reported finished
        and return their ids."""
        reported = connector_output.failed_recving
        failed = set(reported) & self._in_flight.keys() if reported else set()
        invalid = connector_output.invalid_block_ids
        if invalid:
            # vLLM's null block is shared, never a load's own: not a failure
            # (the ids kept here hold NULL_BLOCK for it; a guard all the same).
            invalid = set(invalid) - {_compat.NULL_BLOCK_ID}
            failed.update(
                r
                for r, blocks in self._in_flight.items()
                if any(not invalid.isdisjoint(ids) for ids in blocks)
            )
        if failed:
            new = failed - self._failed
            if new:
                self._stats.add("failed_loads", len(new))
                self._failed |= new
        finished = connector_output.finished_recving
        return self.finished(finished) if finished else []

    def finished(self, req_ids: Iterable[str]) -> list[str]:
        """Forget these loads; the ids of those that were in flight."""
        done = [req_id for req_id in req_ids if self._in_flight.pop(req_id, None) is not None]
        if self._failed:
            self._failed.difference_update(done)
        return done

    def held(self) -> AbstractSet[str]:
        return self._in_flight.keys()

    @property
    def num_tracked(self) -> int:
        return len(self._in_flight) + len(self._failed) + len(self._failing)
