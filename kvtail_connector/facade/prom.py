"""Prometheus counters for the wrapper, beside the inner connector's metrics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from kvtail_connector.core.stats import COUNTERS, GAUGES, INNER
from kvtail_connector.log import get_logger

logger = get_logger(__name__)

# Metric name suffix and help text per counter (names: vllm:kvtail_<suffix>).
METRICS = {
    "tails_zeroed": "Requests whose stale block tail was zeroed after a KV load.",
    "tail_bytes_zeroed": "Bytes of stale block tails zeroed after KV loads (all ranks).",
    "read_blocks_exempted": "MoRIIO READ destination blocks kept from vLLM's new-block zeroing.",
    "failed_loads": "Async KV loads reported failed or with invalid blocks (requests).",
    "probed_tails": "Loaded requests whose tails probe_stale_tails inspected.",
    "stale_nonzero_bytes": "Non-zero bytes probe_stale_tails found in tails before zeroing.",
    "stale_nonfinite_values": "Non-finite values probe_stale_tails found in tails before zeroing.",
    "tails_vouched": "Producer: remote-decode requests sent with a clean-tail claim.",
    "producer_tail_bytes_zeroed": "Producer: bytes of prompt tails zeroed before sending (all "
    "ranks).",
    "vouched_tails": "Consumer: loaded requests whose tail was not zeroed, the producer having "
    "vouched for it.",
    "vouched_tail_bytes": "Consumer: tail bytes not zeroed because the producer vouched for them "
    "(all ranks).",
    "vouches_declined": "Consumer: producer claims refused (malformed, too large, unknown or "
    "known-wrong producer version, not bound to this transfer, MAC missing or wrong, other "
    "geometry or length).",
    "vouches_unused": "Consumer: valid producer claims matching the load, not used to skip "
    "zeroing (async loads under vouch_tails auto: the tail was zeroed anyway).",
    "false_vouches": "Consumer: vouched tails probe_stale_tails found non-zero (then zeroed).",
    "digests_sent": "Producer: remote-decode requests sent with a KV digest (verify_kv).",
    "digests_verified": "Consumer: async loads whose KV matched the producer's digest.",
    "digest_mismatches": "Consumer: async loads whose KV differed from the producer's digest "
    "(reported failed; kv_load_failure_policy applies).",
    "digests_skipped": "Consumer: async loads whose digest could not be used (unbound, "
    "another layout, no whole segment inside the loaded range) or that no worker compared.",
    "digests_absent": "Consumer: async loads that came without a digest (under verify_kv "
    "sample, the producer's unsampled requests; behind a plain producer, every load).",
    "internal_errors": "Failures of the wrapper's own code contained in a connector hook (the "
    "affected loads reported failed, claims not made; see the ERROR log).",
}
GAUGE_METRICS = {
    "held_requests": "Requests the wrapper holds state for (largest over its scheduler side "
    "and each worker); 0 when idle.",
}
assert set(METRICS) == set(COUNTERS), "every counter has a metric"
assert set(GAUGE_METRICS) == set(GAUGES), "every gauge has a metric"


class KVTailPromMetrics(KVConnectorPromMetrics):
    """One counter per :data:`~kvtail_connector.core.stats.COUNTERS` entry, per
    engine, with vLLM's labels; the inner connector's metrics observe their
    own payload.

    Args:
        inner: the inner connector's metrics by connector class path (the key
            its stats payload is filed under). A payload of another inner
            connector (a second wrapper under one outer MultiConnector, which
            builds metrics once per class) is not observed.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        inner: Mapping[str, KVConnectorPromMetrics],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._inner = dict(inner)
        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:kvtail_{name}", documentation=doc, labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for name, doc in METRICS.items()
        }
        self._gauges = {
            name: create_metric_per_engine(
                self._gauge_cls(  # type: ignore[call-arg]
                    name=f"vllm:kvtail_{name}",
                    documentation=doc,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                ),
                per_engine_labelvalues,
            )
            for name, doc in GAUGE_METRICS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters.items():
            value = int(transfer_stats_data.get(name, 0))
            if value:
                per_engine[engine_idx].inc(value)  # type: ignore[union-attr]
        for name, per_engine in self._gauges.items():
            if name in transfer_stats_data:
                per_engine[engine_idx].set(int(transfer_stats_data[name]))  # type: ignore[union-attr]
        for path, payload in (transfer_stats_data.get(INNER) or {}).items():
            metrics = self._inner.get(path)
            if metrics is None:
                continue
            try:
                metrics.observe(payload, engine_idx)
            except Exception as e:  # noqa: BLE001 - this runs in vLLM's output handler
                # An exception there fails every request (vLLM 0.32's
                # MultiConnector metrics assert on a child without metrics).
                logger.warning_once(
                    "kvtail: %s could not record its metrics (%s: %s)", path, type(e).__name__, e
                )
