"""What ``get_num_new_matched_tokens`` said about a request's load, until its
allocation: the first fact of every consumer-side part.

At the match the wrapper learns the local computed count and whether the
inner load is async; ``update_state_after_alloc`` then gives the blocks and
the external token count. Kept from the latest match with a positive hit to
the allocation that consumes it (or the request's end).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from collections.abc import Sized

# (local computed tokens, the load is async: the inner connector's value as
# given, read for its truth)
Start = tuple[int, bool]


class LoadStarts:
    """Request id -> :data:`Start`, from the match to the allocation.

    ``by_request`` is the dict itself: the per-load hooks (the match, the
    allocation, the finish) read and write it in place, a call less each.
    """

    def __init__(self) -> None:
        self.by_request: dict[str, Start] = {}

    def pop(self, req_id: str) -> Start | None:
        return self.by_request.pop(req_id, None)

    def holding(self) -> tuple[Sized, ...]:
        """The containers :meth:`held` reads, live (never replaced): empty
        together exactly when :meth:`held` is."""
        return (self.by_request,)

    def held(self) -> AbstractSet[str]:
        return self.by_request.keys()

    @property
    def num_tracked(self) -> int:
        return len(self.by_request)
