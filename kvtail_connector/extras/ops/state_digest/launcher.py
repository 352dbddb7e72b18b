"""Digests requests' state blocks: :class:`StateDigester` (``mix64-state-1``).

On CUDA one call is: the output zeroed on the device, one small table of
(request, group) rows staged through pinned memory (non-blocking), and ONE
kernel launch for every request, group, layer and state; nothing waits for
the device (the producer hook calls it right behind the forward). The
per-(layer, state) work is a table of state chunks built once, on the
device, at construction. Memory per call: the ``[requests, groups]`` output
and the row table. On CPU caches the kernel runs under ``TRITON_INTERPRET=1``
and otherwise the torch path (``torch_path.py``) computes the same sums.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from kvtail_connector.extras.ops.state_digest import torch_path
from kvtail_connector.extras.ops.state_digest.reference import signed, state_plane
from kvtail_connector.ops.staging import PinnedStaging

Implementation = Literal["auto", "triton", "torch"]

# Table layouts (must match kernel.py).
ROW_COLS = 4
UNIT_COLS = 8
MODE_BYTES, MODE_WORDS, MODE_VECTORS = 0, 1, 2
# Words of one state chunk (one program's unit of work: 32 KiB) and of one
# tile (4 warps: 8 words per thread). A GDN recurrent state (512 KiB at TP 4)
# is 16 chunks, so even one request spreads over the GPU.
CHUNK_WORDS = 8192
TILE_WORDS = 1024
NUM_WARPS = 4
PROGRAMS_PER_SM = 8
_INTERPRETER_PROGRAMS = 2


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _kernel() -> Any:
    from kvtail_connector.extras.ops.state_digest.kernel import state_digest_kernel

    return state_digest_kernel


@dataclass(frozen=True)
class StateLayer:
    """One layer's state pages.

    Attributes:
        pages: ``[num_blocks, page_bytes]`` uint8 view (bytes contiguous):
            block ``b``'s page.
        states: ``(offset, nbytes)`` of each state in a page, in spec order.
    """

    pages: torch.Tensor
    states: tuple[tuple[int, int], ...]


class StateDigester:
    """Digests requests' state blocks over the state groups of one rank.

    Args:
        groups: per state group, ``(group id, its layers in layer order)``.
        shard: this rank's TP rank (``r`` of the definition).
        implementation: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``),
            ``"torch"``, or ``"auto"``: Triton where it can run, torch otherwise.
        chunk_words, tile_words: the kernel's work split (tests, benchmarks):
            words per unit of work (a multiple of 4) and per tile (a power of two).

    Raises:
        ValueError: a state that does not fit its page, pages that are not a
            ``[blocks, bytes]`` uint8 view, layers on several devices, or a bad option.
    """

    def __init__(
        self,
        groups: Sequence[tuple[int, Sequence[StateLayer]]],
        shard: int,
        *,
        implementation: Implementation = "auto",
        chunk_words: int = CHUNK_WORDS,
        tile_words: int = TILE_WORDS,
    ) -> None:
        self.group_ids = tuple(g for g, _ in groups)
        self._layers = [list(layers) for _, layers in groups]
        devices = {layer.pages.device for layers in self._layers for layer in layers}
        if len(devices) > 1:
            raise ValueError(f"state pages on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        for layers in self._layers:
            for layer in layers:
                pages = layer.pages
                if pages.dim() != 2 or pages.dtype != torch.uint8 or pages.stride(1) != 1:
                    raise ValueError(
                        "StateLayer.pages: expected a [blocks, bytes] uint8 view, bytes contiguous"
                    )
                for offset, nbytes in layer.states:
                    if offset < 0 or nbytes <= 0 or offset + nbytes > pages.shape[1]:
                        raise ValueError(
                            f"state at byte {offset} of {nbytes} bytes does not fit a "
                            f"{pages.shape[1]}-byte page"
                        )
        # Blocks a group's block ids must stay under (every layer has them).
        self._num_blocks = [
            min((int(layer.pages.shape[0]) for layer in layers), default=0)
            for layers in self._layers
        ]
        # Planes per (group, layer, state), as int64 bit patterns.
        self._planes = [
            [
                [signed(state_plane(g, li, si, shard)) for si in range(len(layer.states))]
                for li, layer in enumerate(layers)
            ]
            for g, layers in zip(self.group_ids, self._layers, strict=True)
        ]
        if implementation == "auto":
            runs = self.device.type == "cuda" or _interpreting()
            implementation = "triton" if runs and _triton_installed() else "torch"
        if implementation not in ("triton", "torch"):
            raise ValueError(
                f"implementation: expected 'auto', 'triton' or 'torch', got {implementation!r}"
            )
        if implementation == "triton" and self.device.type != "cuda" and not _interpreting():
            raise ValueError(
                "implementation: 'triton' needs CUDA pages, or TRITON_INTERPRET=1 for CPU pages"
            )
        if chunk_words <= 0 or chunk_words % 4:
            raise ValueError(f"chunk_words: expected a positive multiple of 4, got {chunk_words}")
        if tile_words <= 0 or tile_words & (tile_words - 1):
            raise ValueError(f"tile_words: expected a power of two, got {tile_words}")
        self.implementation: Implementation = implementation
        self._tile = tile_words
        self._units: torch.Tensor | None = None
        self._group_units: list[tuple[int, int]] = []  # (first unit, count) per group
        self._staging: PinnedStaging | None = None
        self._programs = _INTERPRETER_PROGRAMS
        if implementation == "triton":
            table = self._unit_table(chunk_words)
            self._max_units = max((n for _, n in self._group_units), default=0)
            self._units = torch.from_numpy(table).to(self.device)
            if self.device.type == "cuda":
                self._staging = PinnedStaging(self.device)
                index = self.device.index if self.device.index is not None else 0
                self._programs = _sm_count(index) * PROGRAMS_PER_SM

    def _unit_table(self, chunk_words: int) -> np.ndarray:
        """int64 ``[units, UNIT_COLS]``: each group's state chunks, group by group."""
        units: list[list[int]] = []
        for layers, planes in zip(self._layers, self._planes, strict=True):
            first = len(units)
            for layer, layer_planes in zip(layers, planes, strict=True):
                base, stride = layer.pages.data_ptr(), int(layer.pages.stride(0))
                for (offset, nbytes), plane in zip(layer.states, layer_planes, strict=True):
                    addr = base + offset
                    if (addr | stride) % 16 == 0:
                        mode = MODE_VECTORS
                    elif (addr | stride) % 4 == 0:
                        mode = MODE_WORDS
                    else:
                        mode = MODE_BYTES
                    words = -(-nbytes // 4)
                    for lo in range(0, words, chunk_words):
                        hi = min(lo + chunk_words, words)
                        units.append([addr, stride, lo, hi, nbytes, plane, mode, 0])
            self._group_units.append((first, len(units) - first))
        return np.array(units, dtype=np.int64).reshape(-1, UNIT_COLS)

    def digest(self, blocks: Sequence[Sequence[int | None]]) -> torch.Tensor:
        """Per request (row) and group (column): the sum, int64 bit patterns,
        on the pages' device, enqueued on the current stream (on CUDA without
        waiting for the device). ``blocks[i][j]``: request ``i``'s state
        block in group ``j``, or None (its cell is 0).

        Raises:
            ValueError: a block id outside its group's pages (nothing launched).
        """
        n_groups = len(self.group_ids)
        for i, per in enumerate(blocks):
            if len(per) != n_groups:
                raise ValueError(f"blocks[{i}]: expected {n_groups} entries, got {len(per)}")
            for j, block in enumerate(per):
                if block is not None and not 0 <= block < self._num_blocks[j]:
                    raise ValueError(
                        f"blocks[{i}][{j}]: block {block} outside the group's "
                        f"{self._num_blocks[j]} blocks"
                    )
        if self.implementation == "torch":
            layers = [[(layer.pages, layer.states) for layer in group] for group in self._layers]
            return torch_path.digest(layers, self._planes, blocks, self.device)
        out = torch.zeros((len(blocks), n_groups), dtype=torch.int64, device=self.device)
        rows = [
            (block, i * n_groups + j, *self._group_units[j])
            for i, per in enumerate(blocks)
            for j, block in enumerate(per)
            if block is not None and self._group_units[j][1]
        ]
        if not rows:
            return out
        table = np.array(rows, dtype=np.int64)
        if self._staging is not None:
            staged = self._staging.to_device(table)
        else:
            staged = torch.from_numpy(table)
        per_row = max(1, min(self._max_units, -(-self._programs // len(rows))))
        _kernel()[(len(rows), per_row)](
            staged, self._units, out, BLOCK=self._tile, num_warps=NUM_WARPS
        )
        return out
