"""MoRIIO READ tails, worker half: zeroed once the READ has landed.

A READ copies whole producer blocks, the producer's stale tail included, into
blocks the scheduler half kept out of vLLM's zero list. On vLLM 0.33 (and 0.32
under FULL CUDA graphs) every READ has landed when the inner ``start_load_kv``
returns: one launch zeroes the step's READ tails there, before the forward.
Otherwise each layer's tail is zeroed as that layer's READs land
(vLLM 0.32: :mod:`~kvtail_connector.core.parts.read_tails.per_layer`).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtail_connector.core.cache_sets import CacheSet
from kvtail_connector.core.extension import WorkerExtra
from kvtail_connector.core.metadata import LoadRecord
from kvtail_connector.core.parts.read_tails.per_layer import PerLayerReadTails
from kvtail_connector.core.parts.zeroing import RankCaches
from kvtail_connector.log import get_logger, request_names
from kvtail_connector.ops import reference_zero_kv_blocks

logger = get_logger(__name__)


class ReadTailsWorker:
    """This step's READ loads, and (vLLM 0.32) the per-layer work they armed.

    Args:
        rank: this rank's caches and zeroer.
        by_layer: READs may land layer by layer (``zeroes_reads_by_layer``).
        trusts_load_claims: claims skip zeroing wherever they match
            (``vouch_tails: trust``); else only on the per-layer path.
        extra: the opt-in features' worker half (a producer claim may cover a
            READ's tail), if any.
    """

    def __init__(
        self,
        rank: RankCaches,
        *,
        by_layer: bool,
        trusts_load_claims: bool,
        extra: WorkerExtra | None,
    ) -> None:
        self._rank = rank
        self._trust_all = trusts_load_claims
        self._extra = extra
        self._read_loads: list[LoadRecord] = []
        self._per_layer = PerLayerReadTails(rank) if by_layer else None

    def register(self, sets: list[CacheSet]) -> None:
        if self._per_layer is not None:
            self._per_layer.register(sets)

    def release(self) -> None:
        if self._per_layer is not None:
            self._per_layer.release()

    def restore(self) -> None:
        if self._per_layer is not None:
            self._per_layer.restore()

    def forget_released(self) -> None:
        """New caches supersede what sleep mode put away (never restored)."""
        if self._per_layer is not None:
            self._per_layer.forget_released()

    def bind(self, read_loads: Iterable[LoadRecord]) -> None:
        if self._per_layer is not None:
            self._per_layer.step_began()
        self._read_loads.extend(read_loads)

    @property
    def read_loads(self) -> list[LoadRecord]:
        """The READ loads bound this step (``started`` replaces the list)."""
        return self._read_loads

    def started(self, landed: bool) -> None:
        """The inner ``start_load_kv`` returned. If every READ has landed
        (``landed``), zero this step's READ tails now, before the forward;
        otherwise each layer's, once that layer's READs have landed."""
        if not self._read_loads:
            return
        records, self._read_loads = self._read_loads, []
        rank = self._rank
        per_layer = self._per_layer if not landed and self._per_layer is not None else None
        if per_layer is not None and not per_layer.ready:
            per_layer = None
        # Under "auto" a claim skips only the per-layer launches (0.32, the
        # READs not all landed): where one launch zeroes every READ tail now,
        # skipping saves a share of it, and the tail is zeroed (claim unused).
        if self._extra is not None:
            trusted = per_layer is not None or self._trust_all
            records = self._extra.reads_to_zero(records, trusted=trusted)
            if not records:
                return
        if rank.released:
            logger.warning(
                "KVTailConnector: %d READ load(s) while the KV cache is released: not zeroed",
                len(records),
            )
            return
        if per_layer is None:
            rank.zero([rank.stale_tail(r) for r in records])
        else:
            per_layer.arm(records)
        rank.count_tails(sum(rank.has_tail(r) for r in records))

    def layer_loaded(self, layer_name: str) -> None:
        """``wait_for_layer_load(layer_name)`` returned (see
        :meth:`PerLayerReadTails.layer_loaded`)."""
        if self._per_layer is not None:
            self._per_layer.layer_loaded(layer_name)

    def end_step(self) -> None:
        """After the forward (see :meth:`PerLayerReadTails.end_step`)."""
        if self._per_layer is not None:
            self._per_layer.end_step()

    # ------------------------------------------------- contained failures

    def contain_started(self, records: list[LoadRecord], landed: bool) -> None:
        """``started`` failed. Zero the records' tails on the reference path
        (slow, exact, independent of the zeroer's kernels and work lines):
        where the READs land layer by layer and had not landed (``landed``
        false), each layer's at its wait, as the per-layer launches would
        have; otherwise now, before the forward, as ``started`` would have.
        Forget this step's READ work armed or staged per layer: left there, a
        later step would zero these tails over KV written since."""
        self._read_loads = []
        per_layer = self._per_layer
        if per_layer is not None:
            per_layer.reset()
        rank = self._rank
        if rank.released:
            logger.error(
                "KVTailConnector: READ tails of %s not zeroed (the KV cache is released)",
                request_names(r.req_id for r in records),
            )
            return
        if not landed and per_layer is not None and per_layer.ready:
            per_layer.arm_on_reference(records)
            return
        done = 0
        try:
            for record in records:
                for index, block, first in rank.tail_items(record):
                    cache_set = rank.sets[index]
                    reference_zero_kv_blocks(
                        cache_set.caches,
                        tails=[(block, first)],
                        pages_per_block=cache_set.pages_per_block,
                    )
                done += 1
        finally:
            # Off the zeroer's launches (all queued so far, should one raise):
            # without this, start_load_kv's fence would not wait for them, and
            # a transfer bypassing the stream into these blocks, freed and
            # reused by then, could land before them.
            rank.mark_zeroed()
            if done < len(records):
                logger.error(
                    "KVTailConnector: READ tails of %s may be left stale",
                    request_names(r.req_id for r in records[done:]),
                )

    def contain_layer_loaded(self) -> None:
        """``layer_loaded`` failed (see :meth:`PerLayerReadTails.contain_layer_loaded`)."""
        if self._per_layer is not None:
            self._per_layer.contain_layer_loaded()

    def contain_end_step(self) -> None:
        """``end_step`` failed (see :meth:`PerLayerReadTails.contain_end_step`)."""
        if self._per_layer is not None:
            self._per_layer.contain_end_step()

    def held(self) -> set[str]:
        held = {r.req_id for r in self._read_loads}
        if self._per_layer is not None:
            held |= self._per_layer.held()
        return held

    @property
    def num_tracked(self) -> int:
        pending = self._per_layer.num_pending if self._per_layer is not None else 0
        return len(self._read_loads) + pending
