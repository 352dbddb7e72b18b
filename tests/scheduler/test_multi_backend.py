"""MultiConnector as the backend, and KVTailConnector as MultiConnector children.

Real connectors (NIXL and MooncakeStore import here), vLLM's own
MultiConnector, and the hops vLLM's stats take: pickle from each worker to
the engine core, ``KVOutputAggregator``, ``to_dict`` and vLLM's msgpack
encoder to the front end, where ``KVConnectorLogging`` and the Prometheus
classes rebuild and observe them.
"""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.metrics import (
    MooncakeStoreConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
)
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from kvtail_connector import plugin
from kvtail_connector.connectors import InnerAdapter
from kvtail_connector.connectors.moriio import MoRIIOAdapter
from kvtail_connector.connectors.nixl import NixlAdapter
from kvtail_connector.core.stats import KVTailStats, connector_path
from kvtail_connector.facade.connector import KVTailConnector
from kvtail_connector.facade.inner import wrap_kv_transfer_config, wrapper_fields
from tests.helpers.vllm_factories import (
    make_kv_cache_config,
    make_vllm_config,
    refusal_text,
    runner_output,
)
from tests.scheduler.test_observability import registry_metric_types

CHILDREN = "kv_connector_extra_config.backend_extra_config.connectors"
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
MOONCAKE = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}


def multi_backend(children: list[dict[str, Any]], kv_role: str = "kv_both", **kw: Any) -> Any:
    # kv_role: the role the children give a MultiConnector (vLLM 0.34 takes it
    # from them; the wrapper refuses a kv_role that differs).
    return make_vllm_config(
        **wrapper_fields(
            {
                "backend": "MultiConnector",
                "backend_extra_config": {"connectors": children},
            }
        ),
        kv_role=kv_role,
        **kw,
    )


def start(vllm_config: Any) -> Any:
    return KVTailConnector(
        vllm_config, KVConnectorRole.SCHEDULER, make_kv_cache_config(block_size=16, num_blocks=8)
    )


def nixl_stats(failed: int) -> NixlKVConnectorStats:
    stats = NixlKVConnectorStats()
    for _ in range(failed):
        stats.record_failed_transfer()
    return stats


def mooncake_stats(loads: int) -> MooncakeStoreConnectorStats:
    stats = MooncakeStoreConnectorStats()
    for _ in range(loads):
        stats.record_operation("load_get", 0.002, 4, num_bytes=4096)
    return stats


def feed_children(multi: Any, *stats: Any) -> None:
    """Each child of ``multi`` reports ``stats[i]`` once, as its worker would."""
    for child, s in zip(multi.sub_connectors, stats, strict=True):
        child.get_kv_connector_stats = lambda s=s: s


def to_front_end(per_worker: list[Any]) -> dict[str, Any]:
    """Worker stats objects -> what the front end's KVConnectorLogging observes."""
    outputs = []
    for stats in per_worker:  # each worker process pickles its output
        out = runner_output([], kv_connector_output=KVConnectorOutput(kv_connector_stats=stats))
        outputs.append(pickle.loads(pickle.dumps(out)))
    merged = KVOutputAggregator(len(outputs)).aggregate(outputs)
    assert merged is not None and merged.kv_connector_output is not None
    payload = merged.kv_connector_output.kv_connector_stats.to_dict()  # Scheduler.make_stats
    wire = MsgpackEncoder().encode(
        EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=payload))
    )
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(wire)
    return decoded.scheduler_stats.kv_connector_stats


def logged(logging: KVConnectorLogging) -> list[str]:
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    return lines


# ---------------------------------------------------------------- start-up


def test_children_are_built_with_their_own_adapters():
    moriio = {
        "kv_connector": "MoRIIOConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"read_mode": "true", "host_ip": "127.0.0.1"},
    }
    wrapper = start(multi_backend([NIXL, moriio], kv_role="kv_consumer"))
    assert isinstance(wrapper.inner, MultiConnector)
    names = [type(c).__name__ for c in wrapper.inner.sub_connectors]
    assert names == ["NixlPullConnector", "MoRIIOConnector"]
    adapter = wrapper._scheduler._adapter
    assert [type(a) for _, a in adapter.children] == [NixlAdapter, MoRIIOAdapter]
    assert adapter.sync_read  # the MoRIIO child reads in READ mode
    # READ destinations come from the MoRIIO child's own metadata entry only;
    # the NIXL entry (which also has reqs_to_recv) is not a READ.
    nixl_meta = NixlConnectorMetadata()
    nixl_meta.reqs_to_recv["nixl-req"] = SimpleNamespace(local_block_ids=([9],))
    moriio_meta = SimpleNamespace(
        reqs_to_recv={"read-req": SimpleNamespace(local_block_ids=([1, 2], [3]))}
    )
    meta = MultiKVConnectorMetadata(metadata=(nixl_meta, moriio_meta))
    assert list(adapter.read_destinations(meta)) == [("read-req", ([1, 2], [3]))]


def test_a_generic_child_keeps_the_generic_adapter():
    wrapper = start(multi_backend([MOONCAKE]))
    ((label, child),) = wrapper._scheduler._adapter.children
    assert type(child) is not NixlAdapter and isinstance(child, InnerAdapter)
    assert label == f"{CHILDREN}[0] (MooncakeStoreConnector)"
    assert not wrapper._scheduler._adapter.sync_read


def test_nixl_name_keyed_checks_apply_to_a_nixl_child():
    # vLLM's has_connector("NixlConnector") sees a NIXL child of a plain
    # MultiConnector, not one behind the wrapper: the wrapper re-applies it.
    with pytest.raises(ValueError, match="only supported for MLA models") as info:
        start(multi_backend([MOONCAKE, NIXL], dcp_size=8))
    assert f"{CHILDREN}[1] (NixlConnector)" in refusal_text(info.value)


def test_a_child_without_hma_is_named_with_the_flag():
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    with pytest.raises(ValueError) as info:
        start(multi_backend([NIXL, example]))
    text = refusal_text(info.value)
    assert text.startswith(f"{CHILDREN}[1] (ExampleConnector): does not support the hybrid")
    assert "--disable-hybrid-kv-cache-manager" in text
    wrapper = start(multi_backend([NIXL, example], disable_hybrid_kv_cache_manager=True))
    assert [type(c).__name__ for c in wrapper.inner.sub_connectors][1] == "ExampleConnector"


@pytest.mark.parametrize(
    ("children", "fragment"),
    [
        (None, f"{CHILDREN}: a MultiConnector backend needs a non-empty list"),
        ([], f"{CHILDREN}: a MultiConnector backend needs a non-empty list"),
        (["NixlConnector"], f'{CHILDREN}[0]: expected a connector config with "kv_connector"'),
        ([NIXL, {"kv_connector": "NixlConnector"}], f"{CHILDREN}[1]: vLLM refuses this"),
        ([NIXL, {"kv_connector": "NoSuch", "kv_role": "kv_both"}], "unknown connector 'NoSuch'"),
        (
            [{"kv_connector": "KVTailConnector", "kv_role": "kv_both"}],
            f"{CHILDREN}[0].kv_connector: 'KVTailConnector' is KVTailConnector",
        ),
    ],
)
def test_bad_children_are_named(children, fragment):
    plugin.register()  # KVTailConnector is a registered name in every vLLM process
    extra: dict[str, Any] = {} if children is None else {"connectors": children}
    with pytest.raises(ValueError) as info:  # 0.34 refuses while it validates VllmConfig
        start(
            make_vllm_config(
                **wrapper_fields({"backend": "MultiConnector", "backend_extra_config": extra}),
                kv_role="kv_both",
            )
        )
    assert fragment in refusal_text(info.value)


# ------------------------------------------- stats: the engine's round trip


def test_multiconnector_backend_stats_reach_vllms_logging_and_prometheus():
    vllm_config = multi_backend([NIXL, MOONCAKE])
    workers = [start(vllm_config), start(vllm_config)]
    per_worker = []
    for i, wrapper in enumerate(workers):
        feed_children(wrapper.inner, nixl_stats(failed=i + 1), mooncake_stats(loads=2))
        wrapper._stats.add("tails_zeroed", 3)
        per_worker.append(wrapper.get_kv_connector_stats())
    payload = to_front_end(per_worker)
    assert payload["tails_zeroed"] == 6
    # Prometheus reads this step's payload before a later step aggregates into
    # it (vLLM's stats classes keep the lists they are built from).
    for_prometheus = copy.deepcopy(payload)

    logging = KVConnectorLogging(vllm_config.kv_transfer_config)
    logging.observe(payload)
    # A second step in the same interval aggregates (each step decodes its own
    # payload; vLLM's stats classes keep the lists they are built from).
    logging.observe(copy.deepcopy(payload))
    (line,) = logged(logging)
    assert "kvtail_tails_zeroed=12" in line
    # MultiConnector's reduce: one entry per child, keyed by class name.
    assert "'Num failed transfers': 6" in line  # (1 + 2) per observe, twice
    assert "'load_get_count': 8" in line

    registry = CollectorRegistry()
    prom = KVTailConnector.build_prom_metrics(
        vllm_config, registry_metric_types(registry), ["engine"], {0: ["0"]}
    )
    prom.observe(for_prometheus, engine_idx=0)
    labels = {"engine": "0"}
    assert registry.get_sample_value("vllm:kvtail_tails_zeroed_total", labels) == 6
    assert registry.get_sample_value("vllm:nixl_num_failed_transfers_total", labels) == 3
    ops = {"engine": "0", "operation": "load_get", "status": "ok"}
    assert registry.get_sample_value("vllm:mooncake_store_operation_total", ops) == 4


def test_inner_stats_alone_are_logged_with_kvtail_counters_at_zero():
    vllm_config = multi_backend([NIXL, MOONCAKE])
    wrapper = start(vllm_config)
    feed_children(wrapper.inner, nixl_stats(failed=1), None)
    payload = to_front_end([wrapper.get_kv_connector_stats()])
    assert payload["tails_zeroed"] == 0
    logging = KVConnectorLogging(vllm_config.kv_transfer_config)
    logging.observe(payload)
    (line,) = logged(logging)
    assert "'Num failed transfers': 1" in line


# --------------------- KVTailConnector children of one outer MultiConnector


def test_two_wrapped_children_keep_their_inner_stats_apart():
    plugin.register()  # the front end rebuilds children by registered name
    wrapped = [wrap_kv_transfer_config(child) for child in (NIXL, MOONCAKE)]
    vllm_config = make_vllm_config(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": wrapped},
    )
    outer = MultiConnector(
        vllm_config, KVConnectorRole.SCHEDULER, make_kv_cache_config(block_size=16, num_blocks=8)
    )
    nixl_tail, mooncake_tail = outer.sub_connectors
    feed_children(
        SimpleNamespace(sub_connectors=[nixl_tail.inner, mooncake_tail.inner]),
        nixl_stats(failed=2),
        mooncake_stats(loads=3),
    )
    nixl_tail._stats.add("tails_zeroed", 1)
    mooncake_tail._stats.add("tails_zeroed", 4)
    # vLLM merges its children's stats by class name: both are KVTailConnector.
    payload = to_front_end([outer.get_kv_connector_stats()])
    assert list(payload) == ["KVTailConnector"]

    logging = KVConnectorLogging(vllm_config.kv_transfer_config)
    logging.observe(payload)
    logging.observe(copy.deepcopy(payload))
    (line,) = logged(logging)
    assert "'kvtail_tails_zeroed': 10" in line
    assert "'NixlPullConnector': {" in line and "'Num failed transfers': 4" in line
    assert "'MooncakeStoreConnector': {" in line and "'load_get_count': 6" in line


# ------------------- inner stats vLLM itself cannot handle stay out of the way


def test_inner_stats_vllm_cannot_rebuild_do_not_fail_the_front_end():
    # vLLM's MultiConnector rebuilds children by registered name only: a child
    # loaded from a module path raises ValueError there, inside the front end's
    # output handler. The wrapper drops those inner stats and keeps its own.
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiKVConnectorStats,
    )

    ours = KVTailStats(inner_connector=connector_path(MultiConnector))
    ours.add("tails_zeroed", 2)
    inner = MultiKVConnectorStats(data={"OutOfTreeConnector": nixl_stats(failed=1)})
    payload = to_front_end([ours.take(inner)])
    logging = KVConnectorLogging(multi_backend([NIXL]).kv_transfer_config)
    logging.observe(payload)
    (line,) = logged(logging)
    assert line == "KV Transfer metrics: kvtail_tails_zeroed=2"


def test_inner_metrics_that_fail_do_not_fail_the_front_end():
    # vLLM 0.32's MultiConnector metrics assert on a child without metrics of
    # its own (ExampleConnector); 0.33 skips it. Either way ours are recorded.
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    vllm_config = multi_backend([NIXL, example], disable_hybrid_kv_cache_manager=True)
    registry = CollectorRegistry()
    prom = KVTailConnector.build_prom_metrics(
        vllm_config, registry_metric_types(registry), ["engine"], {0: ["0"]}
    )
    payload = {
        "tails_zeroed": 1,
        "inner": {
            connector_path(MultiConnector): {
                "ExampleConnector": {},
                "NixlPullConnector": nixl_stats(failed=1).to_dict(),
            }
        },
    }
    prom.observe(payload, engine_idx=0)
    assert registry.get_sample_value("vllm:kvtail_tails_zeroed_total", {"engine": "0"}) == 1
