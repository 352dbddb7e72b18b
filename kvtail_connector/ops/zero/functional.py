"""`zero_kv_blocks`: the functional form of :class:`KVZeroer` (one call, plans cached)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kvtail_connector.ops.geometry import RegionCache
from kvtail_connector.ops.integers import as_int, int_rows
from kvtail_connector.ops.zero.zeroer import CacheLike, KVZeroer

# Triton plans of recent calls, by the caches' addresses and layouts. A plan
# holds no tensor (KVZeroer(hold_caches=False)), so a cache the caller frees
# is released at once; a plan found here is only used with caches of exactly
# its addresses and layouts, which is all its row table depends on. Fresh
# plans cost 0.6-9.4 ms per call on an H200 (1-80 layers: row table, pinned
# staging, first launch) against 0.2-0.4 ms with one.
_PLANS: OrderedDict[tuple, KVZeroer] = OrderedDict()
_MAX_PLANS = 16


def _tensor_of(cache: CacheLike) -> object:
    return cache.tensor if isinstance(cache, RegionCache) else cache


def _cache_key(cache: CacheLike) -> tuple:
    t = _tensor_of(cache)
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return (id(cache),)  # refused when the plan is built; never cached
    extra = (cache.slots_per_page, cache.regions) if isinstance(cache, RegionCache) else ()
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, *extra)


def _implementation_for(caches: Sequence[CacheLike]) -> str:
    """What :func:`zero_kv_blocks` zeroes ``caches`` with: what
    ``KVZeroer(implementation="auto")`` picks (Triton on CUDA, torch elsewhere)."""
    for cache in caches:
        t = _tensor_of(cache)
        if isinstance(t, torch.Tensor):
            return "triton" if t.device.type == "cuda" else "torch"
    return "torch"


def _plan(caches: Sequence[CacheLike], pages_per_block: int) -> KVZeroer:
    if isinstance(caches, (torch.Tensor, RegionCache)):
        raise ValueError("caches: expected a sequence of caches, got a single cache")
    caches = list(caches)
    if _implementation_for(caches) != "triton":
        # The torch path zeroes through the tensors: a cached plan would hold
        # them, and building one costs little next to the work itself.
        return KVZeroer([(caches, pages_per_block)], implementation="torch")
    key = (pages_per_block, *map(_cache_key, caches))
    plan = _PLANS.get(key)
    if plan is None:
        # Ad-hoc calls: no CUDA graphs (they would pin buffers per cache set).
        plan = KVZeroer(
            [(caches, pages_per_block)],
            implementation="triton",
            use_graphs=False,
            hold_caches=False,
        )
        _PLANS[key] = plan
        if len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


def zero_kv_blocks(
    caches: Sequence[CacheLike],
    block_ids: Iterable[int] = (),
    tails: Iterable[tuple[int, int]] = (),
    *,
    pages_per_block: int = 1,
) -> None:
    """Zero whole manager blocks and block tails of KV caches.

    For each cache ``t`` with ``P = pages_per_block`` and ``N = t.shape[2]``:

    - block ``b``: ``t[b*P:(b+1)*P] = 0``;
    - tail ``(b, v)``: every local slot ``s`` in ``[v, P*N)`` is zeroed:
      ``t[b*P + s // N, :, s % N, :] = 0``;
    - every other byte of the underlying storage is unchanged.

    On CUDA all caches, blocks and tails go in one Triton launch (none when
    there is nothing to zero, e.g. views with a zero-sized dimension);
    elsewhere a vectorized torch path runs. The caches are not kept: one
    freed after the call is released.

    Every id, slot and ``pages_per_block`` is an integral scalar (``int``,
    numpy integer, 0-d integer tensor); ``block_ids`` and ``tails`` may also
    be an integer array or dense tensor of shape ``[n]`` / ``[n, 2]``.

    Args:
        caches: per-layer ``[B, H, N, C]`` views (any strides/dtype), or
            :class:`RegionCache` for pages described by regions.
        block_ids: manager block ids to zero whole.
        tails: ``(block id, first local slot to zero)`` pairs.
        pages_per_block: kernel pages per manager block; ``B = blocks * P``.

    Raises:
        ValueError: naming the argument: not an integer (bool, float, str,
            sparse tensor...), wrong rank, block id or slot out of range
            (with no caches there is no block), caches on different devices,
            sparse caches, bad ``pages_per_block``.
    """
    pages_per_block = as_int("pages_per_block", pages_per_block, minimum=1)
    blocks = int_rows(block_ids, 1, "block_ids")
    tail_arr = int_rows(tails, 2, "tails")
    plan = _plan(caches, pages_per_block)
    items_b = np.zeros((blocks.shape[0], 3), dtype=np.int64)
    items_b[:, 1] = blocks[:, 0]
    items_t = np.zeros((tail_arr.shape[0], 3), dtype=np.int64)
    items_t[:, 1:] = tail_arr
    plan.check_items(items_b, "block_ids")
    plan.check_items(items_t, "tails")
    if plan.num_rows == 0:
        return  # no byte to zero: no caches, or only empty views
    plan.zero(np.concatenate([items_b, items_t]), validate=False)
