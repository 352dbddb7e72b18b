"""What crosses from the scheduler side to the workers (and back).

The wrapper's metadata carries the inner connector's metadata untouched, plus
one :class:`LoadRecord` per load that started this step. Records are shipped
once; workers keep them until the inner connector reports the load done.

KVTAIL_PROTOCOL_VERSION: bump when a field changes meaning or layout.
  1: LoadRecord(req_id, num_local, num_loaded, groups), GroupLoad(group,
     first_block, block_ids); KVTailMetadata(inner, loads, read_loads).
  2: LoadRecord.vouched; KVTailMetadata.producer_tails; KVTailWorkerMeta.

This protocol is in-process (scheduler <-> workers of one engine); what
crosses from a producer to a consumer is the ``kvtail`` entry
(:mod:`kvtail_connector.entry`), versioned on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

KVTAIL_PROTOCOL_VERSION = 2

NULL_BLOCK = -1  # a block the load does not write (vLLM's null block)


@dataclass(frozen=True, slots=True)
class GroupLoad:
    """The blocks one load writes in one KV cache group.

    Attributes:
        group: KV cache group id.
        first_block: index, in the request's block list, of ``block_ids[0]``
            (the block holding token ``num_local``).
        block_ids: the blocks covering tokens ``[num_local, num_loaded)``;
            :data:`NULL_BLOCK` for null (skipped) blocks.
    """

    group: int
    first_block: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """One load: tokens ``[num_local, num_loaded)`` of ``req_id`` arrive.

    ``num_loaded`` is the count before vLLM's full-hit ``N-1`` rewind (the
    forward rewrites that slot anyway); the tail starts there.

    ``vouched``: the producer zeroed that tail before sending it and said so
    (a matching ``kvtail`` entry): workers skip its zeroing. A producer's own
    tail record (``KVTailMetadata.producer_tails``) has ``num_local == 0``,
    ``num_loaded`` = the prompt length, and only the block holding the prompt's
    last token in each group with a partial last block.
    """

    req_id: str
    num_local: int
    num_loaded: int
    groups: tuple[GroupLoad, ...]
    vouched: bool = False


@dataclass
class KVTailMetadata(KVConnectorMetadata):
    """Scheduler -> worker: the inner connector's metadata and new loads.

    Attributes:
        inner: the wrapped connector's metadata, as it built it.
        loads: async loads started this step (tails zeroed on completion).
        read_loads: synchronous MoRIIO READ loads (tails zeroed once landed);
            their ``num_loaded`` is the producer's prompt length, where the
            stale tail its blocks carry starts.
        producer_tails: remote-decode prompts completing this step (on a
            producer): tails the workers zero and confirm.
        version: :data:`KVTAIL_PROTOCOL_VERSION` of the sender.
    """

    inner: KVConnectorMetadata
    loads: tuple[LoadRecord, ...] = ()
    read_loads: tuple[LoadRecord, ...] = ()
    producer_tails: tuple[LoadRecord, ...] = ()
    version: int = KVTAIL_PROTOCOL_VERSION


@dataclass
class KVTailWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: which producer tails each rank zeroed.

    vLLM's ``KVOutputAggregator`` folds every worker's metadata with
    :meth:`aggregate`, so after it ``confirmed[req] == ranks`` means every rank
    that reported zeroed that request's tail. Ranks are ids, not counts: an
    output folded twice (replayed) cannot stand in for a rank that did not zero.

    Attributes:
        inner: the inner connector's worker metadata (unwrapped before the
            inner connector's ``update_connector_output``).
        confirmed: request id -> ranks that zeroed its producer tail this step.
        ranks: ranks (vLLM world-group ranks) folded into this object.
    """

    inner: KVConnectorWorkerMetadata | None = None
    confirmed: dict[str, frozenset[int]] = field(default_factory=dict)
    ranks: frozenset[int] = frozenset({0})

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVTailWorkerMeta):
            raise TypeError(
                f"every worker runs KVTailConnector, yet one sent {type(other).__name__}"
            )
        inner: Any = self.inner
        if inner is None:
            inner = other.inner
        elif other.inner is not None:
            inner = inner.aggregate(other.inner)
        confirmed = dict(self.confirmed)
        for req_id, ranks in other.confirmed.items():
            confirmed[req_id] = confirmed.get(req_id, frozenset()) | ranks
        return KVTailWorkerMeta(inner=inner, confirmed=confirmed, ranks=self.ranks | other.ranks)
