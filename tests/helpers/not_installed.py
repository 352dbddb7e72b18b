"""Make a fresh interpreter behave as if some packages were not installed.

For probes run with ``python -c``: the source :func:`hide` returns goes first
in the probe. The GPU benchmarks run without vLLM, and the kernel benchmarks
without pydantic too; on this machine both are installed, so hiding them is
how a test gets a benchmark machine's view of the imports.
"""

from __future__ import annotations


def hide(*packages: str) -> str:
    """Python source that makes every import of ``packages`` (and of their
    submodules) fail as a missing package's does, and records each name asked
    for in ``_NOT_INSTALLED.asked`` (an import attempt caught by the code under
    test still shows there)."""
    return f"""
import importlib.abc
import sys


class _NotInstalled(importlib.abc.MetaPathFinder):
    def __init__(self, packages):
        self.packages = packages
        self.asked = []

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.packages:
            self.asked.append(name)
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


assert not {{*sys.modules}} & {set(packages)!r}, "imported before the probe"
_NOT_INSTALLED = _NotInstalled({set(packages)!r})
sys.meta_path.insert(0, _NOT_INSTALLED)
"""
