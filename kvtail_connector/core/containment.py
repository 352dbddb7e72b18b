"""Keep the wrapper's own failures out of vLLM's step loop.

Every facade hook runs the inner connector's part as if unwrapped and the
wrapper's part (``TailScheduler`` / ``TailWorker``) inside ``try``; an
exception of the wrapper's part goes to :meth:`Containment.failed`, which

- re-raises it unchanged when it came from the inner connector (an inner
  method our part called through :func:`call_inner`, e.g.
  ``get_loaded_kv_cache_group_ids`` for a load's record): it then propagates
  exactly as without the wrapper;
- re-raises it unchanged when it is a device error (``torch.AcceleratorError``,
  a ``RuntimeError`` starting "CUDA error" or "HIP error"): such an error is
  sticky, it may surface first in our ``event.query()`` or ``synchronize()``,
  and the device context is unusable for the inner connector and the model
  alike, so the engine must fail as it would without the wrapper;
- otherwise logs one ERROR naming the hook and the requests (the traceback
  the first time each hook fails, then one line), counts
  ``internal_errors``, and runs the hook's fail-safe fallback, whose own
  failure is logged and swallowed too.

What each hook's fallback does is the facade's choice, hook by hook: an async
load the wrapper can no longer vouch for is reported in ``failed_recving`` (with
its completion), so vLLM's ``kv_load_failure_policy`` applies (``recompute``:
its blocks are dropped and the prompt computed locally; ``fail``: the request
ends with an error); a MoRIIO READ (synchronous: it cannot be reported failed)
keeps its tail zeroed by the workers, or by vLLM where the wrapper could not
take its destinations out of vLLM's zero list, and the ERROR of a fallback
names the READ tails left stale where neither holds; a producer request whose
hook failed gets no claim (its consumer zeroes as after a plain producer).

The wrapper's parts call the inner connector only through :func:`call_inner`,
which tags what it raises: that tag is the whole inner-or-ours test. The normal
path costs nothing (a ``try`` block is free in CPython 3.11).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.log import get_logger

logger = get_logger(__name__)

T = TypeVar("T")


_INNER = "_kvtail_raised_by_inner"

R = TypeVar("R")


def call_inner(method: Callable[..., R], *args: Any) -> R:
    """Call an inner connector's ``method`` from the wrapper's part of a hook:
    what it raises is tagged as the inner connector's (:func:`raised_by`), so
    the facade lets it propagate as without the wrapper."""
    try:
        return method(*args)
    except BaseException as exc:
        mark_inner(exc)
        raise


def mark_inner(exc: BaseException) -> None:
    """Tag ``exc`` as the inner connector's (see :func:`call_inner`)."""
    # object.__setattr__: an exception type that refuses attributes (a frozen
    # dataclass) is tagged too; only one without a __dict__ stays untagged.
    with contextlib.suppress(Exception):
        object.__setattr__(exc, _INNER, True)


def raised_by_inner(exc: BaseException) -> bool:
    """Whether ``exc`` came out of an inner connector's method that the
    wrapper's part called (:func:`call_inner`); otherwise it is the wrapper's own."""
    return bool(getattr(exc, _INNER, False))


class Containment:
    """One per facade: tells the inner connector's exceptions from ours and
    contains ours."""

    def __init__(self, stats: KVTailStats) -> None:
        self._stats = stats
        self._traced: set[str] = set()  # hooks whose traceback was logged

    def failed(
        self,
        exc: Exception,
        hook: str,
        requests: Iterable[str] = (),
        fallback: Callable[[], T] | None = None,
        default: T | None = None,
    ) -> T | None:
        """Handle ``exc``, raised in ``hook``'s wrapper part: re-raise it if it
        is the inner connector's, else log, count and return ``fallback()``
        (``default`` where there is none, or it failed too)."""
        if raised_by_inner(exc) or is_device_error(exc):
            raise exc
        self._stats.add("internal_errors", 1)
        names = sorted(set(requests))
        first = hook not in self._traced
        self._traced.add(hook)
        logger.error(
            "KVTailConnector: internal error in %s (request(s): %s): %r. Contained: the engine "
            "keeps running; affected async loads are reported failed (kv_load_failure_policy "
            "applies), MoRIIO READ tails are still zeroed by the wrapper or by vLLM (an ERROR "
            "names any left stale), and no producer claim is made for them. Please report "
            "this with the traceback%s.",
            hook,
            ", ".join(names) if names else "none identified",
            exc,
            "" if first else " logged at the first error of this hook",
            exc_info=exc if first else None,
        )
        if fallback is None:
            return default
        try:
            return fallback()
        except Exception as again:  # the fallback is ours too: never let it out
            if is_device_error(again):
                raise
            self._stats.add("internal_errors", 1)
            logger.error(
                "KVTailConnector: the fallback of %s failed too: %r", hook, again, exc_info=again
            )
            return default


_ACCELERATOR_ERROR: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(torch, "AcceleratorError", None),) if isinstance(t, type)
)
_DEVICE_ERROR_PREFIXES = ("CUDA error", "HIP error")


def is_device_error(exc: BaseException) -> bool:
    """Whether ``exc`` reports a device (CUDA/HIP) error: the context is
    unusable from then on, whoever's call it surfaced in; never contained."""
    if _ACCELERATOR_ERROR and isinstance(exc, _ACCELERATOR_ERROR):
        return True
    return isinstance(exc, RuntimeError) and str(exc).startswith(_DEVICE_ERROR_PREFIXES)


def safe_ids(items: Any) -> list[str]:
    """Request ids from ``items`` (ids, or objects with ``req_id`` /
    ``request_id``), for an ERROR line; never raises."""
    out: list[str] = []
    try:
        for item in items or ():
            rid = getattr(item, "req_id", None) or getattr(item, "request_id", None) or item
            out.append(str(rid))
    except Exception:
        pass
    return out
