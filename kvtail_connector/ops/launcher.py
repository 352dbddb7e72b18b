"""Validate and launch KV zeroing: one Triton launch on CUDA, torch elsewhere.

:class:`KVZeroer` holds the per-cache row table of one or more cache groups
(built once) and zeroes whole blocks and tails of all of them in one launch.
:func:`zero_kv_blocks` is the engine-agnostic one-group entry point.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from kvtail_connector.ops import torch_path
from kvtail_connector.ops.geometry import (
    CacheGeometry,
    RegionCache,
    Row,
    describe_caches,
)

CacheLike = torch.Tensor | RegionCache
Backend = Literal["auto", "triton", "torch"]

# Units (int32 words or bytes) one program stores per loop iteration.
BLOCK = 1024
NUM_WARPS = 4
# Grid bounds: every axis loops, so these only cap the launch size.
_MAX_ITEMS_AXIS = 2**31 - 1
_MAX_ROWS_AXIS = 65535
_MAX_CHUNKS_AXIS = 1024
_MAX_PROGRAMS = 2**26
# Pinned staging buffers kept per zeroer; more only while launches are in flight.
_RING_SIZE = 4


def _kernel() -> Any:
    from kvtail_connector.ops.kernels.zero_kv import zero_kv_slots_kernel

    return zero_kv_slots_kernel


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class _PinnedStaging:
    """Host-to-device staging of item tables without per-call pinned allocations.

    A buffer is reused only after the copy that last read it has completed
    (its event has fired), so an in-flight launch never sees its items change.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._slots: list[tuple[torch.Tensor, torch.cuda.Event]] = []

    def _buffer(self, n: int) -> tuple[int, torch.Tensor, torch.cuda.Event]:
        for i, (buf, event) in enumerate(self._slots):
            if buf.numel() >= n and event.query():
                return i, buf, event
        capacity = max(256, 1 << (n - 1).bit_length())
        buf = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        event = torch.cuda.Event()
        if len(self._slots) < _RING_SIZE:
            self._slots.append((buf, event))
            return len(self._slots) - 1, buf, event
        # Every slot is busy or too small: replace the oldest once it is idle.
        old_buf, old_event = self._slots[0]
        old_event.synchronize()
        if old_buf.numel() >= n:
            buf = old_buf
        self._slots.pop(0)
        self._slots.append((buf, old_event))
        return len(self._slots) - 1, buf, old_event

    def to_device(self, items: np.ndarray) -> torch.Tensor:
        flat = items.reshape(-1)
        _, buf, event = self._buffer(flat.size)
        host = buf[: flat.size]
        host.numpy()[:] = flat
        out = torch.empty(items.shape, dtype=torch.int64, device=self._device)
        out.view(-1).copy_(host, non_blocking=True)
        event.record()
        return out


class KVZeroer:
    """Zero whole blocks and block tails across cache groups in one launch.

    Args:
        groups: per cache group, ``(caches, pages_per_block)``. ``caches`` are
            per-layer ``[B, H, N, C]`` views (any strides and dtype) or
            :class:`RegionCache` s; ``B = num_blocks * pages_per_block``.
            Groups may share tensors; each group reaches all of its caches.
        backend: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``),
            ``"torch"``, or ``"auto"``: Triton on CUDA, torch otherwise.

    Raises:
        ValueError: for invalid caches, naming the argument.
    """

    def __init__(
        self,
        groups: Sequence[tuple[Sequence[CacheLike], int]],
        *,
        backend: Backend = "auto",
    ) -> None:
        self._geoms: list[list[CacheGeometry]] = []
        self._pages: list[int] = []
        self._num_blocks: list[int] = []
        self._max_first: list[int] = []
        self._any_slots: list[int] = []
        row_lists: list[list[Row]] = []
        devices: set[torch.device] = set()
        for caches, pages_per_block in groups:
            geoms = describe_caches(caches, pages_per_block)
            devices.update(g.tensor.device for g in geoms)
            self._geoms.append(geoms)
            self._pages.append(pages_per_block)
            per_block = [g.slots_per_page * pages_per_block for g in geoms]
            self._num_blocks.append(min((g.num_pages // pages_per_block for g in geoms), default=0))
            # A first slot may reach the smallest block; past the largest one,
            # nothing is left to zero in any cache.
            self._max_first.append(min(per_block, default=0))
            self._any_slots.append(max(per_block, default=0))
            rows = list(dict.fromkeys(r for g in geoms for r in g.rows(pages_per_block)))
            row_lists.append(rows)
        if len(devices) > 1:
            raise ValueError(
                f"caches: all caches must be on one device, got {sorted(map(str, devices))}"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        if backend == "triton" and self.device.type != "cuda" and not _interpreting():
            raise ValueError(
                "backend: 'triton' needs CUDA caches, or TRITON_INTERPRET=1 for CPU caches"
            )
        if backend not in ("triton", "torch"):
            raise ValueError(f"backend: expected 'auto', 'triton' or 'torch', got {backend!r}")
        self.backend: Backend = backend
        self._row_start: np.ndarray = np.zeros(len(row_lists), dtype=np.int64)
        self._row_count = np.array([len(r) for r in row_lists], dtype=np.int64)
        if len(row_lists):
            self._row_start[1:] = np.cumsum(self._row_count)[:-1]
        all_rows = [r for rows in row_lists for r in rows]
        self.num_rows = len(all_rows)
        self._max_span = np.array(
            [
                max((r.n_slots * r.run // (4 if r.word_aligned else 1) for r in rows), default=0)
                for rows in row_lists
            ],
            dtype=np.int64,
        )
        self._rows_dev: torch.Tensor | None = None
        self._staging: _PinnedStaging | None = None
        if self.backend == "triton":
            table = np.zeros((max(self.num_rows, 1), 8), dtype=np.int64)
            for i, r in enumerate(all_rows):
                unit = 4 if r.word_aligned else 1
                table[i] = (
                    r.base,
                    r.block_stride,
                    r.slot_stride // unit,
                    r.run // unit,
                    r.n_slots,
                    r.first_slot,
                    unit,
                    0,
                )
            self._rows_dev = torch.from_numpy(table).to(self.device)
            if self.device.type == "cuda":
                self._staging = _PinnedStaging(self.device)

    @property
    def num_groups(self) -> int:
        return len(self._geoms)

    def num_blocks(self, group: int) -> int:
        return self._num_blocks[group]

    def slots_per_block(self, group: int) -> int:
        """``P * N`` of the group (its smallest cache's, if they differ)."""
        return self._max_first[group]

    # ------------------------------------------------------------------ input

    def check_items(self, items: np.ndarray, name: str = "items") -> None:
        """Raise ValueError naming ``name`` unless every (group, block, first) is valid."""
        if items.ndim != 2 or items.shape[1] != 3:
            raise ValueError(f"{name}: expected (group, block, first slot) triples")
        if items.shape[0] == 0:
            return
        groups, blocks, firsts = items[:, 0], items[:, 1], items[:, 2]
        if groups.min() < 0 or groups.max() >= self.num_groups:
            raise ValueError(f"{name}: group out of range [0, {self.num_groups})")
        nb = np.asarray(self._num_blocks, dtype=np.int64)[groups]
        bad = (blocks < 0) | (blocks >= nb)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{name}: block id {int(blocks[i])} out of range [0, {int(nb[i])})")
        limit = np.asarray(self._max_first, dtype=np.int64)[groups]
        bad = (firsts < 0) | (firsts > limit)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"{name}: first slot {int(firsts[i])} out of range [0, {int(limit[i])}] "
                f"(pages_per_block * slots per page)"
            )

    # ----------------------------------------------------------------- launch

    def zero(self, items: np.ndarray, *, validate: bool = True) -> int:
        """Zero slots ``[first, P*N)`` of each item's block in its group's caches.

        Args:
            items: int64 ``[n, 3]``: group, manager block id, first local slot
                to zero (0 zeroes the whole block).
            validate: check ranges first (skip only for pre-validated items).

        Returns:
            Items launched (0 means nothing was launched).
        """
        items = np.asarray(items, dtype=np.int64).reshape(-1, 3)
        if validate:
            self.check_items(items)
        if items.shape[0] == 0:
            return 0
        groups = items[:, 0]
        live = items[:, 2] < np.asarray(self._any_slots, dtype=np.int64)[groups]
        live &= self._row_count[groups] > 0
        if not live.all():
            items = items[live]
            groups = items[:, 0]
        n = int(items.shape[0])
        if n == 0:
            return 0
        if self.backend == "torch":
            for g in np.unique(groups):
                sel = items[groups == g]
                torch_path.zero_group(
                    self._geoms[int(g)], self._pages[int(g)], sel[:, 1], sel[:, 2]
                )
            return n
        table = np.empty((n, 4), dtype=np.int64)
        table[:, 0] = items[:, 1]
        table[:, 1] = items[:, 2]
        table[:, 2] = self._row_start[groups]
        table[:, 3] = self._row_count[groups]
        self._launch(table, int(self._row_count[groups].max()), int(self._max_span[groups].max()))
        return n

    def _launch(self, table: np.ndarray, max_rows: int, max_span: int) -> None:
        n = table.shape[0]
        if self._staging is not None:
            items_dev = self._staging.to_device(table)
        else:
            items_dev = torch.from_numpy(table).to(self.device)
        g1 = min(max_rows, _MAX_ROWS_AXIS)
        g2 = max(1, min(-(-max_span // BLOCK), _MAX_CHUNKS_AXIS))
        g0 = max(1, min(n, _MAX_ITEMS_AXIS, _MAX_PROGRAMS // (g1 * g2)))
        _kernel()[(g0, g1, g2)](items_dev, self._rows_dev, n, BLOCK=BLOCK, num_warps=NUM_WARPS)

    def warmup(self) -> None:
        """Compile the kernel this zeroer launches, touching no cache byte."""
        if self.backend != "triton":
            return
        dummy = torch.zeros((1, 4), dtype=torch.int64, device=self.device)
        rows = self._rows_dev
        _kernel()[(1, 1, 1)](dummy, rows, 0, BLOCK=BLOCK, num_warps=NUM_WARPS)


def warmup(device: torch.device | str | None = None) -> None:
    """Compile every Triton specialization :func:`zero_kv_blocks` can hit.

    The kernel's integer arguments are not specialized and its tables are
    always freshly allocated (16-byte aligned), so one compile per device
    covers every call. No-op without CUDA.
    """
    dev = torch.device(device) if device is not None else None
    if dev is None:
        if not torch.cuda.is_available():
            return
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda" and not _interpreting():
        return
    dummy = torch.zeros((1, 8), dtype=torch.int64, device=dev)
    _kernel()[(1, 1, 1)](dummy, dummy, 0, BLOCK=BLOCK, num_warps=NUM_WARPS)


# ------------------------------------------------------------------ public API

_PLANS: OrderedDict[tuple, KVZeroer] = OrderedDict()
_MAX_PLANS = 16


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
        plan = KVZeroer([(caches, pages_per_block)])
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
