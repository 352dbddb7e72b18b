"""Layouts refused on purpose: a map that covers no layer of its backends but
says why, and what setting gives a layout that is mapped.

``maps.page_cache`` refuses every layer no map covers; without a map naming
its backend, the message could only say that no map covers it. A refusal map
adds the reason (a writer outside vLLM's source, bytes two tokens share) and
the setting that works, through ``PageMap.hint``.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtail_connector.pages.layer import LayerPage
from kvtail_connector.pages.maps import PageCache, PageMap


def _never(page: LayerPage) -> PageCache:
    raise ValueError("a refused layout has no cache")  # covers() is always False


def refused(layout: str, backends: Iterable[str], reason: str) -> PageMap:
    """A map for ``backends`` that covers none of their layers.

    Args:
        layout: the layout's name, as ``docs/compatibility.md`` lists it.
        backends: the backend class paths whose layers it refuses.
        reason: why the layout cannot be zeroed exactly, then the setting
            that works; the refusal message carries it.
    """
    return PageMap(
        layout=f"{layout} (refused)",
        backends=frozenset(backends),
        covers=lambda page: False,
        cache=_never,
        hint=lambda page: reason,
    )
