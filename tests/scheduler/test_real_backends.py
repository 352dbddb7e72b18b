"""The real inner connectors that import here, built behind the wrapper.

NixlConnector, MooncakeStoreConnector and MoRIIOConnector (scheduler side:
MoRIIO's worker needs mori and ROCm). Checks what vLLM reads from the
top-level connector class: the required KV layout (NIXL needs LBHNC), HMA,
stats reconstruction; and the name-keyed NIXL checks the wrapper re-applies.
"""

from __future__ import annotations

import sys

import msgspec
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    SupportsHMA,
)

from kvtail_connector.core.stats import KVTailStats, connector_path
from kvtail_connector.facade.connector import KVTailConnector
from kvtail_connector.facade.inner import wrapper_fields
from tests.helpers.vllm_factories import make_kv_cache_config, make_vllm_config


def config(backend: str, role: str = "kv_consumer", **kw):
    extra = {"backend": backend, **kw.pop("extra", {})}
    return make_vllm_config(
        **wrapper_fields(extra),
        kv_role=role,
        **kw,
    )


@pytest.mark.parametrize(
    ("backend", "role", "inner_name", "layout"),
    [
        ("NixlConnector", "kv_consumer", "NixlPullConnector", "LBHNC"),
        ("MooncakeStoreConnector", "kv_both", "MooncakeStoreConnector", None),
        ("MoRIIOConnector", "kv_consumer", "MoRIIOConnector", None),
    ],
)
def test_backend_builds_behind_the_wrapper(backend, role, inner_name, layout):
    vllm_config = config(backend, role)
    wrapper = KVTailConnector(
        vllm_config, KVConnectorRole.SCHEDULER, make_kv_cache_config(block_size=16, num_blocks=8)
    )
    assert type(wrapper.inner).__name__ == inner_name
    assert isinstance(wrapper, SupportsHMA) and isinstance(wrapper.inner, SupportsHMA)
    # vLLM asks the top-level class; the wrapper answers for the inner one.
    assert KVTailConnector.get_required_kvcache_layout(vllm_config) == layout
    assert KVTailConnector.requires_piecewise_for_cudagraph(
        vllm_config.kv_transfer_config.kv_connector_extra_config
    ) == type(wrapper.inner).requires_piecewise_for_cudagraph({})


def test_nixl_stats_survive_the_process_hop_inside_ours():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    inner = NixlKVConnectorStats()
    inner.record_failed_transfer()
    ours = KVTailStats(inner_connector=connector_path(NixlConnector))
    ours.add("tails_zeroed", 3)
    ours.add("tail_bytes_zeroed", 4096)
    snapshot = ours.take(inner)
    assert ours["tails_zeroed"] == 0  # taking a snapshot restarts the counters

    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(snapshot.to_dict()))
    rebuilt = KVTailConnector.build_kv_connector_stats(wire)
    assert isinstance(rebuilt, KVTailStats)
    assert rebuilt["tails_zeroed"] == 3 and rebuilt["tail_bytes_zeroed"] == 4096
    # Rebuilt by NixlConnector.build_kv_connector_stats, filed under that class.
    (rebuilt_inner,) = rebuilt.inner_stats.values()
    assert list(rebuilt.inner_stats) == [connector_path(NixlConnector)]
    assert isinstance(rebuilt_inner, NixlKVConnectorStats)
    assert rebuilt_inner.data["num_failed_transfers"] == [1]

    # Two workers' snapshots aggregate, ours and the inner's.
    other = KVTailStats.from_dict(wire)
    total = rebuilt.aggregate(other)
    assert total["tails_zeroed"] == 6
    reduced = total.reduce()
    assert reduced["kvtail_tails_zeroed"] == 6
    assert reduced["Num failed transfers"] == 2


def test_nixl_dcp_needs_the_interleave_vllm_would_have_set():
    # vLLM sets cp_kv_cache_interleave_size for NIXL only when it sees the name;
    # behind the wrapper it does not, so the wrapper refuses to start.
    with pytest.raises(ValueError, match="only supported for MLA models"):
        KVTailConnector(
            config("NixlConnector", dcp_size=8),
            KVConnectorRole.SCHEDULER,
            make_kv_cache_config(block_size=16, num_blocks=8),
        )


def test_unknown_backend_lists_the_known_names():
    with pytest.raises(ValueError, match="unknown connector 'NixlConector'") as info:
        KVTailConnector(
            config("NixlConector"),
            KVConnectorRole.SCHEDULER,
            make_kv_cache_config(block_size=16, num_blocks=8),
        )
    assert "NixlConnector" in str(info.value) and "MooncakeStoreConnector" in str(info.value)
    assert "backend_module_path" in str(info.value)


def test_missing_transport_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "needs_nixl_transport.py").write_text(
        "import nixl_transport_that_is_not_installed  # noqa\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("needs_nixl_transport", None)
    with pytest.raises(ImportError, match=r'pip install "kvtail-connector\[nixl\]"'):
        KVTailConnector(
            config("NixlStyleConnector", extra={"backend_module_path": "needs_nixl_transport"}),
            KVConnectorRole.SCHEDULER,
            make_kv_cache_config(block_size=16, num_blocks=8),
        )


def test_missing_module_path_names_the_field():
    with pytest.raises(ValueError, match="backend_module_path: cannot import 'no.such.module'"):
        KVTailConnector(
            config("X", extra={"backend_module_path": "no.such.module"}),
            KVConnectorRole.SCHEDULER,
            make_kv_cache_config(block_size=16, num_blocks=8),
        )


def test_non_hma_backend_refused_while_hma_is_on():
    # ExampleConnector does not subclass SupportsHMA; vLLM would turn HMA off for
    # it by name, which it cannot do through the wrapper.
    with pytest.raises(ValueError, match="--disable-hybrid-kv-cache-manager"):
        KVTailConnector(
            config("ExampleConnector", extra={"backend_extra_config": {}}),
            KVConnectorRole.SCHEDULER,
            make_kv_cache_config(block_size=16, num_blocks=8),
        )
    wrapper = KVTailConnector(
        config("ExampleConnector", disable_hybrid_kv_cache_manager=True),
        KVConnectorRole.SCHEDULER,
        make_kv_cache_config(block_size=16, num_blocks=8),
    )
    assert not isinstance(wrapper.inner, SupportsHMA)
