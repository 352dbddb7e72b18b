"""The scheduler side's core reaches the opt-in features only through
``kvtail_connector.extension`` (what the assembly wires in), never by import.

Direct imports only: ``metadata.py`` still carries the features' record
fields (``LoadRecord.vouched``, ``expected``), which the worker side reads.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvtail_connector

PACKAGE = Path(kvtail_connector.__file__).parent

# The scheduler side's core: the router and the parts every engine runs.
CORE = (
    "scheduler.py",
    "extension.py",
    "features/load_starts.py",
    "features/records.py",
    "features/consumer_tails/scheduler.py",
    "features/read_tails/scheduler.py",
    "features/load_errors/scheduler.py",
)
FEATURES = (
    "kvtail_connector.features.entry_features",
    "kvtail_connector.features.entries",
    "kvtail_connector.features.producer_claims",
    "kvtail_connector.features.kv_verification",
    "kvtail_connector.entry",
    "kvtail_connector.trust",
)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_scheduler_core_imports_no_opt_in_feature():
    found = {
        module: sorted(n for n in _imports(PACKAGE / module) if n.startswith(FEATURES))
        for module in CORE
    }
    assert {m: names for m, names in found.items() if names} == {}


def test_the_check_sees_a_feature_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from kvtail_connector.features.entries import EntryReader\n")
    assert any(n.startswith(FEATURES) for n in _imports(probe))
