"""Every wrapper metric has a panel on the example Grafana dashboard (the live
check, tests/serve/test_dashboard.py, needs API servers; this one runs always)."""

from __future__ import annotations

import json
from pathlib import Path

from kvtail_connector.core.stats import COUNTERS, GAUGES

DASHBOARD = Path(__file__).parents[2] / "examples" / "grafana" / "kvtail-dashboard.json"


def test_every_counter_and_gauge_is_queried_by_a_panel():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = " ".join(t["expr"] for p in panels for t in p.get("targets", []))
    missing = [f"vllm:kvtail_{c}_total" for c in COUNTERS if f"vllm:kvtail_{c}_total" not in exprs]
    missing += [f"vllm:kvtail_{g}" for g in GAUGES if f"vllm:kvtail_{g}" not in exprs]
    assert missing == []
