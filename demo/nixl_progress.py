"""Slow down NIXL's progress thread in this process (harness processes only).

NIXL's Python agent creates its progress thread with no pause between polls
(``nixl/_api.py`` sets ``pthrDelay = 0``), so every idle NIXL engine keeps one
core busy. On a 2-core machine two idle engines take all of it. A pause of a
few hundred microseconds between polls stops that and delays progress by at
most as much. vLLM exposes no setting for it, so the harness changes NIXL's
config class (not vLLM) in the processes it starts.
"""

from __future__ import annotations

import os
import sys

# The environment variable that asks the harness's ``sitecustomize`` to apply it
# in a server process and in the engine process the server spawns.
DELAY_ENV = "KVTAIL_NIXL_PROGRESS_DELAY_US"


def slow_nixl_progress_thread(delay_us: int) -> bool:
    """Make every NIXL agent this process creates pause ``delay_us`` between progress
    polls. Returns False when NIXL is not installed (nothing to slow down).

    nixl_agent.__init__ builds a ``nixlAgentConfig`` and sets ``pthrDelay = 0``; a
    subclass whose setter keeps at least ``delay_us`` changes only that number.
    """
    # vLLM sets this before it imports NIXL (distributed/nixl_utils.py); importing
    # NIXL here first would stop it, so do the same.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        from nixl._api import nixl_agent
    except Exception:
        return False
    bind = sys.modules[nixl_agent.__module__].nixlBind
    base = bind.nixlAgentConfig
    if getattr(base, "_kvtail_patched", False):
        return True
    prop = base.pthrDelay

    class _Config(base):  # type: ignore[misc, valid-type]
        _kvtail_patched = True

        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's name
            return prop.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            prop.__set__(self, max(int(value), delay_us))

    bind.nixlAgentConfig = _Config
    return True


def apply_from_env() -> None:
    """Apply :func:`slow_nixl_progress_thread` when ``KVTAIL_NIXL_PROGRESS_DELAY_US``
    holds a positive number of microseconds."""
    value = os.environ.get(DELAY_ENV, "")
    if value.isdigit() and int(value) > 0:
        slow_nixl_progress_thread(int(value))
