"""What crosses from the scheduler side to the workers (and back).

The wrapper's metadata carries the inner connector's metadata untouched, plus
one :class:`LoadRecord` per load that started this step. Records are shipped
once; workers keep them until the inner connector reports the load done.

KVTAIL_PROTOCOL_VERSION: bump when a field changes meaning or layout.
  1: LoadRecord(req_id, num_local, num_loaded, groups), GroupLoad(group,
     first_block, block_ids); KVTailMetadata(inner, loads, read_loads).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

KVTAIL_PROTOCOL_VERSION = 1

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
        version: :data:`KVTAIL_PROTOCOL_VERSION` of the sender.
    """

    inner: KVConnectorMetadata
    loads: tuple[LoadRecord, ...] = ()
    read_loads: tuple[LoadRecord, ...] = ()
    version: int = KVTAIL_PROTOCOL_VERSION
