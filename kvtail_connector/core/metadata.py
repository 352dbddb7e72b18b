"""What crosses from the scheduler side to the workers (and back).

The wrapper's metadata carries the inner connector's metadata untouched, plus
one :class:`LoadRecord` per load that started this step. Records are shipped
once; workers keep them until the inner connector reports the load done.

This protocol is in-process (scheduler <-> workers of one engine, one
installed package on both ends): no reader meets another version of it.
:data:`KVTAIL_PROTOCOL_VERSION`, which every :class:`KVTailMetadata` carries,
is bumped when a field changes meaning or layout. What crosses from a producer
to a consumer (the opt-in features' ``kvtail`` entry) is versioned on its own.

The opt-in features (``kvtail_connector.extras``) ship their own per-step
payload in :attr:`KVTailMetadata.extra` and :attr:`KVTailWorkerMeta.extra`,
keyed by request: no record here carries their types.
"""

from __future__ import annotations

import functools
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

KVTAIL_PROTOCOL_VERSION = 7

NULL_BLOCK = -1  # a block the load does not write (vLLM's null block)


# The record types are NamedTuples: immutable like a frozen dataclass, and
# built about five times faster (a LoadRecord in ~0.2 µs on CPU against ~1 µs
# as a frozen dataclass: benchmarks/RESULTS.md §4, host cost); one is built per
# load on the scheduler's step path. ``_replace`` where a part attaches something.


class GroupLoad(NamedTuple):
    """The blocks one load writes in one KV cache group.

    Attributes:
        group: KV cache group id.
        first_block: index, in the request's block list, of ``block_ids[0]``
            (the block holding token ``num_local``).
        block_ids: the blocks covering tokens ``[num_local, num_loaded)``;
            :data:`NULL_BLOCK` for null (skipped) blocks. A tuple where the
            scheduler built it; an ``array('q')`` once pickled to a worker
            process (a multi-process executor): index, slice, iterate or
            ``np.frombuffer`` it, never hash or compare it to a tuple.
    """

    group: int
    first_block: int
    block_ids: Sequence[int]

    def __reduce__(self) -> tuple[Any, ...]:
        # To a worker process the ids travel as one int64 buffer: one object
        # to unpickle and, when the load completes, to free, where a tuple
        # is one int object per block (64 for a 1k-token load).
        return (GroupLoad, (self.group, self.first_block, _WireIds(self.block_ids)))

    # Immutable: a copy is the record itself (copy would go through __reduce__).
    def __copy__(self) -> GroupLoad:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> GroupLoad:
        return self


class _WireIds:
    """Block ids on their way to a worker process: pickled as
    ``array('q', <int64 bytes>)``."""

    __slots__ = ("ids",)

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = ids

    def __reduce__(self) -> tuple[Any, ...]:
        ids = self.ids
        raw = ids.tobytes() if isinstance(ids, array) else _int64s(len(ids)).pack(*ids)
        return (array, ("q", raw))


@functools.lru_cache(maxsize=512)
def _int64s(n: int) -> struct.Struct:
    # Native order and size, as array('q') reads its bytes back.
    return struct.Struct(f"={n}q")


class LoadRecord(NamedTuple):
    """One load: tokens ``[num_local, num_loaded)`` of ``req_id`` arrive.

    ``num_loaded`` is the count before vLLM's full-hit ``N-1`` rewind (the
    forward rewrites that slot anyway); the tail starts there. A producer's
    own prompt record (the opt-in features') has ``num_local == 0`` and
    ``num_loaded`` = the prompt length.
    """

    req_id: str
    num_local: int
    num_loaded: int
    groups: tuple[GroupLoad, ...]


@dataclass
class KVTailMetadata(KVConnectorMetadata):
    """Scheduler -> worker: the inner connector's metadata and new loads.

    Attributes:
        inner: the wrapped connector's metadata, as it built it.
        loads: async loads started this step (tails zeroed on completion).
        read_loads: synchronous MoRIIO READ loads (tails zeroed once landed);
            their ``num_loaded`` is the producer's prompt length, where the
            stale tail its blocks carry starts.
        failing: async loads whose record a contained internal error lost:
            workers report them failed when they complete.
        extra: the opt-in features' payload for this step (opaque here), or None.
        version: :data:`KVTAIL_PROTOCOL_VERSION` of the sender.
    """

    inner: KVConnectorMetadata
    loads: tuple[LoadRecord, ...] = ()
    read_loads: tuple[LoadRecord, ...] = ()
    failing: tuple[str, ...] = ()
    extra: Any = None
    version: int = KVTAIL_PROTOCOL_VERSION


class WorkerReport(Protocol):
    """What the opt-in features report from a worker per step: folded over
    the workers by :meth:`aggregate`."""

    def aggregate(self, other: Any) -> Any: ...


@dataclass
class KVTailWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: the inner connector's worker metadata,
    and what the opt-in features report.

    vLLM's ``KVOutputAggregator`` folds every worker's metadata with
    :meth:`aggregate`. Ranks are ids, not counts: an output folded twice
    (replayed) cannot stand in for a rank that did not report.

    Attributes:
        inner: the inner connector's worker metadata (unwrapped before the
            inner connector's ``update_connector_output``).
        ranks: ranks (vLLM world-group ranks) folded into this object.
        extra: the opt-in features' report, folded over the ranks that sent
            one (:class:`WorkerReport`), or None.
    """

    inner: KVConnectorWorkerMetadata | None = None
    ranks: frozenset[int] = frozenset({0})
    extra: WorkerReport | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVTailWorkerMeta):
            raise TypeError(
                f"every worker runs KVTailConnector, yet one sent {type(other).__name__}"
            )
        return KVTailWorkerMeta(
            inner=_folded(self.inner, other.inner),
            ranks=self.ranks | other.ranks,
            extra=_folded(self.extra, other.extra),
        )


def _folded(mine: Any, theirs: Any) -> Any:
    if mine is None:
        return theirs
    return mine if theirs is None else mine.aggregate(theirs)
