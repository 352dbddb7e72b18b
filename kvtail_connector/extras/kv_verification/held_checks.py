"""Loads held until their digest is on the host, then compared: the part of a
consumer's check that attention and state digests share.

A check carries the CUDA event behind its read-back (None on CPU). Each
completion pass queries it; after
:data:`~kvtail_connector.core.parts.consumer_tails.hold.MAX_PASSES` passes it is
waited for, so a completion is never held forever.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from kvtail_connector.core.parts.consumer_tails.hold import MAX_PASSES
from kvtail_connector.extras.metadata import MISMATCH, UNVERIFIED, Compared


class Check(Protocol):
    event: Any  # CUDA event behind the read-back, or None
    passes: int


C = TypeVar("C", bound=Check)


class HeldChecks(Generic[C]):
    """Checks by request until compared, and the verdicts not yet taken.

    Args:
        compare: a check's verdict and what differs, once its sums are on the host.
    """

    def __init__(self, compare: Callable[[C], Compared]) -> None:
        self._compare = compare
        self._held: dict[str, C] = {}
        # Released since the caller last said its results reached vLLM
        # (:meth:`reported`): a failure in between must still report them.
        self._unreported: set[str] = set()
        self._verdicts: dict[str, str] = {}
        self._differs: dict[str, str] = {}

    def hold(self, req_id: str, check: C) -> None:
        self._held[req_id] = check

    def decide(self, req_id: str, verdict: str) -> None:
        """A verdict reached without a check (nothing to compare)."""
        self._verdicts[req_id] = verdict

    def release(self) -> tuple[set[str], set[str]]:
        """``(finished, mismatched)``: held loads whose sums reached the host
        (after ``MAX_PASSES`` passes, waited for), compared; a mismatch goes
        in both sets, as vLLM's ``failed_recving`` contract has it."""
        finished: set[str] = set()
        bad: set[str] = set()
        for req_id, check in self._held.items():
            check.passes += 1
            if check.event is not None and not check.event.query():
                if check.passes < MAX_PASSES:
                    continue
                check.event.synchronize()
            finished.add(req_id)
            found = self._compare(check)
            self._verdicts[req_id] = found.verdict
            if found.verdict == MISMATCH:
                bad.add(req_id)
                self._differs[req_id] = found.differs
        # Removed only once every one is compared: if a comparison raises,
        # every load is still held, for the caller's fallback (drop_held).
        for req_id in finished:
            del self._held[req_id]
        self._unreported.update(finished)
        return finished, bad

    def reported(self) -> None:
        """What :meth:`release` returned has reached vLLM."""
        self._unreported.clear()

    def drop_held(self) -> set[str]:
        """Forget every held load, uncompared (after a contained internal
        error: the caller reports them failed); returns their ids, and those
        released since the last :meth:`reported` (never returned to vLLM)."""
        held = set(self._held)
        for check in self._held.values():
            if check.event is not None:
                check.event.synchronize()  # the digest read the blocks
        self._held.clear()
        held |= self._unreported
        self._unreported.clear()
        for req_id in held:
            self._verdicts[req_id] = UNVERIFIED
        return held

    def take_verdicts(self) -> dict[str, str]:
        verdicts, self._verdicts = self._verdicts, {}
        return verdicts

    def take_differs(self) -> dict[str, str]:
        """What differs in each load found mismatched since the last call."""
        differs, self._differs = self._differs, {}
        return differs

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._held

    @property
    def held(self) -> set[str]:
        """Loads whose completion waits for their digest."""
        return set(self._held)

    @property
    def busy(self) -> bool:
        """A load held or a verdict pending."""
        return bool(self._held or self._verdicts or self._differs)

    @property
    def num_tracked(self) -> int:
        return len(self._held) + len(self._verdicts) + len(self._differs)
