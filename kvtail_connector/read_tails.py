"""MoRIIO READ tails on vLLM 0.32: zeroed layer by layer, as each layer's READs land.

A MoRIIO READ copies whole producer blocks, the producer's tail included. On
0.33, and on 0.32 under FULL CUDA graphs, every READ has landed when
``start_load_kv`` returns and the worker zeroes the tails there. Otherwise 0.32
waits for a layer's READs in that layer's ``wait_for_layer_load``, right before
its attention runs: a READ landing later would bring the producer's tail back,
so each layer's tail is zeroed right after that wait returns, on the current
stream, ahead of the layer's attention.

The backend may already have written this step's recomputed tokens (a KV update
op before the attention op); records for READ loads count them (see
``TailScheduler._read_records``), so the zeroing starts after them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtail_connector.layout import CacheSet, cache_slot_bytes, cache_slots
from kvtail_connector.ops import KVZeroer
from kvtail_connector.ops.zeroer import Line


@dataclass
class _LayerWork:
    """What one layer still has to zero this step."""

    lines: list[Line] = field(default_factory=list)
    owners: list[str] = field(default_factory=list)
    nbytes: int = 0


class ReadTailsByLayer:
    """One zeroer group per layer, and the READ tails each layer waits to zero.

    Args:
        sets: the worker's cache sets; set ``i``'s items ``(i, block, first)``
            become one item per layer of the set.
    """

    def __init__(self, sets: list[CacheSet]) -> None:
        self.layer_sets = [
            CacheSet(s.group_id, s.pages_per_block, s.tokens_per_state, [cache], [name])
            for s in sets
            for cache, name in zip(s.caches, s.layer_names, strict=True)
        ]
        self._children: list[list[int]] = []
        i = 0
        for s in sets:
            self._children.append(list(range(i, i + len(s.caches))))
            i += len(s.caches)
        self.zeroer = KVZeroer([([c], s.pages_per_block) for s in sets for c in s.caches])
        self._slot_bytes = [cache_slot_bytes(ls.caches[0]) for ls in self.layer_sets]
        self._slots = [ls.pages_per_block * cache_slots(ls.caches[0]) for ls in self.layer_sets]
        self._work: dict[str, _LayerWork] = {}

    @property
    def pending(self) -> bool:
        return bool(self._work)

    @property
    def num_pending(self) -> int:
        """Layers with tails still to zero."""
        return len(self._work)

    @property
    def last_launch_done(self) -> torch.cuda.Event | None:
        return self.zeroer.last_launch_done

    def arm(self, owner: str, items: list[tuple[int, int, int]]) -> None:
        """Queue ``items`` (set index, block, first slot) of request ``owner``
        for every layer of their sets."""
        for set_index, block, first in items:
            for child in self._children[set_index]:
                line = self.zeroer.line(child, block, first)
                if line is None:
                    continue
                work = self._work.setdefault(self.layer_sets[child].layer_names[0], _LayerWork())
                work.lines.append(line)
                work.owners.append(owner)
                work.nbytes += self._slot_bytes[child] * (self._slots[child] - first)

    def take(self, layer_name: str) -> _LayerWork | None:
        """The work of ``layer_name`` (None if it has none), removed."""
        return self._work.pop(layer_name, None)

    def take_all(self) -> _LayerWork | None:
        """Every layer's remaining work as one (None if none is left)."""
        if not self._work:
            return None
        merged = _LayerWork()
        for work in self._work.values():
            merged.lines += work.lines
            merged.owners += work.owners
            merged.nbytes += work.nbytes
        self._work.clear()
        return merged

    def zero(self, work: _LayerWork) -> None:
        self.zeroer.zero_lines(work.lines)
