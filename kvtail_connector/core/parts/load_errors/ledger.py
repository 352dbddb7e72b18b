"""Invalid blocks, each owned by the load that held the block when it was reported.

vLLM's contract (``KVConnectorBase_V1.get_block_ids_with_load_errors``): an
async load's failed blocks are reported in some pass up to and including the
one that reports the load finished. Once a load is done its blocks can be
freed and handed to another request, so an id reported for it must never be
read as a failure of the block's next owner. The ledger therefore attributes
every reported id, at once, to the load in flight that holds the block (the
same rule vLLM's scheduler applies, by block id at report time), drops ids no
tracked load holds, and forgets a load's ids with the load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvtail_connector.core.containment import call_inner

# request id -> the blocks its load in flight writes (iterated only when ids
# are reported).
InFlight = Callable[[], Iterable[tuple[str, Iterable[int]]]]


class LoadErrorLedger:
    """The blocks reported invalid, by the load in flight that holds each.

    The worker fetches the inner connector's errors early, inside
    ``get_transfer_results`` (a load completing in that pass needs them to
    decide between zeroing its tail and treating it as failed), and hands the
    same ids to the model runner when it asks right after.

    Args:
        in_flight: the loads in flight and their blocks, as the consumer-tails
            part holds them (the ledger keeps no copy: tracking and releasing a
            load cost nothing here; the search runs only when ids are reported).
            A block is written by one load in flight at a time (vLLM allocates
            it to one request), so an id has at most one owner.
    """

    def __init__(self, in_flight: InFlight) -> None:
        self._in_flight = in_flight
        self._invalid: dict[str, set[int]] = {}  # request -> its blocks reported invalid
        self._for_runner: set[int] = set()  # fetched early, not yet handed to the runner

    def new_load(self, req_id: str) -> None:
        """A new load of ``req_id`` started: ids reported for an earlier one are not its own."""
        if self._invalid:
            self._invalid.pop(req_id, None)

    def release(self, req_id: str) -> set[int]:
        """Forget ``req_id``'s load; return its blocks that were reported invalid."""
        return self._invalid.pop(req_id, set()) if self._invalid else set()

    @property
    def has_invalid(self) -> bool:
        """Some load holds a block reported invalid."""
        return bool(self._invalid)

    def fetch(self, inner: Any) -> None:
        """Ask the inner connector now, ahead of the runner, and attribute."""
        fresh = _ask(inner)
        self._for_runner |= fresh
        self._attribute(fresh)

    def take(self, inner: Any) -> set[int]:
        """The runner's ``get_block_ids_with_load_errors``: ids fetched early in
        this pass plus what the inner connector reports now (attributed too)."""
        fresh = _ask(inner)
        self._for_runner |= fresh  # first: kept for drain() should attributing fail
        self._attribute(fresh)
        out, self._for_runner = self._for_runner, set()
        return out

    def drain(self) -> set[int]:
        """Every id fetched and not yet handed to the runner (after a contained
        internal error: the runner still gets every id the inner connector
        reported)."""
        out, self._for_runner = self._for_runner, set()
        return out

    def _attribute(self, errors: set[int]) -> None:
        if not errors:
            return
        for req_id, blocks in self._in_flight():
            hit = errors.intersection(blocks)
            if hit:
                self._invalid.setdefault(req_id, set()).update(hit)

    @property
    def num_tracked(self) -> int:
        """Entries held (0 when idle and the runner has collected every id)."""
        return len(self._invalid) + len(self._for_runner)


def _ask(inner: Any) -> set[int]:
    """The inner connector's ids; its exceptions (iterating its answer too)
    tagged as its own."""
    return call_inner(lambda: set(inner.get_block_ids_with_load_errors()))
