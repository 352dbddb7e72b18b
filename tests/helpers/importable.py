"""Whether a module can be imported, without importing it (for conftest gates)."""

from __future__ import annotations

import importlib.util


def importable(name: str) -> bool:
    """True when ``name`` would import: found on the path and not blocked."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent missing, or sys.modules[name] is None
        return False
