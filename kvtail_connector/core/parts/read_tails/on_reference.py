"""READ tails zeroed layer by layer on the reference path: the fallback where
arming the per-layer launches failed before the READs landed (vLLM 0.32).

Each layer's tails are zeroed once that layer's READs have landed
(``wait_for_layer_load``) and before its attention, as the per-layer launches
would have, with plain torch ops that share no state with the zeroer
(:func:`~kvtail_connector.ops.reference_zero_kv_blocks`); the layers whose wait
never ran, after the forward.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtail_connector.core.cache_sets import CacheSet
from kvtail_connector.ops import reference_zero_kv_blocks


class ReferenceLayers:
    """The READ tails of one step, per layer, until each is zeroed."""

    def __init__(self) -> None:
        self._sets: list[CacheSet] = []
        # cache set index -> its (block, first stale slot) tails
        self._tails: dict[int, list[tuple[int, int]]] = {}
        # layer -> (cache set index, the layer's index in that set), per set
        # holding it; empty when nothing is armed (read on every layer's wait)
        self.layers: dict[str, list[tuple[int, int]]] = {}
        self.owners: set[str] = set()

    def arm(
        self, sets: list[CacheSet], items: Iterable[tuple[str, Iterable[tuple[int, int, int]]]]
    ) -> None:
        """Replace what is armed with ``items``: per request, its tail items
        ``(cache set index, block, first stale slot)`` in ``sets``."""
        tails: dict[int, list[tuple[int, int]]] = {}
        owners: set[str] = set()
        for owner, owned in items:
            for index, block, first in owned:
                tails.setdefault(index, []).append((block, first))
            owners.add(owner)
        layers: dict[str, list[tuple[int, int]]] = {}
        for index in tails:
            for k, name in enumerate(sets[index].layer_names):
                layers.setdefault(name, []).append((index, k))
        if not layers:  # no tail on this rank: nothing held
            owners = set()
        self._sets, self._tails, self.layers, self.owners = sets, tails, layers, owners

    @property
    def num_pending(self) -> int:
        """Layers with tails still to zero."""
        return len(self.layers)

    def zero(self, layer_name: str) -> None:
        """Zero ``layer_name``'s tails (if it has any left), on the current
        stream. Forgotten first: should this raise, it is not zeroed again
        later, over KV written since."""
        places = self.layers.pop(layer_name, None)
        if places is None:
            return
        try:
            for index, k in places:
                cache_set = self._sets[index]
                reference_zero_kv_blocks(
                    [cache_set.caches[k]],
                    tails=self._tails[index],
                    pages_per_block=cache_set.pages_per_block,
                )
        finally:
            if not self.layers:
                self.clear()

    def zero_rest(self) -> None:
        """Zero every layer left (its wait never ran); nothing is left armed,
        even should one raise."""
        try:
            for name in list(self.layers):
                self.zero(name)
        finally:
            self.clear()

    def clear(self) -> None:
        self._sets, self._tails, self.layers, self.owners = [], {}, {}, set()
