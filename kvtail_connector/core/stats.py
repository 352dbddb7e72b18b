"""``KVConnectorStats`` for the wrapper, carrying the inner connector's beside ours.

The payload crossing processes is a plain dict (msgspec/pickle-safe): our
counters, plus each inner connector's own payload filed under that
connector's class path. vLLM rebuilds stats through the top-level connector
class only (``build_kv_connector_stats``), so on the front end the wrapper
rebuilds the inner stats the same way, through the inner connector class's
own ``build_kv_connector_stats``: an inner MultiConnector rebuilds its
children there, as it would at the top level.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvtail_connector.log import get_logger

logger = get_logger(__name__)

COUNTERS = (
    "tails_zeroed",
    "tail_bytes_zeroed",
    "read_blocks_exempted",
    "failed_loads",
    "probed_tails",
    "stale_nonzero_bytes",
    "stale_nonfinite_values",
    "tails_vouched",
    "producer_tail_bytes_zeroed",
    "vouched_tails",
    "vouched_tail_bytes",
    "vouches_declined",
    "vouches_unused",
    "false_vouches",
    "digests_sent",
    "digests_verified",
    "digest_mismatches",
    "digests_skipped",
    "digests_absent",
    "internal_errors",
)
# Levels, not counts. Each part of the wrapper (scheduler side, every worker)
# reports its level in every step where it is non-zero or has just changed,
# and leaves it out otherwise; the largest value reported in a step wins.
GAUGES = ("held_requests",)
_COUNTER_SET = frozenset(COUNTERS)
INNER = "inner"  # {"module:QualName" of an inner connector class: its stats payload}


def connector_path(cls: type) -> str:
    """``"module:QualName"`` of a connector class: the key its stats are filed under."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _load_connector(path: str) -> Any:
    module, _, name = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj if callable(getattr(obj, "build_kv_connector_stats", None)) else None


@dataclass
class KVTailStats(KVConnectorStats):
    """Counters since the last reset, and the inner connectors' stats.

    Counters: ``tails_zeroed`` (requests whose loaded tail was zeroed),
    ``tail_bytes_zeroed`` (all ranks), ``read_blocks_exempted`` (MoRIIO READ
    destinations kept from vLLM's zeroing), ``failed_loads`` (async loads
    reported failed or with invalid blocks, per request), ``probed_tails``
    (requests inspected), ``stale_nonzero_bytes`` and
    ``stale_nonfinite_values`` (what ``probe_stale_tails`` found before
    zeroing, all ranks). Producer claims (``vouch_tails``): ``tails_vouched``
    (requests sent with the claim) and ``producer_tail_bytes_zeroed`` on the
    producer; on the consumer ``vouched_tails`` and ``vouched_tail_bytes``
    (tails not zeroed: a bound claim on a path where claims are trusted),
    ``vouches_unused`` (valid claims matching the load on a path where claims
    are not used, binding and MAC not computed: the tail was zeroed anyway),
    ``vouches_declined`` (entries or
    claims refused: malformed, too large, unknown or known-wrong producer,
    unbound or bound to another transfer, MAC missing or wrong with a key,
    other geometry or length) and ``false_vouches`` (the probe's canary).
    KV digests (``verify_kv``): ``digests_sent`` on the producer;
    ``digests_verified``, ``digest_mismatches`` (loads then reported failed)
    ``digests_skipped`` (async loads whose digest could not be used, or none
    of whose segments could be compared) and ``digests_absent`` (async loads
    that came without a digest: under sampling, the producer's unsampled
    requests) on the consumer. Per-request counters
    are counted once per request (the scheduler side, or the first worker
    rank), so vLLM's sum over TP workers stays a count of requests.
    ``internal_errors``: failures of the wrapper's own code that a hook
    contained (:mod:`~kvtail_connector.core.containment`), one per hook call, on
    whichever part (scheduler side or worker rank) it happened.

    Gauge ``held_requests``: requests the wrapper holds state for (the largest
    number over the scheduler side and each worker); present in a snapshot
    only when that part's level is non-zero or has just changed.

    Attributes:
        inner_connector: class path of the wrapped connector; :meth:`take`
            files the inner stats under it.
        inner_stats: inner stats by connector class path. One entry per
            wrapper; several where an outer MultiConnector aggregates
            wrappers around different inner connectors (vLLM merges its children's
            stats by class name, and every wrapper is a KVTailConnector).
    """

    inner_connector: str | None = None
    inner_stats: dict[str, KVConnectorStats] = field(default_factory=dict)

    def __post_init__(self) -> None:
        data = self.data
        # Built every step a counter moved (take): C-level checks, no genexpr.
        if not data.keys() >= _COUNTER_SET:
            for name in COUNTERS:
                data.setdefault(name, 0)
        # Cheap emptiness for the per-step report (is_empty runs every step).
        self._touched = any(map(int, map(data.__getitem__, COUNTERS)))

    def add(self, counter: str, amount: int = 1) -> None:
        self.data[counter] = int(self.data[counter]) + int(amount)
        self._touched = True

    def set_gauge(self, gauge: str, value: int) -> None:
        self.data[gauge] = int(value)
        self._touched = True

    def __getitem__(self, counter: str) -> int:
        return int(self.data[counter])

    def take(self, inner: KVConnectorStats | None) -> KVTailStats:
        """A snapshot carrying ``inner`` (the inner connector's stats, filed
        under :attr:`inner_connector`); this object's counters restart at 0."""
        path = self.inner_connector
        if inner is not None and path is None:
            raise ValueError("KVTailStats(inner_connector=...) is needed to carry inner stats")
        # The counters and gauges move to the snapshot whole (add and
        # set_gauge store ints); this object restarts from zeros, no gauge.
        data, self.data = self.data, dict.fromkeys(COUNTERS, 0)
        snap = KVTailStats(data=data, inner_connector=path)
        if inner is not None and path is not None:
            snap.inner_stats[path] = inner
        snap._touched = self._touched
        self._touched = False
        return snap

    def to_dict(self) -> dict[str, Any]:
        # vLLM calls this in update_from_output for every step whose workers
        # zeroed a tail: one C-level copy (data holds every counter and the
        # gauges set, all ints: add, set_gauge, aggregate, from_dict store ints).
        out: dict[str, Any] = dict(self.data)
        if self.inner_stats:
            out[INNER] = {path: stats.to_dict() for path, stats in self.inner_stats.items()}
        return out

    def reset(self) -> None:
        for name in COUNTERS:
            self.data[name] = 0
        for name in GAUGES:
            self.data.pop(name, None)
        self._touched = False
        for stats in self.inner_stats.values():
            stats.reset()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        assert isinstance(other, KVTailStats), "workers and scheduler run the same wrapper"
        for name in COUNTERS:
            self.data[name] = int(self.data[name]) + int(other.data[name])
        for name in GAUGES:
            if name in other.data:
                self.data[name] = max(int(other.data[name]), int(self.data.get(name, 0)))
        self._touched = self._touched or other._touched
        for path, stats in other.inner_stats.items():
            mine = self.inner_stats.get(path)
            self.inner_stats[path] = stats if mine is None else mine.aggregate(stats)
        return self

    def reduce(self) -> dict[str, Any]:
        # Only what happened: an idle wrapper adds nothing to vLLM's log line.
        out: dict[str, Any] = {
            f"kvtail_{name}": int(self.data[name]) for name in COUNTERS if int(self.data[name])
        }
        live = {path: s for path, s in self.inner_stats.items() if not s.is_empty()}
        if len(live) == 1:
            out.update(next(iter(live.values())).reduce())
        else:  # several inner connectors: one entry each, as MultiConnector logs its children
            for path, stats in live.items():
                out[path.rpartition(":")[2]] = stats.reduce()
        return out

    def is_empty(self) -> bool:
        return not self._touched and (
            not self.inner_stats or all(s.is_empty() for s in self.inner_stats.values())
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> KVTailStats:
        """Rebuild from a payload (``to_dict`` output, after any process hop).

        Inner payloads are rebuilt by their connector class's own
        ``build_kv_connector_stats``; stats objects (no process hop) are kept.
        """
        data = data or {}
        stats = cls(data={name: int(data.get(name, 0)) for name in COUNTERS})
        stats.data.update({name: int(data[name]) for name in GAUGES if name in data})
        for path, payload in (data.get(INNER) or {}).items():
            if isinstance(payload, KVConnectorStats):
                stats.inner_stats[path] = payload
                continue
            connector = _load_connector(path)
            if connector is None:
                logger.warning_once(
                    "kvtail: cannot load connector %s here; its stats are not reported", path
                )
                continue
            try:
                rebuilt = connector.build_kv_connector_stats(data=payload)
            except Exception as e:  # noqa: BLE001 - this runs in vLLM's output handler
                # There an exception fails every request; the inner
                # connector's stats are not worth that (vLLM's own
                # MultiConnector, say, cannot rebuild a child it does not
                # know by name).
                logger.warning_once(
                    "kvtail: %s could not rebuild its stats (%s: %s); they are not reported",
                    path,
                    type(e).__name__,
                    e,
                )
                continue
            if rebuilt is not None:
                stats.inner_stats[path] = rebuilt
        return stats
