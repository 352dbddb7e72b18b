"""Stats, Prometheus metrics and the stale-tail probe."""

from __future__ import annotations

import logging

import msgspec
import numpy as np
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvtail_connector.core.kvgroups import group_infos
from kvtail_connector.core.metadata import GroupLoad, KVTailMetadata, LoadRecord
from kvtail_connector.core.parts.zeroing import RankPlacement
from kvtail_connector.core.stats import COUNTERS, KVTailStats, connector_path
from kvtail_connector.facade.assembly import build_worker
from kvtail_connector.facade.connector import KVTailConnector
from kvtail_connector.facade.inner import wrapper_fields
from kvtail_connector.log import PARENT
from tests.helpers.vllm_factories import make_kv_cache_config, make_vllm_config
from tests.helpers.worker_caches import ErrorSource, allocate, tail_policy


def registry_metric_types(registry):
    def bound(cls):
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args, **kwargs):
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def test_stats_round_trip_msgspec_and_aggregate():
    a, b = KVTailStats(), KVTailStats()
    for i, name in enumerate(COUNTERS):
        a.add(name, i + 1)
        b.add(name, 10 * (i + 1))
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(a.to_dict()))
    rebuilt = KVTailStats.from_dict(wire)
    assert rebuilt.to_dict() == a.to_dict()
    total = rebuilt.aggregate(KVTailStats.from_dict(b.to_dict()))
    assert all(total[name] == 11 * (i + 1) for i, name in enumerate(COUNTERS))
    assert total.reduce()["kvtail_tails_zeroed"] == 11
    assert not total.is_empty()
    total.reset()
    assert total.is_empty()


def test_prometheus_counters_register_with_vllm_labels_and_observe():
    registry = CollectorRegistry()
    vllm_config = make_vllm_config(
        **wrapper_fields({"backend": "NixlConnector"}),
    )
    labelnames = ["model_name", "engine"]
    prom = KVTailConnector.build_prom_metrics(
        vllm_config,
        registry_metric_types(registry),
        labelnames,
        {0: ["tiny", "0"], 1: ["tiny", "1"]},
    )
    stats = KVTailStats()
    stats.add("tails_zeroed", 3)
    stats.add("tail_bytes_zeroed", 1536)
    stats.add("read_blocks_exempted", 2)
    prom.observe(stats.to_dict(), engine_idx=1)
    labels = {"model_name": "tiny", "engine": "1"}
    assert registry.get_sample_value("vllm:kvtail_tails_zeroed_total", labels) == 3
    assert registry.get_sample_value("vllm:kvtail_tail_bytes_zeroed_total", labels) == 1536
    assert registry.get_sample_value("vllm:kvtail_read_blocks_exempted_total", labels) == 2
    assert (
        registry.get_sample_value(
            "vllm:kvtail_tails_zeroed_total", {"model_name": "tiny", "engine": "0"}
        )
        == 0
    )
    # The inner connector's metrics (NIXL) registered beside ours.
    names = {m.name for m in registry.collect()}
    assert any(n.startswith("vllm:nixl") for n in names)


def _worker_with_poisoned_tail(probe: bool):
    kv = make_kv_cache_config(block_size=16, num_blocks=8)
    caches = allocate(kv)
    groups = group_infos(kv, 1)
    stats = KVTailStats()
    worker = build_worker(groups, RankPlacement(), tail_policy(probes=probe), stats=stats)
    worker.register_kv_caches(caches.views, kv, caches.layers)
    for view in caches.views.values():
        view.zero_()
        view[3, :, :5, :] = 1.0  # 5 loaded slots of block 3
        view[3, 0, 5:9, 0] = float("nan")  # 4 stale NaN values
        view[3, 0, 9:, 1] = 2.0  # 7 stale finite non-zero values
    record = LoadRecord("req-7", 0, 16 * 3 + 5, (GroupLoad(0, 0, (0, 1, 2, 3)),))
    worker.bind(KVTailMetadata(inner=None, loads=(record,)))  # type: ignore[arg-type]
    return worker, caches, stats


def test_probe_counts_the_nan_bytes_of_a_poisoned_tail_exactly(caplog):
    worker, caches, stats = _worker_with_poisoned_tail(probe=True)
    view = next(iter(caches.views.values()))
    el = view.element_size()
    logging.getLogger(PARENT).addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger=PARENT):
            worker.on_transfer_results({"req-7"}, set(), inner=ErrorSource())
    finally:
        logging.getLogger(PARENT).removeHandler(caplog.handler)
    layers = len(caches.views)
    assert stats["stale_nonfinite_values"] == 4 * layers
    # Non-zero bytes of one fp32 NaN (0x7FC00000) and of 2.0 (0x40000000).
    assert el == 4
    nan_bytes = int(torch.tensor([float("nan")]).view(torch.uint8).count_nonzero())
    two_bytes = int(torch.tensor([2.0]).view(torch.uint8).count_nonzero())
    assert (nan_bytes, two_bytes) == (2, 1)
    assert stats["stale_nonzero_bytes"] == (4 * nan_bytes + 7 * two_bytes) * layers
    assert stats["probed_tails"] == 1
    assert any("req-7" in r.getMessage() and "non-finite" in r.getMessage() for r in caplog.records)
    for v in caches.views.values():
        assert not v[3, :, 5:].any() and torch.all(v[3, :, :5] == 1.0)


def test_probe_off_counts_nothing():
    worker, caches, stats = _worker_with_poisoned_tail(probe=False)
    worker.on_transfer_results({"req-7"}, set(), inner=ErrorSource())
    assert stats["probed_tails"] == 0 and stats["stale_nonzero_bytes"] == 0
    assert stats["tails_zeroed"] == 1
    assert not np.isnan(next(iter(caches.views.values()))[3].numpy()).any()


def test_scheduler_side_stats_are_reported_by_the_scheduler_connector():
    vllm_config = make_vllm_config(
        **wrapper_fields({"backend": "NixlConnector"}),
    )
    wrapper = KVTailConnector(
        vllm_config, KVConnectorRole.SCHEDULER, make_kv_cache_config(block_size=16, num_blocks=8)
    )
    assert wrapper.get_kv_connector_stats() is None  # nothing yet: no empty payloads
    wrapper._stats.add("read_blocks_exempted", 5)
    stats = wrapper.get_kv_connector_stats()
    assert isinstance(stats, KVTailStats) and stats["read_blocks_exempted"] == 5
    assert wrapper.get_kv_connector_stats() is None  # counters restart after a report


def _logged_lines(payloads: list[dict]) -> list[str]:
    """What vLLM's KVConnectorLogging prints for ``payloads`` observed in one interval."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    vllm_config = make_vllm_config(
        **wrapper_fields({"backend": "NixlConnector"}),
    )
    log = KVConnectorLogging(vllm_config.kv_transfer_config)
    for payload in payloads:
        log.observe(msgspec.msgpack.decode(msgspec.msgpack.encode(payload)))
    lines: list[str] = []
    log.log(lambda fmt, *args: lines.append(fmt % args))
    return lines


def test_an_idle_wrapper_adds_nothing_to_vllms_log_line():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    inner = NixlKVConnectorStats()
    inner.record_failed_transfer()
    wrapper_stats = KVTailStats(inner_connector=connector_path(NixlConnector))
    (line,) = _logged_lines([wrapper_stats.take(inner).to_dict()])
    assert "Num failed transfers=1" in line and "kvtail" not in line
    ours = KVTailStats()
    ours.add("tails_zeroed", 2)
    (line,) = _logged_lines([ours.take(None).to_dict()])
    assert line == "KV Transfer metrics: kvtail_tails_zeroed=2"  # zero counters left out


def test_a_gauge_only_report_reaches_prometheus_but_not_the_log_line():
    stats = KVTailStats()
    stats.set_gauge("held_requests", 0)
    snapshot = stats.take(None)
    assert not snapshot.is_empty()  # the scheduler forwards it (vLLM skips empty ones)
    assert _logged_lines([snapshot.to_dict()]) == []
    registry = CollectorRegistry()
    vllm_config = make_vllm_config(
        **wrapper_fields({"backend": "NixlConnector"}),
    )
    prom = KVTailConnector.build_prom_metrics(
        vllm_config, registry_metric_types(registry), ["engine"], {0: ["0"]}
    )
    busy = KVTailStats()
    busy.set_gauge("held_requests", 3)
    prom.observe(busy.take(None).to_dict())
    assert registry.get_sample_value("vllm:kvtail_held_requests", {"engine": "0"}) == 3
    prom.observe(KVTailStats().take(None).to_dict())  # no level in it: unchanged
    assert registry.get_sample_value("vllm:kvtail_held_requests", {"engine": "0"}) == 3
    prom.observe(snapshot.to_dict())
    assert registry.get_sample_value("vllm:kvtail_held_requests", {"engine": "0"}) == 0


def test_the_largest_held_level_of_a_step_wins_and_absent_levels_do_not_count():
    parts = []
    for level in (2, None, 5):
        s = KVTailStats()
        if level is not None:
            s.set_gauge("held_requests", level)
        parts.append(KVTailStats.from_dict(s.take(None).to_dict()))
    total = parts[0].aggregate(parts[1]).aggregate(parts[2])
    assert total.to_dict()["held_requests"] == 5
    assert "held_requests" not in KVTailStats().to_dict()
