"""What ``get_num_new_matched_tokens`` said about a request's load, until its
allocation: the first fact of every consumer-side part.

At the match the wrapper learns the local computed count and whether the
inner load is async; ``update_state_after_alloc`` then gives the blocks and
the external token count. Kept from the latest match with a positive hit to
the allocation that consumes it (or the request's end).
"""

from __future__ import annotations

from collections.abc import KeysView
from dataclasses import dataclass


@dataclass(slots=True)
class LoadStart:
    """A load as matched: ``local`` tokens computed before it; ``is_async``:
    the inner connector loads it asynchronously (else a synchronous READ)."""

    local: int
    is_async: bool


class LoadStarts:
    """Request id -> :class:`LoadStart`, from the match to the allocation."""

    def __init__(self) -> None:
        self._starts: dict[str, LoadStart] = {}

    def matched(self, req_id: str, local: int, count: int | None, load_async: bool) -> None:
        """The inner connector's match: ``count`` external tokens (0 or None:
        no load to wait for)."""
        if count:
            self._starts[req_id] = LoadStart(local, bool(load_async))
        else:
            self._starts.pop(req_id, None)

    def get(self, req_id: str) -> LoadStart | None:
        return self._starts.get(req_id)

    def pop(self, req_id: str) -> LoadStart | None:
        return self._starts.pop(req_id, None)

    def put_back(self, req_id: str, start: LoadStart) -> None:
        """An allocation that failed: its start stays for the fallback."""
        self._starts[req_id] = start

    def held(self) -> KeysView[str]:
        return self._starts.keys()

    @property
    def num_tracked(self) -> int:
        return len(self._starts)
