"""Helpers of the engine tests: skips for transports that cannot be imported."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from functools import cache

import pytest


@cache
def import_error(module: str) -> str | None:
    """None if ``module`` imports in a fresh interpreter, else the error's last line.

    Checked in a child process: the native libraries (UCX, ibverbs) stay out of
    the pytest process, and a missing shared library shows up as the reason.
    """
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{module.split('.')[0]} is not installed"
    r = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120
    )
    if r.returncode == 0:
        return None
    lines = (r.stderr or r.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {r.returncode}"


def require(module: str) -> None:
    """Skip the test when ``module`` (a transport: ``nixl._api``, ``mooncake.store``)
    cannot be imported, naming the error."""
    err = import_error(module)
    if err is not None:
        pytest.skip(f"cannot import {module}: {err}")
