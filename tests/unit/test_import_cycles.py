"""No two modules of the package import each other, directly or around a loop.

Every import counts, also one inside a function or under ``TYPE_CHECKING``:
a lazy import hides a loop from Python's import order, not from a reader.
The imports are read from the source (nothing is imported), so the test needs
neither vLLM nor torch.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kvtail_connector"


def _modules() -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file of the package."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = Path(folder, file)
            parts = ("kvtail_connector", *path.relative_to(PACKAGE).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` (at ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                # ``from pkg import mod`` imports the module; ``from mod import name`` the module.
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop of ``graph`` (its modules in order, the first repeated), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_loop_and_passes_a_tree():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_reader_sees_the_facades_imports():
    modules = _modules()
    imported = _imported(
        "kvtail_connector.facade.connector", modules["kvtail_connector.facade.connector"], modules
    )
    assert {"kvtail_connector.facade.assembly", "kvtail_connector.facade.inner"} <= imported
    adapters = _imported(
        "kvtail_connector.connectors.multi", modules["kvtail_connector.connectors.multi"], modules
    )
    assert adapters == {"kvtail_connector.connectors.base"}  # a relative import


def test_no_import_cycle_in_the_package():
    modules = _modules()
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    loop = _cycle(graph)
    assert loop is None, "import cycle: " + " -> ".join(loop or [])
