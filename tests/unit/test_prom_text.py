"""The harness's view of ``/metrics``: samples by name, sums, the wrapper's values."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from demo.prom_text import delta, info_label, kvtail_values, parse_metrics, total

TEXT = """\
# HELP vllm:kvtail_tails_zeroed Tails zeroed.
# TYPE vllm:kvtail_tails_zeroed counter
vllm:kvtail_tails_zeroed_total{engine="0",model_name="m"} 3.0
vllm:kvtail_tails_zeroed_total{engine="1",model_name="m"} 4.0
vllm:kvtail_tails_zeroed_created{engine="0",model_name="m"} 1.7e+09
# HELP vllm:kvtail_held_requests Held.
# TYPE vllm:kvtail_held_requests gauge
vllm:kvtail_held_requests{engine="0"} 0.0
# HELP vllm:cache_config_info Cache config.
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",note="a \\"quoted\\" b, c=d"} 1.0
# HELP vllm:num_requests_kv_fetch_by_stage Fetches.
# TYPE vllm:num_requests_kv_fetch_by_stage gauge
vllm:num_requests_kv_fetch_by_stage{stage="in_progress"} 2.0
vllm:num_requests_kv_fetch_by_stage{stage="done"} 5.0
# HELP vllm:e2e Latency.
# TYPE vllm:e2e histogram
vllm:e2e_bucket{le="1.0"} 2.0
vllm:e2e_bucket{le="+Inf"} 3.0
vllm:e2e_count 3.0
vllm:e2e_sum 4.5
"""


def test_samples_sums_and_the_wrappers_values():
    m = parse_metrics(TEXT)
    assert total(m, "vllm:kvtail_tails_zeroed_total") == 7.0
    assert total(m, "vllm:kvtail_tails_zeroed_total", engine="1") == 4.0
    assert total(m, "vllm:num_requests_kv_fetch_by_stage", stage="in_progress") == 2.0
    assert total(m, "vllm:e2e_bucket", le="+Inf") == 3.0 and total(m, "vllm:e2e_sum") == 4.5
    assert total(m, "vllm:absent") == 0
    assert info_label(m, "vllm:cache_config_info", "block_size") == "32"
    assert info_label(m, "vllm:cache_config_info", "note") == 'a "quoted" b, c=d'
    with pytest.raises(KeyError, match="no label 'dtype'"):
        info_label(m, "vllm:cache_config_info", "dtype")
    values = kvtail_values(m)
    assert values == {"tails_zeroed": 7.0, "held_requests": 0.0}
    assert delta(values, {"tails_zeroed": 5.0}) == {"tails_zeroed": 2.0, "held_requests": 0.0}
