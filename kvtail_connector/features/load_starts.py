"""What ``get_num_new_matched_tokens`` said about a request's load, until its
allocation: the first fact of every consumer-side part.

At the match the wrapper learns the local computed count and whether the
inner load is async; ``update_state_after_alloc`` then gives the blocks and
the external token count. Kept from the latest match with a positive hit to
the allocation that consumes it (or the request's end).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Any

Start = tuple[int, bool]  # (local computed tokens, the load is async)


class LoadStarts:
    """Request id -> :data:`Start`, from the match to the allocation."""

    def __init__(self) -> None:
        self._matched: dict[str, Start] = {}

    def matched(
        self, request: Any, num_computed_tokens: int, count: int | None, load_async: bool
    ) -> None:
        """The inner ``get_num_new_matched_tokens`` returned ``(count, load_async)``."""
        if count:
            self._matched[request.request_id] = (num_computed_tokens, bool(load_async))
        else:
            self._matched.pop(request.request_id, None)

    def get(self, req_id: str) -> Start | None:
        return self._matched.get(req_id)

    def pop(self, req_id: str) -> Start | None:
        return self._matched.pop(req_id, None)

    def held(self) -> AbstractSet[str]:
        return self._matched.keys()

    @property
    def num_tracked(self) -> int:
        return len(self._matched)
