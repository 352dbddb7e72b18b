"""Worker side: routes the runner's connector hooks to the core parts, and
to the opt-in features' worker half where the assembly gives one.

:class:`TailWorker` holds no feature state: each duty is a part
(``kvtail_connector/core/parts/<duty>/worker.py``) built from the policy,
present only where the policy turns it on, sharing this rank's caches and
zeroer (:class:`~kvtail_connector.core.parts.zeroing.RankCaches`) so that a
step's zeroing is one launch; the extra
(:class:`~kvtail_connector.core.extension.WorkerExtra`: producer claims, KV
verification) shares them too. The order in which the parts are called, hook
by hook:

``bind_connector_metadata`` (:meth:`TailWorker.bind`)
    READ tails first (a READ cannot be reported failed, so a failure below
    must not lose its tail), then load errors (``failing``, blocks tracked),
    the extra (its payload: which loads it acts on at completion), consumer
    tails (work lines built now).
producer hook (:meth:`TailWorker.produce`, ``finish_forward`` or ``wait_for_save``)
    the extra (zero the prompts' tails, then digest the prompts).
``start_load_kv``
    the fence (:meth:`TailWorker.fence`) before the inner connector starts
    loads, then READ tails (:meth:`TailWorker.reads_started`) after it.
``wait_for_layer_load`` / ``clear_connector_metadata``
    READ tails per layer (0.32), then what is left after the forward.
``get_transfer_results`` (:meth:`TailWorker.transfer_results`, in
:mod:`~kvtail_connector.core.completion`)
    first a pass that never answered (it and its fallback failed) is settled;
    consumer tails note aborted loads; for the loads completing: load errors
    (invalid blocks fetched and settled), consumer tails (aborted ones
    dropped), verification (digests launched), load errors (failed loads'
    blocks), consumer tails, producer claims (vouched tails checked), then
    one launch for all of it; then the holds: consumer tails (zeroing not
    executed), the extra (digest not compared), load errors (loads to report
    failed, and completions a failed pass left owed).
``build_connector_worker_meta`` (:meth:`TailWorker.worker_meta`)
    the extra's report (tails zeroed, false claims found, sums, verdicts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvtail_connector.core.cache_sets import cache_sets
from kvtail_connector.core.completion import CompletionPasses
from kvtail_connector.core.extension import WorkerExtra
from kvtail_connector.core.kvgroups import GroupInfo
from kvtail_connector.core.metadata import KVTailMetadata, KVTailWorkerMeta, LoadRecord
from kvtail_connector.core.parts.consumer_tails.worker import ConsumerTailsWorker
from kvtail_connector.core.parts.load_errors.worker import LoadErrorsWorker
from kvtail_connector.core.parts.read_tails.worker import ReadTailsWorker
from kvtail_connector.core.parts.zeroing import RankCaches, RankPlacement
from kvtail_connector.core.policy import TailPolicy
from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.log import get_logger
from kvtail_connector.pages import PLAIN_ENGINE, EngineFacts

logger = get_logger(__name__)


def every_completion_failed(results: KVConnectorTransferResults) -> KVConnectorTransferResults:
    """The facade's last answer to a completion pass whose fallback failed too:
    every completion of the inner connector's ``results`` reported failed,
    nothing else. The worker's next pass settles what that answer reported
    (:meth:`TailWorker.transfer_results`), so that no completion is reported
    twice or never: building it needs nothing of the worker, and cannot fail."""
    return KVConnectorTransferResults(
        finished_sending=results.finished_sending,
        finished_recving=results.finished_recving,
        failed_recving=set(results.failed_recving) | set(results.finished_recving),
    )


class TailWorker:
    """The wrapper's worker side: the parts the policy turns on, in order.

    Args:
        groups: tail facts per KV cache group.
        placement: this rank's DCP placement.
        policy: what this worker zeroes, probes and holds (see
            :class:`~kvtail_connector.core.policy.TailPolicy`).
        counts_requests: this rank reports the per-request counters
            (``tails_zeroed``, ``probed_tails``): one rank per request, since
            vLLM sums every worker's stats. Byte counts come from every rank.
        rank: this worker's rank among the engine's workers (its producer
            confirmations are counted by id).
        stats: the counters this side reports.
        extra: builds the opt-in features' worker half over this rank's
            caches, or None.
    """

    def __init__(
        self,
        groups: tuple[GroupInfo, ...],
        placement: RankPlacement,
        policy: TailPolicy,
        *,
        counts_requests: bool = True,
        rank: int = 0,
        stats: KVTailStats,
        extra: Callable[[RankCaches], WorkerExtra] | None = None,
    ) -> None:
        self._policy = policy
        self._rank_id = rank
        self._rank = RankCaches(
            groups, placement, stats, probe=policy.probes, counts_requests=counts_requests
        )
        self._extra = extra(self._rank) if extra is not None else None
        self._tails = ConsumerTailsWorker(self._rank, holds_completions=policy.holds_completions)
        self._errors = LoadErrorsWorker(self._rank, self._tails.in_flight)
        self._reads = (
            ReadTailsWorker(
                self._rank,
                by_layer=policy.zeroes_reads_by_layer,
                trusts_load_claims=policy.trusts_load_claims,
                extra=self._extra,
            )
            if policy.zeroes_read_tails
            else None
        )
        self._completions = CompletionPasses(
            self._rank, policy, self._tails, self._errors, self._extra
        )

    # ------------------------------------------------------------ lifecycle

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, Any],
        kv_cache_config: Any,
        layer_objects: Mapping[str, Any] | None = None,
        engine: EngineFacts = PLAIN_ENGINE,
    ) -> None:
        """Map every attention layer's page (``pages``: refused at start-up
        where a layout is not known) and build this rank's zeroer.

        Args:
            layer_objects: ``static_forward_context``: each layer's backend.
            engine: what the engine's configuration says about its writers.
        """
        rank = self._rank
        rank.forget_released()  # new caches supersede any put away by sleep mode
        for part in (self._reads, self._extra):
            if part is not None:
                part.forget_released()
        policy = self._policy
        if not policy.needs_caches:
            return
        try:
            sets = cache_sets(kv_caches, kv_cache_config, rank.groups, layer_objects, engine)
            if sets:
                rank.register(sets)
                if self._extra is not None:
                    self._extra.register(sets, kv_caches, kv_cache_config)
        except Exception as e:
            _digest_steps_aside(policy, e)
            return
        if not sets:
            logger.info("KVTailConnector: no attention cache with token tails on this worker")
            return
        if self._reads is not None:
            self._reads.register(sets)
        zeroer = rank.zeroer
        assert zeroer is not None
        placement = rank.placement
        logger.info(
            "KVTailConnector: zeroing tails on %s (%s%s): %d layer(s) in %d set(s), "
            "DCP rank %d/%d, interleave %d",
            zeroer.device,
            zeroer.implementation,
            ", CUDA graphs" if zeroer.uses_graphs else "",
            sum(len(s.caches) for s in sets),
            len(sets),
            placement.dcp_rank,
            placement.dcp_world_size,
            placement.interleave,
        )

    def unregister_kv_caches(self) -> None:
        """Sleep mode released the KV memory: launch nothing until restored.

        Idempotent, as vLLM 0.33 needs: ``release_kv_cache_memory()`` (or
        ``discard(("kv_cache",))``) unregisters, a later ``sleep()``
        unregisters again, and ``wake_up()`` restores once."""
        if self._rank.released:
            return
        self._rank.release()
        for part in (self._reads, self._extra):
            if part is not None:
                part.release()

    def restore_kv_caches(self) -> None:
        """Undo :meth:`unregister_kv_caches`; a no-op when registered."""
        if not self._rank.released:
            return
        self._rank.restore()
        for part in (self._reads, self._extra):
            if part is not None:
                part.restore()

    # ----------------------------------------------------------------- step

    def bind(self, meta: KVTailMetadata) -> None:
        """Keep this step's new loads, their tails encoded for the launch now,
        so completion costs a concatenation and a launch."""
        # First: a READ cannot be reported failed and vLLM no longer zeroes its
        # blocks, so a failure below (contain_bind) must not lose its tail.
        if self._reads is not None:
            self._reads.bind(meta.read_loads)
        self._errors.bind(meta.loads, meta.failing)
        acting = (
            self._extra.bind(meta.extra, meta.loads, meta.read_loads)
            if self._extra is not None
            else ()
        )
        self._tails.bind(meta.loads, acting)

    def produce(self) -> None:
        """The producer hook (``policy.producer_hook``), after the step's
        forward and before its output: the extra's producer work (zero the
        slots past each completing remote-decode prompt in its last block;
        digest those prompts, without waiting)."""
        if self._extra is not None:
            self._extra.produce()

    def worker_meta(self, inner: Any) -> Any:
        """This step's ``build_connector_worker_meta``: the inner connector's,
        wrapped with the extra's report (every step where the policy reports,
        so every rank's metadata aggregates alike)."""
        if not self._policy.reports_worker_meta:
            return inner
        extra = self._extra
        return KVTailWorkerMeta(
            inner=inner,
            ranks=frozenset({self._rank_id}),
            extra=extra.report() if extra is not None else None,
        )

    def fence(self) -> None:
        """Before the inner connector starts a load, earlier zeroing has executed."""
        self._rank.fence()

    @property
    def has_read_loads(self) -> bool:
        """READ loads bound this step wait for ``reads_started``."""
        return self._reads is not None and bool(self._reads.read_loads)

    @property
    def read_loads(self) -> list[LoadRecord]:
        """The READ loads bound this step (``reads_started`` replaces the list)."""
        return self._reads.read_loads if self._reads is not None else []

    def reads_started(self, landed: bool) -> None:
        """The inner ``start_load_kv`` returned: READ tails zeroed now if every
        READ has ``landed``, else armed per layer."""
        if self._reads is not None:
            self._reads.started(landed)

    def layer_loaded(self, layer_name: str) -> None:
        if self._reads is not None:
            self._reads.layer_loaded(layer_name)

    def end_step(self) -> None:
        if self._reads is not None:
            self._reads.end_step()

    # ------------------------------------------------------------ completion

    def take_load_errors(self, inner: Any) -> set[int]:
        """The runner's ``get_block_ids_with_load_errors``."""
        return self._errors.take(inner)

    def transfer_results(
        self, results: KVConnectorTransferResults, finished_req_ids: set[str], inner: Any
    ) -> KVConnectorTransferResults:
        """The runner's ``get_transfer_results`` (see :meth:`CompletionPasses.answer`)."""
        return self._completions.answer(results, finished_req_ids, inner)

    def on_transfer_results(
        self, finished_recving: Iterable[str], failed_recving: Iterable[str], inner: Any
    ) -> set[str]:
        """Zero what completed (see :meth:`CompletionPasses.zero_completed`)."""
        return self._completions.zero_completed(finished_recving, failed_recving, inner)

    # ------------------------------------------------- contained failures
    # The fallbacks the facade runs after an internal error in a hook
    # (kvtail_connector.core.containment): minimal, and never half a claim.

    def contain_bind(self, meta: KVTailMetadata) -> None:
        """``bind`` failed: this step's async loads are reported failed when
        they complete; its READ loads, kept first by ``bind``, are zeroed as
        usual; its producer records are neither zeroed nor confirmed (no
        claim: the consumer zeroes as after a plain producer)."""
        req_ids = [r.req_id for r in meta.loads]
        self._errors.fail(req_ids)
        self._tails.drop(req_ids)
        if self._extra is not None:
            self._extra.forget(req_ids)
            self._extra.drop()

    def contain_producer(self) -> None:
        """The producer hook failed: nothing of this step is confirmed."""
        if self._extra is not None:
            self._extra.drop()

    def contain_worker_meta(self, inner: Any) -> Any:
        """``worker_meta`` failed: no confirmation, digest or verdict from this
        rank this step (no claim made; loads count as not verified)."""
        if self._extra is not None:
            self._extra.drop()
        if not self._policy.reports_worker_meta:
            return inner
        return KVTailWorkerMeta(inner=inner, ranks=frozenset({self._rank_id}))

    def contain_load_errors(self) -> set[int]:
        """``take_load_errors`` failed: the ids fetched so far, unattributed."""
        return self._errors.drain()

    def contain_reads(self, records: list[LoadRecord], landed: bool) -> None:
        """``reads_started`` failed (see ``ReadTailsWorker.contain_started``):
        every READ tail is zeroed, claims or not."""
        if self._extra is not None:
            self._extra.forget([r.req_id for r in records])
        if self._reads is not None:
            self._reads.contain_started(records, landed)

    def contain_layer_loaded(self) -> None:
        """``layer_loaded`` failed (see ``ReadTailsWorker.contain_layer_loaded``)."""
        if self._reads is not None:
            self._reads.contain_layer_loaded()

    def contain_end_step(self) -> None:
        """``end_step`` failed (see ``ReadTailsWorker.contain_end_step``)."""
        if self._reads is not None:
            self._reads.contain_end_step()

    def contain_transfer_results(
        self, results: KVConnectorTransferResults, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        """``transfer_results`` failed (see :meth:`CompletionPasses.contain`)."""
        return self._completions.contain(results, finished_req_ids)

    # ----------------------------------------------------------- accounting

    def held_requests(self) -> int:
        """Requests this worker holds state for (the ``held_requests`` gauge)."""
        held = self._tails.held() | self._errors.held()
        for part in (self._reads, self._extra):
            if part is not None:
                held |= part.held()
        return len(held) + self._tails.num_held

    @property
    def num_tracked(self) -> int:
        """Entries every part still holds (0 when idle: the leak check)."""
        parts = (self._tails, self._errors, self._reads, self._extra)
        return sum(p.num_tracked for p in parts if p is not None)


def _digest_steps_aside(policy: TailPolicy, error: Exception) -> None:
    """Registration failed with ``error``: re-raised where zeroing needs the
    pages or ``verify_kv: digest`` was set by name; else only the default (or
    ``auto``) digest needed them and it steps aside on this worker (its loads
    go unchecked, its prompts undigested) rather than stop an engine that
    runs without it."""
    if policy.maps_pages:
        raise error
    if not policy.digest_steps_aside:
        error.add_note(
            'KVTailConnector: verify_kv "digest" maps the pages too: set '
            'kv_connector_extra_config.verify_kv to "sample" (which turns itself off '
            'where it cannot work) or "off".'
        )
        raise error
    logger.warning(
        "KVTailConnector: verify_kv is off on this worker: its KV pages cannot be "
        "digested (%s). The engine runs without the digest; set "
        'kv_connector_extra_config.verify_kv to "off" to skip this check.',
        error,
    )
