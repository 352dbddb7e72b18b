"""The package's size guards (issue 37): a module over 450 lines or a class over
300 is a smell to split along a seam, not to squeeze; ``ruff format`` decides the
lines."""

from __future__ import annotations

import ast
from pathlib import Path

import kvtail_connector

PACKAGE = Path(kvtail_connector.__file__).parent
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 300


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_is_over_450_lines():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_class_is_over_300_lines():
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = lines
    assert long == {}


def test_the_guards_see_the_package():
    assert len(_modules()) > 100
