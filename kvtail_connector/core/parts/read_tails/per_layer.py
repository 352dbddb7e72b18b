"""MoRIIO READ tails zeroed layer by layer: vLLM 0.32 only, where a READ may
not have landed when ``start_load_kv`` returns (no FULL CUDA graphs). Each
layer's tails are zeroed at its ``wait_for_layer_load``, before its attention
(:mod:`~kvtail_connector.core.parts.read_tails.by_layer`); where arming those
launches failed, on the reference path
(:mod:`~kvtail_connector.core.parts.read_tails.on_reference`). Dropping 0.32
deletes this module, ``by_layer`` and ``on_reference``, and the branch of
:class:`~kvtail_connector.core.parts.read_tails.worker.ReadTailsWorker` that
builds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtail_connector.core.cache_sets import CacheSet
from kvtail_connector.core.metadata import LoadRecord
from kvtail_connector.core.parts.read_tails.by_layer import LayerWork, ReadTailsByLayer
from kvtail_connector.core.parts.read_tails.on_reference import ReferenceLayers
from kvtail_connector.core.parts.zeroing import RankCaches
from kvtail_connector.core.probe import probe_items
from kvtail_connector.log import get_logger, request_names
from kvtail_connector.ops import reference_zero_kv_blocks

logger = get_logger(__name__)


@dataclass(slots=True)
class _Found:
    """What the probe found in one request's READ tails, over the layers."""

    nonzero: int = 0  # bytes
    nonfinite: int = 0  # values


class PerLayerReadTails:
    """The READ tails armed per layer this step, and their fallbacks.

    Args:
        rank: this rank's caches and zeroer.
    """

    def __init__(self, rank: RankCaches) -> None:
        self._rank = rank
        self._by_layer: ReadTailsByLayer | None = None
        self._released: ReadTailsByLayer | None = None
        self._layer_probe: dict[str, _Found] = {}  # per request, summed over layers
        self._layer_bytes = 0  # launched layer by layer, counted once the layers are done
        self._layers_launched = False  # this step: by_layer's event is the latest zeroing
        # Layers' work taken from by_layer and not yet launched (the one being
        # zeroed, and at end_step those after it): a contained failure zeroes
        # them on the reference path, since nothing else holds them any more.
        # Its first item leaves it as soon as its launch returned.
        self._taken: list[LayerWork] = []
        self._warned_reference = False
        # Armed where starting the READs failed before they had landed: each
        # layer's tails zeroed on the reference path at its wait.
        self._on_reference = ReferenceLayers()

    def register(self, sets: list[CacheSet]) -> None:
        self._released = None
        self._taken = []
        self._by_layer = ReadTailsByLayer(sets)
        self._by_layer.zeroer.warmup()

    def release(self) -> None:
        self._released, self._by_layer = self._by_layer, None
        self._taken = []
        self._on_reference.clear()

    def restore(self) -> None:
        self._by_layer, self._released = self._released, None

    def forget_released(self) -> None:
        self._released = None

    @property
    def ready(self) -> bool:
        """Caches registered: READ tails can be armed per layer."""
        return self._by_layer is not None

    def step_began(self) -> None:
        """A new step's metadata is bound: nothing armed may be left."""
        if self._on_reference.layers:
            # A step that ended without end_step: zeroed later, they could
            # wipe KV written since.
            logger.error(
                "KVTailConnector: READ tails of %s left stale (their step ended early)",
                request_names(self._on_reference.owners),
            )
            self._on_reference.clear()

    def arm(self, records: list[LoadRecord]) -> None:
        """Each layer's tails of ``records``, zeroed once that layer's READs landed."""
        by_layer, rank = self._by_layer, self._rank
        assert by_layer is not None
        for r in records:
            by_layer.arm(r.req_id, rank.tail_items(r))
        by_layer.stage()

    def reset(self) -> None:
        """Forget this step's work armed or staged per layer."""
        if self._by_layer is not None:
            self._by_layer.reset()

    def arm_on_reference(self, records: list[LoadRecord]) -> None:
        """Starting the READs failed before they landed: each layer's tails of
        ``records`` zeroed on the reference path at its wait, before its
        attention, as the per-layer launches would have."""
        rank = self._rank
        try:
            self._on_reference.arm(rank.sets, [(r.req_id, rank.tail_items(r)) for r in records])
        except Exception:
            self._on_reference.clear()
            logger.error(
                "KVTailConnector: READ tails of %s not zeroed (reads not landed yet)",
                request_names(r.req_id for r in records),
            )
            raise
        self._warn_reference(
            request_names(r.req_id for r in records), "each layer once its READs land"
        )

    def layer_loaded(self, layer_name: str) -> None:
        """``wait_for_layer_load(layer_name)`` returned: that layer's READs have
        landed and its attention has not run; zero its READ tails."""
        by_layer = self._by_layer
        if by_layer is None or not by_layer.pending:
            reference = self._on_reference
            if reference.layers:  # its READs landed, its attention not run yet
                self._zero_armed(lambda: reference.zero(layer_name), layer_name)
            return
        taken: list[LayerWork] = []
        self._taken = taken  # nothing of an earlier call's, whatever it raised
        work = by_layer.take(layer_name)
        if work is not None:
            taken.append(work)
            self._zero_layer(by_layer, work)

    def end_step(self) -> None:
        """After the forward: layers whose ``wait_for_layer_load`` never ran
        (no KV-transfer hook, e.g. the indexer cache) are zeroed now. This is
        after their first read, but never wipes valid KV: the zeroing starts
        at the producer's prompt length, past which this step wrote only the
        rows vLLM pads a new decode with (draft id -1, always rejected)."""
        if self._on_reference.layers:
            self._zero_armed(self._on_reference.zero_rest, "after the forward")
        by_layer = self._by_layer
        if by_layer is None:
            return
        self._taken = left = by_layer.take_all()
        if left:
            logger.debug("kvtail: READ tails of %d layer(s) zeroed after the forward", len(left))
        while left:
            self._zero_layer(by_layer, left[0])  # takes it out of left once launched
        by_layer.record_done()
        self._flush_layers(by_layer)

    def _zero_layer(self, by_layer: ReadTailsByLayer, work: LayerWork) -> None:
        """Zero ``work``, which is ``self._taken[0]``: out of it once launched
        (a failure after the launch must not zero and count it again)."""
        rank = self._rank
        if rank.probe:
            found = probe_items(
                by_layer.layer_sets,
                np.array(work.items, dtype=np.int64),
                work.armed.owners,
            )
            for req_id, (nonzero, nonfinite) in found.items():
                summed = self._layer_probe.setdefault(req_id, _Found())
                summed.nonzero += nonzero
                summed.nonfinite += nonfinite
        nbytes = by_layer.nbytes(work)
        by_layer.zero(work)
        del self._taken[0]
        self._layers_launched = True
        self._layer_bytes += nbytes  # launched
        if not by_layer.pending:
            # Every layer is done (its launch recorded the event): one count,
            # and one probe report per request, as for other tails.
            self._flush_layers(by_layer)

    def _flush_layers(self, by_layer: ReadTailsByLayer) -> None:
        rank = self._rank
        if self._layers_launched:
            # Recorded behind this step's last layer launch (or record_done):
            # later on the stream than any earlier zeroing. Otherwise it is an
            # older step's event, and the rank's own stays the latest.
            rank.last_zeroing = by_layer.last_launch_done
            self._layers_launched = False
        if self._layer_bytes:
            rank.stats.add("tail_bytes_zeroed", self._layer_bytes)
            self._layer_bytes = 0
        if self._layer_probe:
            summed, self._layer_probe = self._layer_probe, {}
            rank.report_found({req: (f.nonzero, f.nonfinite) for req, f in summed.items()})

    # ------------------------------------------------- contained failures

    def contain_layer_loaded(self) -> None:
        """``layer_loaded`` failed: zero the tails of the layer it was zeroing
        on the reference path (slow, exact, independent of the zeroer's
        kernels and work lines), now, on the current stream: still before
        that layer's attention. Its event is recorded at ``end_step``."""
        taken, self._taken = self._taken, []
        by_layer = self._by_layer
        if by_layer is None or not taken:
            return
        try:
            self._zero_on_reference(by_layer, taken)
        except Exception:
            logger.error(
                "KVTailConnector: READ tails of %s may be left stale (%s)",
                _owners(taken),
                by_layer.layer_sets[taken[0].group].layer_names[0],
            )
            raise

    def contain_end_step(self) -> None:
        """``end_step`` failed: zero the per-layer READ work left on the
        reference path, as ``end_step`` would have (after the forward), and
        count what was zeroed; nothing is left for a later step to zero over
        KV written since."""
        taken, self._taken = self._taken, []
        by_layer = self._by_layer
        self._layer_probe = {}
        if by_layer is None:
            self._layers_launched = False
            return
        works, done = taken, False
        try:
            works = taken + by_layer.take_all()
            self._zero_on_reference(by_layer, works)
            done = True
        finally:
            # Should this fail too (the guard logs it): what ran on the stream
            # is fenced all the same, and no work is left behind.
            try:
                by_layer.record_done()
                if self._layers_launched:
                    self._rank.last_zeroing = by_layer.last_launch_done
            finally:
                by_layer.reset()
                self._layers_launched = False
            if self._layer_bytes:  # launched before the failure
                self._rank.stats.add("tail_bytes_zeroed", self._layer_bytes)
                self._layer_bytes = 0
            if not done and works:
                logger.error(
                    "KVTailConnector: READ tails of %s may be left stale (after the forward)",
                    _owners(works),
                )

    def _zero_armed(self, zero: Callable[[], object], where: str) -> None:
        """``zero()`` the armed tails of :class:`ReferenceLayers` (``where``:
        which, for the log); the fence's event recorded behind, even where
        it fails partway."""
        owners = self._on_reference.owners
        try:
            zero()
        except Exception:
            logger.error(
                "KVTailConnector: READ tails of %s may be left stale (%s)",
                request_names(owners),
                where,
            )
            raise
        finally:
            self._rank.mark_zeroed()

    def _warn_reference(self, owners: str, where: str) -> None:
        # Once at WARNING: a failure that repeats repeats every layer, every step.
        log = logger.debug if self._warned_reference else logger.warning
        self._warned_reference = True
        log("KVTailConnector: READ tails of %s zeroed on the reference path (%s)", owners, where)

    def _zero_on_reference(self, by_layer: ReadTailsByLayer, works: list[LayerWork]) -> None:
        """Zero ``works`` on the reference path, on the current stream (an event
        recorded by ``by_layer.record_done`` covers it); bytes counted."""
        for work in works:
            layer = by_layer.layer_sets[work.group]
            # Marked before: should it raise partway, what it queued is still
            # recorded behind (record_done) and fenced.
            by_layer.zeroed_apart()
            self._layers_launched = True
            reference_zero_kv_blocks(
                layer.caches,
                tails=list(work.armed.blocks_firsts),
                pages_per_block=layer.pages_per_block,
            )
            self._layer_bytes += by_layer.nbytes(work)
            self._warn_reference(_owners([work]), layer.layer_names[0])

    def held(self) -> set[str]:
        held = set(self._on_reference.owners)
        if self._by_layer is not None:
            held |= self._by_layer.owners_pending()
        return held

    @property
    def num_pending(self) -> int:
        waiting_layers = self._by_layer.num_pending if self._by_layer is not None else 0
        return waiting_layers + self._on_reference.num_pending


def _owners(works: list[LayerWork]) -> str:
    """The requests whose READ tails ``works`` zero, for a log line."""
    return request_names(owner for work in works for owner in work.armed.owners)
