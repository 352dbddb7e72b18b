"""``KVTailConnector``: a thin facade around any vLLM KV connector: the hooks
where the wrapper acts (what it passes on unchanged: :mod:`kvtail_connector.facade.forwarding`).

:func:`kvtail_connector.facade.assembly.assemble` builds it (the inner connector, the
policy, one side); this file holds the scheduler's hooks and the stats, and
:mod:`kvtail_connector.facade.worker_hooks` the model runner's. Role SCHEDULER delegates to
:class:`~kvtail_connector.core.scheduler.TailScheduler`, role WORKER to
:class:`~kvtail_connector.core.worker.TailWorker`; every hook reaches the inner
connector, and every classmethod the inner class through
:func:`kvtail_connector.facade.inner.resolve`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvtail_connector import _compat
from kvtail_connector.config import KVTailConfig
from kvtail_connector.core.containment import Containment, safe_ids
from kvtail_connector.core.metadata import KVTailMetadata, KVTailWorkerMeta
from kvtail_connector.core.stats import KVTailStats, connector_path
from kvtail_connector.facade.assembly import assemble
from kvtail_connector.facade.inner import resolve
from kvtail_connector.facade.prom import KVTailPromMetrics
from kvtail_connector.facade.worker_hooks import WorkerHooks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig


# Public names of vLLM's connector base classes that the wrapper answers
# itself rather than passing the inner connector's answer through, and why.
# tests/scheduler/test_connector_surface.py checks every other public name is
# forwarded (by behaviour), and fails on a name a new release adds that is in
# neither place; scripts/vllm-release-check prints such names.
OWN_ANSWERS: dict[str, str] = {
    "build_connector_meta": "the step's metadata wraps the inner connector's (unchanged) "
    "with the tail records the workers zero",
    "bind_connector_metadata": "the workers unwrap the wrapper's metadata and bind exactly "
    "the inner connector's own to it",
    "has_connector_metadata": "the base answer over the metadata this facade binds, which "
    "it binds whenever it binds the inner connector's",
    "handle_preemptions": "the wrapper's metadata is unwrapped and the inner connector "
    "is handed its own",
    "get_finished": "the inner connector's completions, each held until its tail is "
    "zeroed on this rank",
    "get_transfer_results": "the inner connector's completions, held until tails are "
    "zeroed; loads whose zeroing failed are reported failed",
    "get_block_ids_with_load_errors": "the inner connector's blocks plus those of loads "
    "whose tails could not be zeroed, so vLLM recomputes them",
    "build_connector_worker_meta": "the wrapper's worker metadata carries the inner "
    "connector's unchanged, plus the per-rank tail outcomes",
    "get_kv_connector_stats": "the wrapper's stats carry the inner connector's under its "
    "class path, plus the tail counters",
    "build_kv_connector_stats": "rebuilds the wrapper's stats, which rebuild the inner "
    "connector's through its own classmethod",
    "build_prom_metrics": "the wrapper's Prometheus metrics hold the inner connector's, "
    "built by its own classmethod, beside the tail counters",
}


class KVTailConnector(WorkerHooks, SupportsHMA):
    """Wraps the connector named in ``kv_connector_extra_config.backend``.

    See :class:`~kvtail_connector.config.KVTailConfig` for the settings.
    """

    # kvtail_connector.facade.inner.WRAPPER_MARK: how the wrapper (or a subclass) is
    # refused as its own inner connector without an import of this module.
    is_kvtail_wrapper: ClassVar[bool] = True

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        _compat.check_vllm_version()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        parts = assemble(vllm_config, role, kv_cache_config)
        self._cfg = parts.cfg
        self._inner = parts.inner
        self._inner_hma = parts.inner_supports_hma
        self._policy = parts.policy
        self._stats = parts.stats
        # MoRIIO READ tails are zeroed once the READ has landed: after
        # start_load_kv, or per layer after wait_for_layer_load (0.32).
        self._sync_read = parts.sync_read
        self._scheduler = parts.scheduler
        self._worker = parts.worker
        # Every hook: the inner connector's part as if unwrapped, ours inside
        # try, its exceptions contained here (kvtail_connector.core.containment).
        self._guard = Containment(self._stats)
        self._last_held = 0  # the held_requests level last reported

    @property
    def config(self) -> KVTailConfig:
        return self._cfg

    def scheduler_state_is_empty(self) -> bool:
        """No wrapper state left for any request (tests' leak check)."""
        sched = self._scheduler.num_tracked if self._scheduler else 0
        work = self._worker.num_tracked if self._worker else 0
        return sched == 0 and work == 0

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        inner = self._inner.get_kv_connector_stats()
        try:
            part = self._scheduler if self._scheduler is not None else self._worker
            held = part.held_requests() if part is not None else 0
            if held or held != self._last_held:
                self._stats.set_gauge("held_requests", held)
                self._last_held = held
            if self._stats.is_empty() and (inner is None or inner.is_empty()):
                return None
            return self._stats.take(inner)
        except Exception as exc:
            self._guard.failed(exc, "get_kv_connector_stats")
            return inner

    # ========================================================= scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        # Not super(): it would bind the block pool a second time via our hook.
        self._kv_cache_manager = kv_cache_manager
        if self._scheduler is not None:
            self._scheduler.bind_kv_cache_manager(kv_cache_manager)
        self._inner.bind_kv_cache_manager(kv_cache_manager)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        groups = self._inner.get_loaded_kv_cache_group_ids(request)
        if self._scheduler is None:
            return groups
        return self._scheduler.get_loaded_kv_cache_group_ids(request, groups)  # type: ignore[no-any-return]

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        count, load_async = self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
        scheduler = self._scheduler
        assert scheduler is not None, "scheduler-side hook"
        scheduler.get_num_new_matched_tokens(request, num_computed_tokens, count, load_async)
        return count, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        scheduler = self._scheduler
        assert scheduler is not None, "scheduler-side hook"
        try:
            if num_external_tokens > 0:
                scheduler.read_entry(request)
        except Exception as exc:
            self._alloc_failed(exc, request, blocks, num_external_tokens)
            self._inner.update_state_after_alloc(request, blocks, num_external_tokens)
            return
        self._inner.update_state_after_alloc(request, blocks, num_external_tokens)
        try:
            scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception as exc:
            self._alloc_failed(exc, request, blocks, num_external_tokens)

    def _alloc_failed(
        self, exc: Exception, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        scheduler = self._scheduler
        assert scheduler is not None
        self._guard.failed(
            exc,
            "update_state_after_alloc",
            (request.request_id,),
            lambda: scheduler.contain_alloc(request, blocks, num_external_tokens),
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        scheduler = self._scheduler
        assert scheduler is not None, "scheduler-side hook"
        inner_meta = self._inner.build_connector_meta(scheduler_output)
        try:
            return scheduler.build_connector_meta(scheduler_output, inner_meta)
        except Exception as exc:
            meta = self._guard.failed(
                exc,
                "build_connector_meta",
                safe_ids(scheduler.pending_loads),
                lambda: scheduler.contain_meta(inner_meta),
            )
            return meta if meta is not None else KVTailMetadata(inner=inner_meta)

    def on_new_request(self, request: Any) -> None:
        # Inner first: NIXL and MoRIIO may shorten a producer's request to a
        # single-token prefill (max_tokens = 1) here, which is what we claim for.
        self._inner.on_new_request(request)
        scheduler = self._scheduler
        if scheduler is not None:
            try:
                scheduler.on_new_request(request)
            except Exception as exc:
                self._guard.failed(
                    exc,
                    "on_new_request",
                    (request.request_id,),
                    lambda: scheduler.forget(request.request_id),
                )

    def update_connector_output(self, connector_output: Any) -> None:
        # The inner connector sees its own worker metadata, as if unwrapped.
        ours = connector_output.kv_connector_worker_meta
        if isinstance(ours, KVTailWorkerMeta):
            connector_output.kv_connector_worker_meta = ours.inner
            try:
                self._inner.update_connector_output(connector_output)
            finally:
                connector_output.kv_connector_worker_meta = ours
        else:
            self._inner.update_connector_output(connector_output)
            ours = None
        scheduler = self._scheduler
        if scheduler is not None:
            try:
                scheduler.update_connector_output(connector_output, ours)
            except Exception as exc:
                self._guard.failed(
                    exc,
                    "update_connector_output",
                    (),
                    lambda: scheduler.contain_output(connector_output),
                )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, self._inner.request_finished(request, block_ids))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._inner_hma:
            result = self._inner.request_finished_all_groups(request, block_ids)  # type: ignore[attr-defined]
        else:
            assert len(block_ids) == 1, "a non-HMA inner connector runs with one KV cache group"
            result = self._inner.request_finished(request, block_ids[0])
        return self._finished(request, result)

    def _finished(
        self, request: Any, result: tuple[bool, dict[str, Any] | None]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``result``: the inner connector's answer, returned as given."""
        scheduler = self._scheduler
        if scheduler is not None:
            try:
                scheduler.request_finished(request, result[1])
            except Exception as exc:
                self._guard.failed(
                    exc,
                    "request_finished",
                    (request.request_id,),
                    lambda: scheduler.forget(request.request_id),
                )
        return result

    # ============================================================ classmethods

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVTailStats.from_dict(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        _compat.check_vllm_version()  # asked by the front end at start-up
        assert vllm_config.kv_transfer_config is not None
        resolved = resolve(vllm_config.kv_transfer_config)
        inner = resolved.inner_cls.build_prom_metrics(
            resolved.inner_vllm_config(vllm_config),
            metric_types,
            labelnames,
            per_engine_labelvalues,
        )
        return KVTailPromMetrics(
            vllm_config,
            metric_types,
            labelnames,
            per_engine_labelvalues,
            {connector_path(resolved.inner_cls): inner} if inner is not None else {},
        )
