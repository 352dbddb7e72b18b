"""The Grafana dashboard in examples/ shows what a live server exposes.

Every metric a panel queries is one the wrapped decode server's ``/metrics``
has, and every ``vllm:kvtail_*`` metric the server exposes is on a panel.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.serve.conftest import Servers

pytestmark = pytest.mark.serve

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "kvtail-dashboard.json"
_METRIC = re.compile(r"vllm:[A-Za-z0-9_:]+")


def _queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            exprs.append(var["definition"])
    return exprs


def test_dashboard_queries_metrics_a_live_server_exposes(servers: Servers) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {m for e in _queries(dashboard) for m in _METRIC.findall(e)}
    assert queried, "the dashboard queries nothing"
    exposed = set(servers.wrapped.decode.metrics())
    assert sorted(queried - exposed) == []
    kvtail = {m for m in exposed if m.startswith("vllm:kvtail_") and not m.endswith("_created")}
    assert sorted(kvtail - queried) == []
    for panel in dashboard["panels"]:
        assert panel["targets"] and panel["title"] and panel["description"], panel["id"]
