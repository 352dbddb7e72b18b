"""An inner connector that records every hook the wrapper forwards to it.

Hooks return a sentinel (or a recognisable value), so a forwarded return value
is told apart from the base class default.
"""

from __future__ import annotations

from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorTransferResults,
    SupportsHMA,
)

SENTINEL = object()
# What request_finished[_all_groups] return: (delay_free_blocks, kv_transfer_params).
FINISHED = (False, {"recorded": True})
MODULE_PATH = "tests.helpers.recording"


class RecordingMetadata(KVConnectorMetadata):
    pass


class RecordingConnector(KVConnectorBase_V1, SupportsHMA):
    classmethod_calls: ClassVar[list[tuple[str, Any]]] = []

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def _rec(self, name: str, *args: Any) -> Any:
        self.calls.append((name, args))
        return SENTINEL

    # The abstract hooks, defined in the body so the class is instantiable.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._rec("start_load_kv", forward_context, kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._rec("wait_for_layer_load", layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        self._rec("save_kv_layer", layer_name, kv_layer, attn_metadata, kw)

    def wait_for_save(self) -> None:
        self._rec("wait_for_save")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        self._rec("get_num_new_matched_tokens", request, num_computed_tokens)
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        self._rec("update_state_after_alloc", request, blocks, num_external)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._rec("build_connector_meta", scheduler_output)
        return RecordingMetadata()

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        self._rec("request_finished", request, block_ids)
        return FINISHED

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        self._rec("request_finished_all_groups", request, block_ids)
        return FINISHED

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._rec("get_transfer_results", finished_req_ids)
        return KVConnectorTransferResults(finished_sending={"sent"})

    def get_kv_connector_stats(self) -> Any:
        self._rec("get_kv_connector_stats")
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._rec("get_block_ids_with_load_errors")
        return {7}

    @property
    def supports_divergent_local_hybrid_hits(self) -> Any:
        return SENTINEL

    @property
    def requires_kv_delivery(self) -> Any:
        return SENTINEL

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str:
        cls.classmethod_calls.append(("get_required_kvcache_layout", vllm_config))
        return "LBNHC"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        cls.classmethod_calls.append(("requires_piecewise_for_cudagraph", extra_config))
        return True

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        cls.classmethod_calls.append(("supports_sleep_mode", kv_transfer_config))
        return False

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *args: Any) -> Any:
        cls.classmethod_calls.append(("build_prom_metrics", vllm_config))
        return None

    # 0.34's classmethods; both answers differ from the base class defaults
    # (False, IN_PROCESS), so a wrapper that does not forward them shows.
    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        cls.classmethod_calls.append(("supports_lookahead_block_hashes", kv_transfer_config))
        return True

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVCacheAccess  # 0.34

        cls.classmethod_calls.append(("kv_cache_access", kv_transfer_config))
        # A real flag (vLLM's config reads it), but not the default IN_PROCESS.
        return KVCacheAccess.REGISTERS


# Every other hook just records its arguments and returns SENTINEL.
RECORDED_HOOKS = (
    "get_mem_pool_context",
    "bind_connector_metadata",
    "clear_connector_metadata",
    "register_kv_caches",
    "unregister_kv_caches",
    "restore_kv_caches",
    "set_host_xfer_buffer_ops",
    "finish_forward",
    "reset_capture_state",
    "handle_preemptions",
    "shutdown",
    "get_kv_connector_kv_cache_events",
    "get_handshake_metadata",
    "build_connector_worker_meta",
    "get_finished_count",
    "bind_kv_cache_manager",
    "bind_gpu_block_pool",
    "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources",
    "on_new_request",
    "update_connector_output",
    "register_finished_partial_tail",
    "take_events",
    "has_pending_block_frees",
    "has_pending_push_work",
    "set_xfer_handshake_metadata",
    "set_xfer_handshake_metadata_pp_aware",
    "reset_cache",
    "may_load_async",  # 0.34
)


def _recorder(name: str) -> Any:
    def hook(self: RecordingConnector, *args: Any) -> Any:
        return self._rec(name, *args)

    hook.__name__ = name
    return hook


for _name in RECORDED_HOOKS:
    setattr(RecordingConnector, _name, _recorder(_name))
