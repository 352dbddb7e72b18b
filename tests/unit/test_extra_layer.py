"""The core reaches the opt-in features (``kvtail_connector/extras``) only
through ``kvtail_connector.core.extension``, as the assembly wires them in: no core
module imports them, and the assembly only inside the functions that build
them (so that a package without the folder imports and runs)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvtail_connector

PACKAGE = Path(kvtail_connector.__file__).parent
EXTRAS = "kvtail_connector.extras"
WIRING = Path("facade") / "assembly.py"


def _imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _core_modules() -> list[Path]:
    return [
        p
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.relative_to(PACKAGE).parts[0] != "extras" and p.relative_to(PACKAGE) != WIRING
    ]


def test_no_core_module_imports_an_opt_in_feature():
    found = {
        str(p.relative_to(PACKAGE)): sorted(n for n in _imports(p) if n.startswith(EXTRAS))
        for p in _core_modules()
    }
    assert {m: names for m, names in found.items() if names} == {}


def test_the_assembly_imports_the_features_only_where_it_builds_them():
    wiring = PACKAGE / WIRING
    assert not {n for n in _imports(wiring, top_level_only=True) if n.startswith(EXTRAS)}
    assert {n for n in _imports(wiring) if n.startswith(EXTRAS)}  # it does wire them in


def test_the_core_imports_nothing_above_it():
    # The folders are the layers: facade/ over core/ (and extras/ beside it),
    # core/ over connectors/, pages/ and ops/.
    above = {
        "core": ("kvtail_connector.facade", EXTRAS),
        "connectors": ("kvtail_connector.facade", "kvtail_connector.core", EXTRAS),
        "pages": ("kvtail_connector.facade", "kvtail_connector.core", EXTRAS),
        "ops": ("kvtail_connector.facade", "kvtail_connector.core", EXTRAS),
        "extras": ("kvtail_connector.facade",),
    }
    found = {}
    for layer, forbidden in above.items():
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            names = sorted(n for n in _imports(path) if n.startswith(forbidden))
            if names:
                found[str(path.relative_to(PACKAGE))] = names
    assert found == {}


def test_the_check_sees_a_feature_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from kvtail_connector.extras.entries import EntryReader\n")
    assert any(n.startswith(EXTRAS) for n in _imports(probe))
    assert len(_core_modules()) > 40  # the walk sees the core
