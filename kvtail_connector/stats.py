"""``KVConnectorStats`` for the wrapper, carrying the inner connector's beside ours.

The payload crossing processes is a plain dict (msgspec/pickle-safe): our
counters, plus the inner connector's own payload and where to find its class
to rebuild it on the front end (vLLM resolves stats through the top-level
connector class only).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = (
    "tails_zeroed",
    "tail_bytes_zeroed",
    "read_blocks_exempted",
    "failed_loads",
    "probed_tails",
    "stale_nonzero_bytes",
    "stale_nonfinite_values",
)
# Levels, not counts. Each part of the wrapper (scheduler side, every worker)
# reports its level in every step where it is non-zero or has just changed,
# and leaves it out otherwise; the largest value reported in a step wins.
GAUGES = ("held_requests",)
INNER = "inner"
INNER_CLASS = "inner_class"  # "module:QualName" of the inner stats class


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _load_class(path: str) -> type | None:
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]
    except (ImportError, AttributeError):
        return None


@dataclass
class KVTailStats(KVConnectorStats):
    """Counters since the last reset, and the inner connector's stats.

    Counters: ``tails_zeroed`` (requests whose loaded tail was zeroed),
    ``tail_bytes_zeroed`` (all ranks), ``read_blocks_exempted`` (MoRIIO READ
    destinations kept from vLLM's zeroing), ``failed_loads`` (async loads
    reported failed or with invalid blocks, per request), ``probed_tails``
    (requests inspected), ``stale_nonzero_bytes`` and
    ``stale_nonfinite_values`` (what ``probe_stale_tails`` found before
    zeroing, all ranks). Per-request counters are counted once per request
    (the scheduler side, or the first worker rank), so vLLM's sum over TP
    workers stays a count of requests.

    Gauge ``held_requests``: requests the wrapper holds state for (the largest
    number over the scheduler side and each worker); present in a snapshot
    only when that part's level is non-zero or has just changed.
    """

    inner_stats: KVConnectorStats | None = None

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)
        # Cheap emptiness for the per-step report (is_empty runs every step).
        self._touched = any(int(self.data[name]) for name in COUNTERS)

    def add(self, counter: str, amount: int = 1) -> None:
        self.data[counter] = int(self.data[counter]) + int(amount)
        self._touched = True

    def set_gauge(self, gauge: str, value: int) -> None:
        self.data[gauge] = int(value)
        self._touched = True

    def __getitem__(self, counter: str) -> int:
        return int(self.data[counter])

    def take(self, inner: KVConnectorStats | None) -> KVTailStats:
        """A snapshot carrying ``inner``; this object's counters restart at 0."""
        snap = KVTailStats(data={name: int(self.data[name]) for name in COUNTERS})
        snap.inner_stats = inner
        for name in GAUGES:
            if name in self.data:
                snap.data[name] = int(self.data.pop(name))
        snap._touched = self._touched
        for name in COUNTERS:
            self.data[name] = 0
        self._touched = False
        return snap

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: int(self.data[name]) for name in COUNTERS}
        out.update({name: int(self.data[name]) for name in GAUGES if name in self.data})
        if self.inner_stats is not None:
            out[INNER] = self.inner_stats.to_dict()
            out[INNER_CLASS] = self.data.get(INNER_CLASS) or _class_path(type(self.inner_stats))
        return out

    def reset(self) -> None:
        for name in COUNTERS:
            self.data[name] = 0
        for name in GAUGES:
            self.data.pop(name, None)
        self._touched = False
        if self.inner_stats is not None:
            self.inner_stats.reset()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        assert isinstance(other, KVTailStats), "workers and scheduler run the same wrapper"
        for name in COUNTERS:
            self.data[name] = int(self.data[name]) + int(other.data[name])
        for name in GAUGES:
            if name in other.data:
                self.data[name] = max(int(other.data[name]), int(self.data.get(name, 0)))
        self._touched = self._touched or other._touched
        if other.inner_stats is not None:
            self.inner_stats = (
                other.inner_stats
                if self.inner_stats is None
                else self.inner_stats.aggregate(other.inner_stats)
            )
        return self

    def reduce(self) -> dict[str, int | float]:
        # Only what happened: an idle wrapper adds nothing to vLLM's log line.
        out: dict[str, int | float] = {
            f"kvtail_{name}": int(self.data[name]) for name in COUNTERS if int(self.data[name])
        }
        if self.inner_stats is not None and not self.inner_stats.is_empty():
            out.update(self.inner_stats.reduce())
        return out

    def is_empty(self) -> bool:
        return not self._touched and (self.inner_stats is None or self.inner_stats.is_empty())

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> KVTailStats:
        """Rebuild from a payload (``to_dict`` output, after any process hop)."""
        data = data or {}
        stats = cls(data={name: int(data.get(name, 0)) for name in COUNTERS})
        stats.data.update({name: int(data[name]) for name in GAUGES if name in data})
        inner_data = data.get(INNER)
        inner_cls = _load_class(data[INNER_CLASS]) if INNER_CLASS in data else None
        if (
            inner_data is not None
            and inner_cls is not None
            and issubclass(inner_cls, KVConnectorStats)
        ):
            stats.inner_stats = inner_cls(data=inner_data)
            stats.data[INNER_CLASS] = data[INNER_CLASS]
        return stats
