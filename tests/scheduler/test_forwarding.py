"""Every hook and classmethod of the wrapper reaches the inner connector.

The inner is a recording double; metadata must arrive unwrapped, return
values must come back unchanged. This is the wrapper's forwarding contract.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.outputs import KVConnectorOutput

from kvtail_connector.core.metadata import KVTailMetadata
from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.facade.connector import KVTailConnector
from kvtail_connector.facade.inner import wrapper_fields
from tests.helpers import recording
from tests.helpers.recording import FINISHED, SENTINEL, RecordingConnector, RecordingMetadata
from tests.helpers.vllm_factories import make_kv_cache_config, make_vllm_config

EXTRA = {
    "backend": "RecordingConnector",
    "backend_module_path": recording.MODULE_PATH,
    "backend_extra_config": {"inner": "settings"},
    "zero_tails": "off",
}


def build(role: KVConnectorRole) -> tuple[KVTailConnector, RecordingConnector, Any]:
    vllm_config = make_vllm_config(
        **wrapper_fields(EXTRA),
        kv_role="kv_both",
    )
    kv = make_kv_cache_config(block_size=16, num_blocks=8)
    wrapper = KVTailConnector(vllm_config, role, kv)
    inner = wrapper.inner
    assert isinstance(inner, RecordingConnector)
    return wrapper, inner, vllm_config


def last(inner: RecordingConnector) -> tuple[str, tuple[Any, ...]]:
    return inner.calls[-1]


def test_inner_is_built_like_a_multiconnector_child():
    wrapper, inner, vllm_config = build(KVConnectorRole.WORKER)
    outer = vllm_config.kv_transfer_config
    ktc = inner._kv_transfer_config
    assert (ktc.kv_connector, ktc.kv_connector_module_path) == (
        "RecordingConnector",
        recording.MODULE_PATH,
    )
    assert ktc.kv_connector_extra_config == {"inner": "settings"}
    # Everything else is inherited unchanged, and the user's config is untouched.
    replaced = {"kv_connector", "kv_connector_module_path", "kv_connector_extra_config"}
    inherited = [f.name for f in dataclasses.fields(outer) if f.name not in replaced]
    assert "engine_id" in inherited and "kv_role" in inherited
    for name in inherited:
        assert getattr(ktc, name) == getattr(outer, name), name
    assert outer.kv_connector == "KVTailConnector"
    assert outer.kv_connector_extra_config == EXTRA
    assert isinstance(wrapper, SupportsHMA)


WORKER_HOOKS = [
    ("get_mem_pool_context", (), SENTINEL),
    ("clear_connector_metadata", (), None),
    ("unregister_kv_caches", (), None),
    ("restore_kv_caches", (), None),
    ("set_host_xfer_buffer_ops", ("op",), None),
    ("finish_forward", (), None),
    ("reset_capture_state", (), None),
    ("wait_for_layer_load", ("layer.0",), None),
    ("wait_for_save", (), None),
    ("shutdown", (), None),
    ("get_kv_connector_kv_cache_events", (), SENTINEL),
    ("get_handshake_metadata", (), SENTINEL),
    ("build_connector_worker_meta", (), SENTINEL),
    ("get_finished_count", (), SENTINEL),
]


@pytest.mark.parametrize(("hook", "args", "result"), WORKER_HOOKS, ids=[h[0] for h in WORKER_HOOKS])
def test_worker_hooks_forward(hook, args, result):
    wrapper, inner, _ = build(KVConnectorRole.WORKER)
    got = getattr(wrapper, hook)(*args)
    assert last(inner) == (hook, args)
    if result is not None:
        assert got is result


def test_worker_metadata_hooks_unwrap():
    wrapper, inner, _ = build(KVConnectorRole.WORKER)
    inner_meta = RecordingMetadata()
    meta = KVTailMetadata(inner=inner_meta)
    wrapper.bind_connector_metadata(meta)
    assert last(inner) == ("bind_connector_metadata", (inner_meta,))
    assert wrapper.has_connector_metadata()
    wrapper.handle_preemptions(meta)
    assert last(inner) == ("handle_preemptions", (inner_meta,))
    wrapper.start_load_kv("ctx", scheduler_output="so")
    assert last(inner) == ("start_load_kv", ("ctx", {"scheduler_output": "so"}))
    wrapper.save_kv_layer("layer.0", "kv", "md", extra=1)
    assert last(inner) == ("save_kv_layer", ("layer.0", "kv", "md", {"extra": 1}))
    wrapper.register_kv_caches({})
    assert last(inner) == ("register_kv_caches", ({},))
    results = wrapper.get_transfer_results({"a"})
    assert last(inner) == ("get_transfer_results", ({"a"},))
    assert results.finished_sending == {"sent"}
    assert wrapper.get_finished({"b"}) == ({"sent"}, None)
    assert wrapper.get_block_ids_with_load_errors() == {7}
    assert wrapper.get_kv_connector_stats() is None  # nothing of ours, nothing inner
    wrapper.clear_connector_metadata()
    assert not wrapper.has_connector_metadata()


SCHEDULER_HOOKS = [
    ("bind_gpu_block_pool", ("pool",), None),
    ("get_loaded_kv_cache_group_ids", ("req",), SENTINEL),
    ("get_external_cache_hit_sources", ("req", 5), SENTINEL),
    ("on_new_request", ("req",), None),
    ("update_connector_output", (KVConnectorOutput(),), None),
    ("register_finished_partial_tail", ("req", ([1],), []), SENTINEL),
    ("take_events", (), SENTINEL),
    ("has_pending_block_frees", (), SENTINEL),
    ("has_pending_push_work", (), SENTINEL),
    ("set_xfer_handshake_metadata", ({0: "m"},), None),
    ("set_xfer_handshake_metadata_pp_aware", ({(0, 0): "m"},), None),
    ("reset_cache", (), SENTINEL),
]


@pytest.mark.parametrize(
    ("hook", "args", "result"), SCHEDULER_HOOKS, ids=[h[0] for h in SCHEDULER_HOOKS]
)
def test_scheduler_hooks_forward(hook, args, result):
    wrapper, inner, _ = build(KVConnectorRole.SCHEDULER)
    got = getattr(wrapper, hook)(*args)
    assert last(inner) == (hook, args)
    if result is not None:
        assert got is result


class _Request:
    request_id = "r1"


def test_scheduler_request_hooks_forward():
    wrapper, inner, _ = build(KVConnectorRole.SCHEDULER)
    req = _Request()
    assert wrapper.get_num_new_matched_tokens(req, 3) == (0, False)
    assert last(inner) == ("get_num_new_matched_tokens", (req, 3))
    wrapper.update_state_after_alloc(req, "blocks", 0)
    assert last(inner) == ("update_state_after_alloc", (req, "blocks", 0))
    meta = wrapper.build_connector_meta("so")
    assert last(inner) == ("build_connector_meta", ("so",))
    assert isinstance(meta, KVTailMetadata) and isinstance(meta.inner, RecordingMetadata)
    assert wrapper.request_finished(req, [1]) is FINISHED
    assert last(inner) == ("request_finished", (req, [1]))
    assert wrapper.request_finished_all_groups(req, ([1],)) is FINISHED
    assert last(inner) == ("request_finished_all_groups", (req, ([1],)))
    wrapper.bind_kv_cache_manager(_Manager())
    assert last(inner)[0] == "bind_kv_cache_manager"
    assert wrapper.supports_divergent_local_hybrid_hits is SENTINEL
    assert wrapper.requires_kv_delivery is SENTINEL


class _Manager:
    block_pool = "pool"


def test_classmethods_resolve_the_inner_class():
    _, _, vllm_config = build(KVConnectorRole.SCHEDULER)
    RecordingConnector.classmethod_calls.clear()
    assert KVTailConnector.get_required_kvcache_layout(vllm_config) == "LBNHC"
    name, inner_config = RecordingConnector.classmethod_calls[-1]
    assert name == "get_required_kvcache_layout"
    assert inner_config.kv_transfer_config.kv_connector == "RecordingConnector"
    assert KVTailConnector.requires_piecewise_for_cudagraph(EXTRA) is True
    assert RecordingConnector.classmethod_calls[-1] == (
        "requires_piecewise_for_cudagraph",
        {"inner": "settings"},
    )
    assert KVTailConnector.supports_sleep_mode(vllm_config.kv_transfer_config) is False
    assert isinstance(KVTailConnector.build_kv_connector_stats({}), KVTailStats)
