"""Find vLLM's decisions keyed on the connector's name, and compare them with the audit.

``tests/scheduler/test_name_keyed.py`` and ``scripts/vllm-release-check`` share
this module. :func:`scan` reads a vLLM tree (its AST, nothing imported) and
reports every place that decides by the connector's name:

* a call of ``has_connector(...)``;
* a comparison (``==``, ``!=``, ``in``, ``not in``) of ``kv_connector``
  (``x.kv_connector``, ``x.get("kv_connector")``, ``getattr(x, "kv_connector")``)
  with a string, a tuple/list/set holding a string, or a variable;
* a comparison of a local variable assigned from ``kv_connector`` in the same
  function (``connector_name = ktc.kv_connector``) with a string or a
  tuple/list/set holding strings (``connector_name == "NixlConnector"``).
  Compared with anything else (``connector_name in cls._registry``,
  ``is None``) it is not a decision by name.

:func:`compare` sets the sites found against the table
(``kvtail_connector.facade.name_keyed.RULES``): each table site holds, moved, or was
removed; each site found that no table site accounts for is new.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# A site found within this many lines of a table site is that site.
NEAR = 2


@dataclass(frozen=True)
class Found:
    """A name-keyed site in a vLLM tree: ``path`` under the ``vllm`` package,
    the line of the name it compares with, the expression (``ast.unparse``)."""

    path: str
    line: int
    text: str


def _is_connector_name(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr == "kv_connector"
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr == "get":  # x.get("kv_connector")
        key = node.args[0] if node.args else None
    elif isinstance(func, ast.Name) and func.id == "getattr":  # getattr(x, "kv_connector")
        key = node.args[1] if len(node.args) > 1 else None
    else:
        return False
    return isinstance(key, ast.Constant) and key.value == "kv_connector"


def _is_string(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _holds_a_string(node: ast.AST) -> bool:
    if _is_string(node):
        return True
    return isinstance(node, ast.Tuple | ast.List | ast.Set) and any(map(_is_string, node.elts))


def _name_variables(scope: ast.AST) -> set[str]:
    """The local names assigned a connector name in ``scope`` (not in nested functions)."""
    names: set[str] = set()
    for node in _walk_scope(scope):
        if isinstance(node, ast.Assign) and _is_connector_name(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif (
            isinstance(node, ast.AnnAssign | ast.NamedExpr)
            and node.value is not None
            and _is_connector_name(node.value)
            and isinstance(node.target, ast.Name)
        ):
            names.add(node.target.id)
    return names


def _walk_scope(scope: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` of ``scope`` that does not enter nested functions or classes."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))


def _scopes(tree: ast.Module) -> Iterator[ast.AST]:
    yield tree
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            yield node


def _compare_site(node: ast.Compare, variables: set[str]) -> bool:
    operands = [node.left, *node.comparators]
    others = [o for o in operands if not _is_connector_name(o)]
    if len(others) < len(operands):  # kv_connector itself: with a name or a variable
        return any(_holds_a_string(o) or isinstance(o, ast.Name) for o in others)
    held = [o for o in operands if isinstance(o, ast.Name) and o.id in variables]
    return bool(held) and any(_holds_a_string(o) for o in operands if o not in held)


def scan_source(source: str, path: str) -> Iterator[Found]:
    """The name-keyed sites of one module's source (``path`` names it in the result)."""
    tree = ast.parse(source)
    for scope in _scopes(tree):
        variables = _name_variables(scope)
        for node in _walk_scope(scope):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "has_connector"
            ):
                yield Found(path, node.lineno, ast.unparse(node))
            elif isinstance(node, ast.Compare) and _compare_site(node, variables):
                # Point at the line holding the name compared with.
                operands = [node.left, *node.comparators]
                line = max(getattr(o, "lineno", node.lineno) for o in operands)
                yield Found(path, line, ast.unparse(node))


def scan(root: Path) -> list[Found]:
    """Every name-keyed site of the vLLM package at ``root``, by path and line."""
    found: list[Found] = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        # Every site spells one of these; parsing only such modules keeps a
        # scan of vLLM to seconds.
        if "kv_connector" in source or "has_connector" in source:
            found += scan_source(source, str(path.relative_to(root)))
    return sorted(set(found), key=lambda f: (f.path, f.line, f.text))


# ------------------------------------------------------------ against the table


@dataclass(frozen=True)
class TableSite:
    """A site of the audit table: its rule and where the table says it is."""

    rule: str
    path: str
    line: int
    text: str


@dataclass
class Comparison:
    """The table's sites against a tree.

    Attributes:
        held: table sites whose line (within :data:`NEAR`) holds their text.
        moved: ``(site, line)``: the text is elsewhere in the same file.
        removed: table sites whose text is nowhere in their file.
        new: sites found that no table site accounts for.
    """

    held: list[TableSite] = field(default_factory=list)
    moved: list[tuple[TableSite, int]] = field(default_factory=list)
    removed: list[TableSite] = field(default_factory=list)
    new: list[Found] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.moved or self.removed or self.new)


def _lines_holding(lines: Sequence[str], line: int, text: str) -> bool:
    # The table's text is on the site's line or one of the lines next to it.
    near = "\n".join(lines[max(line - 3, 0) : line + 2])
    return text in near


def compare(root: Path, table: Iterable[TableSite], found: Sequence[Found]) -> Comparison:
    """Locate each table site in the tree at ``root``; then what ``found`` adds.

    A site that does not hold has moved to a line of its file that holds its
    text and is a site found (within :data:`NEAR`), not taken by another
    table site: the one nearest to where the rule's previous site in that file
    moved (sites of one rule move together), else removed.
    """
    table = list(table)
    result = Comparison()
    lines_of: dict[str, list[str]] = {}
    for site in {s.path for s in table}:
        file = root / site
        lines_of[site] = file.read_text().splitlines() if file.exists() else []
    located: set[tuple[str, int]] = set()
    unheld = []
    for site in table:
        if _lines_holding(lines_of[site.path], site.line, site.text):
            result.held.append(site)
            located.add((site.path, site.line))
        else:
            unheld.append(site)
    shifts: dict[tuple[str, str], int] = {}
    for site in sorted(unheld, key=lambda s: (s.path, s.line)):
        expected = site.line + shifts.get((site.rule, site.path), 0)
        candidates = [
            n
            for n, text in enumerate(lines_of[site.path], start=1)
            if site.text in text
            and (site.path, n) not in located
            and any(f.path == site.path and abs(f.line - n) <= NEAR for f in found)
        ]
        if not candidates:
            result.removed.append(site)
            continue
        line = min(candidates, key=lambda n: abs(n - expected))
        result.moved.append((site, line))
        located.add((site.path, line))
        shifts[(site.rule, site.path)] = line - site.line
    for f in found:
        if not any((f.path, near) in located for near in range(f.line - NEAR, f.line + NEAR + 1)):
            result.new.append(f)
    return result


def missing_from(found: Iterable[Found], table: Iterable[TableSite]) -> list[Found]:
    """The sites found that no table site (by path and line, within :data:`NEAR`) lists."""
    listed = {(s.path, s.line) for s in table}
    return [
        f
        for f in found
        if not any((f.path, near) in listed for near in range(f.line - NEAR, f.line + NEAR + 1))
    ]
