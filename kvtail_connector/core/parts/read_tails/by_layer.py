"""MoRIIO READ tails on vLLM 0.32: zeroed layer by layer, as each layer's READs land.

A MoRIIO READ copies whole producer blocks, the producer's tail included. On
0.33, and on 0.32 under FULL CUDA graphs, every READ has landed when
``start_load_kv`` returns and the worker zeroes the tails there. Otherwise 0.32
waits for a layer's READs in that layer's ``wait_for_layer_load``, right before
its attention runs: a READ landing later would bring the producer's tail back,
so each layer's tail is zeroed right after that wait returns, on the current
stream, ahead of the layer's attention.

The backend may already have written this step's tokens (a KV update op before
the attention op) when the READ lands over them; records for READ loads start
the zeroing at the producer's prompt length (see
``TailScheduler._read_records``): the producer's KV is valid up to there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvtail_connector.core.cache_sets import CacheSet, TailBytes
from kvtail_connector.ops import KVZeroer


@dataclass
class _Armed:
    """One cache set's READ tails this step, a launch staged for each of the
    set's layers (``KVZeroer.stage``: one work buffer on the device for them
    all, where the layers are alike)."""

    blocks_firsts: list[tuple[int, int]]
    owners: list[str]
    launches: list[Callable[[], None] | None]  # per layer of the set; None: nothing
    # Slots per block -> the stale slots of every item together: a layer's
    # bytes are its slot bytes times that (one lookup per layer, not a pass).
    stale: dict[int, int]

    def stale_slots(self, slots: int) -> int:
        found = self.stale.get(slots)
        if found is None:
            found = self.stale[slots] = sum(max(slots - f, 0) for _, f in self.blocks_firsts)
        return found


class LayerWork(NamedTuple):
    """What one layer has to zero."""

    armed: _Armed
    k: int  # index in the set's layers (and in ``armed.launches``)
    group: int  # the layer's zeroer group

    @property
    def items(self) -> list[tuple[int, int, int]]:
        return [(self.group, b, f) for b, f in self.armed.blocks_firsts]


class _Place(NamedTuple):
    """A layer's place."""

    set_index: int
    k: int  # index in the set's layers
    group: int  # the layer's zeroer group


class ReadTailsByLayer:
    """One zeroer group per layer, and the READ tails each layer waits to zero.

    Args:
        sets: the worker's cache sets; set ``i``'s items ``(i, block, first)``
            become one item per layer of the set.
        implementation: the zeroer's (``KVZeroer``); ``"auto"``: Triton on
            CUDA caches, torch on CPU ones.
    """

    def __init__(self, sets: list[CacheSet], implementation: str = "auto") -> None:
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
        self._names = [ls.layer_names[0] for ls in self.layer_sets]
        self.zeroer = KVZeroer(
            [([c], s.pages_per_block) for s in sets for c in s.caches],
            implementation=implementation,  # type: ignore[arg-type]
        )
        self._tail_bytes = TailBytes.of(self.layer_sets)
        # Per set, its layers' places by name (merged into the pending ones
        # in one C-level update per step).
        self._places: list[dict[str, _Place]] = [
            {self._names[child]: _Place(s, k, child) for k, child in enumerate(children)}
            for s, children in enumerate(self._children)
        ]
        self._armed: list[list[tuple[str, int, int]]] = [[] for _ in sets]
        self._step: list[_Armed | None] = [None] * len(sets)
        self._work: dict[str, _Place] = {}  # layers still to zero this step
        self._unrecorded = False  # launched since the last recorded event

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

    def owners_pending(self) -> set[str]:
        """Requests with layers still to zero."""
        sets = {place.set_index for place in self._work.values()}
        return {owner for s in sets for owner in self._batch(s).owners}

    def arm(self, owner: str, items: list[tuple[int, int, int]]) -> None:
        """Queue ``items`` (set index, block, first slot) of request ``owner``
        for every layer of their sets (see :meth:`stage`)."""
        for set_index, block, first in items:
            self._armed[set_index].append((owner, block, first))

    def stage(self) -> None:
        """Turn what was armed into one launch per layer, put on the device
        with one copy per cache set: each layer then costs one kernel launch
        when it lands. All or nothing: the work becomes pending only once
        every set is staged; if staging raises, nothing is pending and the
        armed items are dropped (never zeroed a step later, over KV the step
        in between wrote)."""
        staged: list[tuple[int, _Armed]] = []
        try:
            for set_index, armed in enumerate(self._armed):
                if not armed:
                    continue
                blocks_firsts = [(block, first) for _, block, first in armed]
                launches = self.zeroer.stage(self._children[set_index], blocks_firsts)
                owners = [owner for owner, _, _ in armed]
                staged.append((set_index, _Armed(blocks_firsts, owners, launches, {})))
        finally:
            for armed in self._armed:
                armed.clear()
        for set_index, batch in staged:
            self._step[set_index] = batch
            self._work.update(
                (name, place)
                for name, place in self._places[set_index].items()
                if batch.launches[place.k] is not None
            )

    def reset(self) -> None:
        """Drop everything armed and pending (a contained failure: this step's
        READ tails are not zeroed, and nothing of it is left for a later step)."""
        for armed in self._armed:
            armed.clear()
        self._work.clear()
        self._step = [None] * len(self._step)

    def nbytes(self, work: LayerWork) -> int:
        """Bytes ``work`` zeroes."""
        tail_bytes = self._tail_bytes
        group = work.group
        return tail_bytes.slot_bytes[group] * work.armed.stale_slots(tail_bytes.slots[group])

    def peek(self, layer_name: str) -> LayerWork | None:
        """The work of ``layer_name`` (None if it has none), left pending."""
        place = self._work.get(layer_name)
        return (
            None if place is None else LayerWork(self._batch(place.set_index), place.k, place.group)
        )

    def take(self, layer_name: str) -> LayerWork | None:
        """The work of ``layer_name`` (None if it has none), removed: only once
        built (should that raise, the work stays pending for the step's end)."""
        place = self._work.get(layer_name)
        if place is None:
            return None
        work = LayerWork(self._batch(place.set_index), place.k, place.group)
        del self._work[layer_name]
        return work

    def take_all(self) -> list[LayerWork]:
        """Every layer's remaining work, removed."""
        works = [LayerWork(self._batch(p.set_index), p.k, p.group) for p in self._work.values()]
        self._work.clear()
        return works

    def zero(self, work: LayerWork) -> None:
        """Launch ``work``; the done event is recorded only behind the last
        layer's launch (or by :meth:`record_done`)."""
        launch = work.armed.launches[work.k]
        assert launch is not None, "a pending layer has a launch staged"
        launch()
        last = not self._work
        if last:
            self.zeroer.record_done()
        self._unrecorded = not last

    def zeroed_apart(self) -> None:
        """Zeroing ran on the stream outside :meth:`zero` (a contained failure's
        reference path): :meth:`record_done` records an event behind it."""
        self._unrecorded = True

    def record_done(self) -> None:
        """Make :attr:`last_launch_done` cover every launch so far."""
        if self._unrecorded:
            self.zeroer.record_done()
            self._unrecorded = False

    def _batch(self, set_index: int) -> _Armed:
        batch = self._step[set_index]
        assert batch is not None, "a pending layer's set was staged this step"
        return batch
