"""The engine-agnostic entry points: :func:`zero_kv_blocks` and :func:`warmup`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from kvtail_connector.ops import launcher as L
from kvtail_connector.ops.geometry import RegionCache
from kvtail_connector.ops.zeroer import CacheLike, KVZeroer

_PLANS: OrderedDict[tuple, KVZeroer] = OrderedDict()
_MAX_PLANS = 16


def warmup(device: torch.device | str | None = None) -> None:
    """Compile the zeroing kernel for ``device`` (default: the current CUDA device).

    The kernel has no specialized integer argument and its buffers are always
    fresh, 16-byte-aligned allocations, so this one compile covers every
    launch. No-op without CUDA (or the Triton interpreter).
    """
    dev = torch.device(device) if device is not None else None
    if dev is None:
        if not torch.cuda.is_available():
            return
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda" and not L.interpreting():
        return
    empty = torch.zeros(L.HEADER, dtype=torch.int64, device=dev)
    L.launch_jit(1, empty, empty)


def _cache_key(cache: CacheLike) -> tuple:
    t = cache.tensor if isinstance(cache, RegionCache) else cache
    if not isinstance(t, torch.Tensor):
        return (id(cache),)
    extra = (cache.slots_per_page, cache.regions) if isinstance(cache, RegionCache) else ()
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, *extra)


def _plan(caches: Sequence[CacheLike], pages_per_block: int) -> KVZeroer:
    key = (pages_per_block, *map(_cache_key, caches))
    plan = _PLANS.get(key)
    if plan is None:
        # Ad-hoc calls: no CUDA graphs (they would pin buffers per cache set).
        plan = KVZeroer([(caches, pages_per_block)], use_graphs=False)
        _PLANS[key] = plan
        if len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


def _int_array(values: Iterable[Any], cols: int, name: str) -> np.ndarray:
    try:
        arr = np.asarray(list(values), dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"{name}: expected integers ({e})") from None
    if arr.size == 0:
        return np.zeros((0, cols), dtype=np.int64)
    if (cols == 1 and arr.ndim != 1) or (cols > 1 and (arr.ndim != 2 or arr.shape[1] != cols)):
        shape = "block ids" if cols == 1 else "(block id, first slot) pairs"
        raise ValueError(f"{name}: expected {shape}")
    return arr.reshape(-1, cols)


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
    there is nothing to zero); elsewhere a vectorized torch path runs.

    Args:
        caches: per-layer ``[B, H, N, C]`` views (any strides/dtype), or
            :class:`RegionCache` for pages described by regions.
        block_ids: manager block ids to zero whole.
        tails: ``(block id, first local slot to zero)`` pairs.
        pages_per_block: kernel pages per manager block; ``B = blocks * P``.

    Raises:
        ValueError: naming the argument: wrong rank, block id or slot out of
            range, caches on different devices, bad ``pages_per_block``.
    """
    blocks = _int_array(block_ids, 1, "block_ids")
    tail_arr = _int_array(tails, 2, "tails")
    plan = _plan(caches, pages_per_block)
    if plan.num_rows == 0:
        return
    items_b = np.zeros((blocks.shape[0], 3), dtype=np.int64)
    items_b[:, 1] = blocks[:, 0]
    items_t = np.zeros((tail_arr.shape[0], 3), dtype=np.int64)
    items_t[:, 1:] = tail_arr
    plan.check_items(items_b, "block_ids")
    plan.check_items(items_t, "tails")
    plan.zero(np.concatenate([items_b, items_t]), validate=False)
