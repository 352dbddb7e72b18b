"""The hooks the model runner calls on every worker, where the wrapper acts:
each reaches the inner connector as if unwrapped, and the worker side
(:class:`~kvtail_connector.core.worker.TailWorker`) inside the facade's guard
(:mod:`kvtail_connector.core.containment`): a failure of the wrapper's own is
contained, with the fallback each hook names.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from kvtail_connector import _compat
from kvtail_connector.core.containment import Containment, safe_ids
from kvtail_connector.core.metadata import KVTailMetadata
from kvtail_connector.core.policy import TailPolicy
from kvtail_connector.core.worker import TailWorker, every_completion_failed
from kvtail_connector.facade.forwarding import ForwardingConnector
from kvtail_connector.pages import EngineFacts


class WorkerHooks(ForwardingConnector):
    """The worker-side half of :class:`~kvtail_connector.facade.connector.KVTailConnector`
    (which sets the attributes below when it is built)."""

    _worker: TailWorker | None
    _policy: TailPolicy
    _guard: Containment
    # MoRIIO READ tails are zeroed once the READ has landed: after
    # start_load_kv, or per layer after wait_for_layer_load (0.32).
    _sync_read: bool

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(connector_metadata, KVTailMetadata), (
            "the scheduler and the workers run KVTailConnector"
        )
        worker = self._worker
        if worker is not None:
            try:
                worker.bind(connector_metadata)
            except Exception as exc:
                self._guard.failed(
                    exc,
                    "bind_connector_metadata",
                    safe_ids(connector_metadata.loads),
                    lambda: worker.contain_bind(connector_metadata),
                )
        self._inner.bind_connector_metadata(connector_metadata.inner)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        worker = self._worker
        if worker is not None and self._sync_read:
            try:
                worker.end_step()
            except Exception as exc:
                self._guard.failed(
                    exc, "clear_connector_metadata (READ tails)", (), worker.contain_end_step
                )
        self._inner.clear_connector_metadata()
        super().clear_connector_metadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._inner.register_kv_caches(kv_caches)
        if self._worker is not None:
            self._worker.register_kv_caches(
                kv_caches,
                self._kv_cache_config,
                # None on a test double's compilation config (vLLM's has one in 0.32-0.34).
                getattr(self._vllm_config.compilation_config, "static_forward_context", None),
                EngineFacts(fused_kv_writer=_compat.fused_kv_writer(self._vllm_config)),
            )

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.unregister_kv_caches()
        _compat.call_inner_sleep_hook(self._inner, "unregister_kv_caches")

    def restore_kv_caches(self) -> None:
        _compat.call_inner_sleep_hook(self._inner, "restore_kv_caches")
        if self._worker is not None:
            self._worker.restore_kv_caches()

    def finish_forward(self) -> None:
        if self._worker is not None and self._policy.producer_hook == "finish_forward":
            self._producer_hook("finish_forward")
        self._inner.finish_forward()

    def _producer_hook(self, hook: str) -> None:
        worker = self._worker
        assert worker is not None
        try:
            worker.produce()
        except Exception as exc:
            self._guard.failed(exc, hook, (), worker.contain_producer)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVTailMetadata)
        self._inner.handle_preemptions(kv_connector_metadata.inner)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = self._worker
        if worker is not None:
            try:
                worker.fence()
            except Exception as exc:
                self._guard.failed(exc, "start_load_kv (fence)")
        self._inner.start_load_kv(forward_context, **kwargs)
        if worker is not None and worker.has_read_loads:
            reads = worker.read_loads
            landed = False
            try:
                landed = _compat.moriio_reads_landed_at_start(forward_context)
                worker.reads_started(landed)
            except Exception as exc:
                self._guard.failed(
                    exc,
                    "start_load_kv (READ tails)",
                    safe_ids(reads),
                    lambda: worker.contain_reads(reads, landed),
                )

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._inner.wait_for_layer_load(layer_name)
        if self._worker is not None and self._sync_read:
            worker = self._worker
            try:
                worker.layer_loaded(layer_name)
            except Exception as exc:
                self._guard.failed(
                    exc, "wait_for_layer_load (READ tails)", (), worker.contain_layer_loaded
                )

    def wait_for_save(self) -> None:
        # Before delegating: ordered before MooncakeStore's event and NIXL's
        # host-buffer copy, which wait_for_save starts.
        if self._worker is not None and self._policy.producer_hook == "wait_for_save":
            self._producer_hook("wait_for_save")
        self._inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = self._inner.get_transfer_results(finished_req_ids)
        worker = self._worker
        if worker is None:
            return results
        try:
            return worker.transfer_results(results, finished_req_ids, self._inner)
        except Exception as exc:
            # Where even the fallback fails: this pass's completions reported
            # failed, and settled by the worker's next pass (held ones included).
            return self._guard.failed(  # type: ignore[return-value]
                exc,
                "get_transfer_results",
                safe_ids(results.finished_recving),
                lambda: worker.contain_transfer_results(results, finished_req_ids),
                every_completion_failed(results),
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return self._inner.get_block_ids_with_load_errors()
        worker = self._worker
        try:
            return worker.take_load_errors(self._inner)
        except Exception as exc:
            ids = self._guard.failed(
                exc, "get_block_ids_with_load_errors", (), worker.contain_load_errors
            )
            return ids if ids is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        inner = self._inner.build_connector_worker_meta()
        worker = self._worker
        if worker is None:
            return inner
        try:
            return worker.worker_meta(inner)
        except Exception as exc:
            return self._guard.failed(
                exc, "build_connector_worker_meta", (), lambda: worker.contain_worker_meta(inner)
            )
