"""A do-nothing connector around the async transport double: every hook
forwarded, nothing else. ``bench_host.py --floor`` runs it in the wrapper's
place, to show what wrapping costs in that bench before any work (the floor
under KVTailConnector's figure). Not a test double for tests: a benchmark's
baseline."""

from __future__ import annotations

import contextlib
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from tests.helpers.async_double import AsyncLoadDouble

CONNECTOR_NAME = "ForwardingDouble"
MODULE_PATH = "benchmarks.forwarding_double"


class ForwardingDouble(KVConnectorBase_V1, SupportsHMA):
    """Forwards every scheduler- and worker-side hook ``bench_host.py`` drives."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._inner = AsyncLoadDouble(vllm_config, role, kv_cache_config)

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: Any) -> Any:
        return self._inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> Any:
        return self._inner.get_loaded_kv_cache_group_ids(request)

    def get_external_cache_hit_sources(self, request: Any, n: Any) -> Any:
        return self._inner.get_external_cache_hit_sources(request, n)

    def update_state_after_alloc(self, request: Any, blocks: Any, n: Any) -> Any:
        self._inner.update_state_after_alloc(request, blocks, n)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return self._inner.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> Any:
        self._inner.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        return self._inner.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        return self._inner.request_finished_all_groups(request, block_ids)

    def on_new_request(self, request: Any) -> Any:
        self._inner.on_new_request(request)

    def get_kv_connector_stats(self) -> Any:
        return self._inner.get_kv_connector_stats()

    def take_events(self) -> Any:
        return self._inner.take_events()

    def bind_kv_cache_manager(self, m: Any) -> Any:
        self._inner.bind_kv_cache_manager(m)

    def scheduler_state_is_empty(self) -> Any:
        return self._inner.scheduler_state_is_empty()

    # worker side
    def register_kv_caches(self, kv_caches: Any) -> Any:
        self._inner.register_kv_caches(kv_caches)

    def handle_preemptions(self, meta: Any) -> Any:
        self._inner.handle_preemptions(meta)

    def bind_connector_metadata(self, meta: Any) -> Any:
        self._inner.bind_connector_metadata(meta)

    def clear_connector_metadata(self) -> Any:
        self._inner.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kw: Any) -> Any:
        self._inner.start_load_kv(forward_context, **kw)

    def wait_for_layer_load(self, layer_name: Any) -> Any:
        self._inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, *a: Any, **k: Any) -> Any:
        self._inner.save_kv_layer(*a, **k)

    def wait_for_save(self) -> Any:
        self._inner.wait_for_save()

    def get_transfer_results(self, finished_req_ids: Any) -> Any:
        return self._inner.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> Any:
        return self._inner.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> Any:
        return self._inner.build_connector_worker_meta()

    def worker_state_is_empty(self) -> Any:
        return self._inner.worker_state_is_empty()


# ValueError: already registered (a re-import).
with contextlib.suppress(ValueError):
    KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)
