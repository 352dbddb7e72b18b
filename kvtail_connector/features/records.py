"""Where a request's loaded or prompt tokens sit in its blocks, as
:class:`~kvtail_connector.metadata.LoadRecord` (scheduler side, shared by the
parts that ship records to the workers)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvtail_connector import _compat
from kvtail_connector.containment import mark_inner
from kvtail_connector.kvgroups import GroupInfo, state_block
from kvtail_connector.metadata import NULL_BLOCK, GroupLoad, LoadRecord
from kvtail_connector.tails import tail_block


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
    request's state (:func:`~kvtail_connector.kvgroups.state_block`);
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
    if _compat.NULL_BLOCK_ID in ids:
        return tuple(NULL_BLOCK if i == _compat.NULL_BLOCK_ID else i for i in ids)
    return ids


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
        # Per group id, read once per load: tokens per manager block, and
        # that block size where the group has token tails (else None).
        self._sizes = tuple(info.effective_block for info in groups)
        self._tail_sizes = tuple(
            info.effective_block if info.has_tails else None for info in groups
        )

    def tail_index(self, num_loaded: int, group: int) -> int | None:
        tail = tail_block(num_loaded, self.groups[group].effective_block)
        return None if tail is None else tail[0]

    def loaded_groups(self, request: Any) -> Any:
        """The inner connector's answer; its exceptions tagged as its own."""
        try:
            return self._inner.get_loaded_kv_cache_group_ids(request)
        except BaseException as exc:
            mark_inner(exc)
            raise

    def written_blocks(
        self, blocks: Any, loaded_groups: Any, local: int, loaded: int
    ) -> tuple[list[int], ...]:
        """Per group in ``loaded_groups``, the ids of the blocks a load of
        tokens ``[local, loaded)`` writes (null blocks left in, for the reader
        to skip). ``blocks``: vLLM's ``KVCacheBlocks`` of the request; only
        the written blocks' ids are read (its ``get_block_ids`` lists every
        block of every group)."""
        sizes, per_group = self._sizes, blocks.blocks
        out = []
        for gid in loaded_groups:
            eb = sizes[gid]
            out.append([b.block_id for b in per_group[gid][local // eb : -(-loaded // eb)]])
        return tuple(out)

    def record(
        self,
        request: Any,
        blocks: Any,
        local: int,
        loaded: int,
        *,
        tails_only: bool = False,
        keep: bool = False,
        loaded_groups: Any = None,
        written: tuple[list[int], ...] | None = None,
    ) -> LoadRecord | None:
        """The load's record, or None when block-aligned (nothing to zero or
        watch) unless ``keep`` (a load to verify). ``loaded_groups`` and
        ``written``: :meth:`loaded_groups` and :meth:`written_blocks`, where
        the caller has them already."""
        if loaded_groups is None:
            loaded_groups = self.loaded_groups(request)
        if written is None:
            written = self.written_blocks(blocks, loaded_groups, local, loaded)
        entries = []
        any_tail = False
        sizes = self._tail_sizes
        # written has one list per loaded group, in its order (by construction).
        for gid, ids in zip(loaded_groups, written, strict=False):
            eb = sizes[gid]
            if eb is None:
                continue
            any_tail = any_tail or tail_block(loaded, eb) is not None
            entries.append(GroupLoad(gid, local // eb, null_as_ours(tuple(ids))))
        if not entries or not (any_tail or keep or (self._every and not tails_only)):
            return None  # block-aligned: nothing stale to zero, nothing to watch
        return LoadRecord(request.request_id, local, loaded, tuple(entries))
