"""Where a request's loaded or prompt tokens sit in its blocks, as
:class:`~kvtail_connector.core.metadata.LoadRecord` (scheduler side, shared by the
parts that ship records to the workers)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvtail_connector import _compat
from kvtail_connector.core.containment import call_inner
from kvtail_connector.core.kvgroups import GroupInfo, state_block
from kvtail_connector.core.metadata import NULL_BLOCK, GroupLoad, LoadRecord
from kvtail_connector.core.tails import tail_block


def is_prefill_leg(request: Any) -> bool:
    """A remote-decode request whose prefill the producer runs as a
    single-token request (``max_tokens == 1``, what P/D routers send): it
    finishes in the step its prompt completes, so no later forward of it
    (async scheduling's next step included) writes past the prompt."""
    params = request.kv_transfer_params
    return bool(params and params.get("do_remote_decode")) and (
        getattr(request, "max_tokens", 0) == 1
    )


def completing_prompts(
    scheduler_output: Any, producing: dict[str, Any], manager: Any
) -> Iterator[tuple[str, Any, int, Any]]:
    """``(req_id, request, prompt length, block ids per group)`` of each
    request in ``producing`` whose prompt this step completes."""
    scheduled = scheduler_output.num_scheduled_tokens
    for req_id in scheduled.keys() & producing.keys():
        request = producing[req_id]
        step = scheduled[req_id]
        done = int(request.num_computed_tokens)  # not yet advanced for this step
        n = int(request.num_prompt_tokens)
        if step <= 0 or not done < n <= done + step or manager is None:
            continue
        yield req_id, request, n, manager.get_block_ids(req_id)


def state_loads(
    groups: tuple[GroupInfo, ...], block_ids: Any, gids: Any = None
) -> tuple[GroupLoad, ...]:
    """Per state group (of ``gids``, default all): the block holding the
    request's state (:func:`~kvtail_connector.core.kvgroups.state_block`);
    vLLM's null block as :data:`NULL_BLOCK`."""
    out = []
    for info in groups:
        if info.state_scratch is None or (gids is not None and info.group_id not in gids):
            continue
        found = state_block(block_ids[info.group_id], info.state_scratch)
        if found is not None:
            index, block = found
            block = NULL_BLOCK if block == _compat.NULL_BLOCK_ID else block
            out.append(GroupLoad(info.group_id, index, (block,)))
    return tuple(out)


def null_as_ours(ids: tuple[int, ...]) -> tuple[int, ...]:
    """Block ids with vLLM's null block (sliding-window gaps) as :data:`NULL_BLOCK`."""
    return tuple(NULL_BLOCK if i == _compat.NULL_BLOCK_ID else i for i in ids)


class LoadRecords:
    """Builds the records of loads.

    Args:
        inner: the wrapped connector (it says which groups a load writes).
        groups: tail facts per KV cache group.
        records_every_load: block-aligned async loads get a record too.
    """

    def __init__(self, inner: Any, groups: tuple[GroupInfo, ...], *, records_every_load: bool):
        self._inner = inner
        self.groups = groups
        self._every = records_every_load
        # Per group id: tokens per manager block, and that size where the
        # group has token tails (None where it has none): read per load.
        self._block_sizes = tuple(info.effective_block for info in groups)
        self._tail_sizes = tuple(
            info.effective_block if info.has_tails else None for info in groups
        )

    def tail_index(self, num_loaded: int, group: int) -> int | None:
        tail = tail_block(num_loaded, self.groups[group].effective_block)
        return None if tail is None else tail[0]

    def loaded_groups(self, request: Any) -> tuple[int, ...]:
        """The inner connector's ``get_loaded_kv_cache_group_ids``, as a tuple
        (read twice: the ids written, then the record)."""
        groups = call_inner(lambda: self._inner.get_loaded_kv_cache_group_ids(request))
        if type(groups) is tuple:
            return groups
        # An answer that is no iterable fails this load alone (the wrapper's
        # own error, contained); what the inner's iterable raises is its own.
        return call_inner(tuple, iter(groups))

    def written(
        self, blocks: Any, loaded_groups: tuple[int, ...], local: int, loaded: int
    ) -> tuple[tuple[int, ...], ...]:
        """Per group of ``loaded_groups``, the ids of the blocks a load of
        tokens ``[local, loaded)`` into ``blocks`` (vLLM's ``KVCacheBlocks`` of
        the request) writes; vLLM's null block (a sliding window's gap) as
        :data:`NULL_BLOCK`, for the readers to skip."""
        written = []
        for gid in loaded_groups:
            size = self._block_sizes[gid]
            span = blocks.blocks[gid][local // size : -(-loaded // size)]
            ids = tuple([b.block_id for b in span])
            written.append(null_as_ours(ids) if _compat.NULL_BLOCK_ID in ids else ids)
        return tuple(written)

    def from_written(
        self,
        req_id: str,
        written: tuple[tuple[int, ...], ...],
        local: int,
        loaded: int,
        loaded_groups: tuple[int, ...],
        *,
        keep: bool = False,
        tails_only: bool = False,
    ) -> LoadRecord | None:
        """The record of a load (``written``: :meth:`written` of it), or None
        when block-aligned (nothing to zero or watch), unless ``keep`` (a
        load to verify) or every load is recorded (not with ``tails_only``)."""
        loads = []
        has_tail = False
        for gid, ids in zip(loaded_groups, written, strict=True):
            size = self._tail_sizes[gid]
            if size is None:
                continue
            has_tail = has_tail or loaded % size != 0
            loads.append(GroupLoad(gid, local // size, ids))
        if not loads or not (has_tail or keep or (self._every and not tails_only)):
            return None  # block-aligned: nothing stale, nothing to watch
        return LoadRecord(req_id, local, loaded, tuple(loads))

    def record(
        self, request: Any, blocks: Any, local: int, loaded: int, *, tails_only: bool = False
    ) -> LoadRecord | None:
        """:meth:`from_written` of a load, the groups asked of the inner connector."""
        groups = self.loaded_groups(request)
        written = self.written(blocks, groups, local, loaded)
        return self.from_written(
            request.request_id, written, local, loaded, groups, tails_only=tails_only
        )
