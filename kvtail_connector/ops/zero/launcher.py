"""Launch mechanics of ``zero_kv_slots_kernel``: compile once, launch cheaply.

The kernel is persistent and reads its sizes from the work buffer, so every
launch on a device has the same arguments but the two tables: one compiled
binary serves all of them, and a CUDA graph of (copy the work buffer in,
launch) replays any work that fits the graph's buffer for a few µs of host
time. Larger work goes through pinned staging and a direct launch.

:class:`KernelLauncher` has two ways to launch: :meth:`~KernelLauncher.run`
zeroes a host work buffer now; :meth:`~KernelLauncher.prepared` makes a
launch over a work buffer already on the device ready for later (a layer's
READ tails, launched when the layer lands).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvtail_connector.ops.staging import GraphSlots, PinnedStaging
from kvtail_connector.ops.zero.work_schema import HEADER_WORDS, ITEM_COLS, kernel_columns

# ops must not import vLLM: a plain logger (vLLM's handler sees it when the
# wrapper runs, through the ``vllm`` parent set in kvtail_connector.log).
logger = logging.getLogger("vllm.kvtail.ops")

# Units (int32 words or bytes) one work unit stores; one program per unit step.
BLOCK = 2048
NUM_WARPS = 4
# Persistent grid: programs per multiprocessor (benchmarks/kernel_variants.py:
# 16 beat 4 and 8 on tails; all tie on whole blocks).
PROGRAMS_PER_SM = 16
# Items a CUDA graph slot holds; larger work takes the staged launch.
GRAPH_ITEMS = 256
# The tables' layout, handed to the kernel as constexprs (ops/zero/work_schema.py).
COLUMNS = kernel_columns()
# Programs for the interpreter: each one loops in Python, so few and busy.
_INTERPRETER_PROGRAMS = 4


def kernel() -> Any:
    from kvtail_connector.ops.zero.kernel import zero_kv_slots_kernel

    return zero_kv_slots_kernel


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def num_programs(device: torch.device) -> int:
    """Size of the persistent grid on ``device``."""
    if device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index) * PROGRAMS_PER_SM


class _WorkAt:
    """A work buffer at an offset into a staged one, for the compiled CUDA
    launcher, which only reads ``data_ptr()`` (a torch view costs ~2 µs)."""

    __slots__ = ("_base", "_bytes")
    dtype = torch.int64

    def __init__(self, base: torch.Tensor, offset: int) -> None:
        self._base, self._bytes = base, offset * base.element_size()

    def data_ptr(self) -> int:
        return self._base.data_ptr() + self._bytes

    def tensor(self) -> torch.Tensor:
        return self._base[self._bytes // self._base.element_size() :]


def _as_tensor(work: Any) -> torch.Tensor:
    return work.tensor() if isinstance(work, _WorkAt) else work


def work_at(base: torch.Tensor, offset: int) -> Any:
    """``base[offset:]`` as the kernel's work argument (int64 elements)."""
    if base.device.type == "cuda":
        return _WorkAt(base, offset)
    return base[offset:]  # the interpreter reads real tensors


def launch_jit(grid: int, work: torch.Tensor, rows: torch.Tensor) -> None:
    kernel()[(grid,)](work, rows, BLOCK=BLOCK, num_warps=NUM_WARPS, **COLUMNS)


def constexpr_args() -> list[int]:
    """The kernel's constexpr arguments in signature order (after the two
    tables), as the compiled kernel's launcher takes them: positionally."""
    values = {"BLOCK": BLOCK, **COLUMNS}
    return [values[name] for name in kernel().arg_names[2:]]


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
    if dev.type != "cuda" and not interpreting():
        return
    empty = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=dev)
    launch_jit(1, empty, empty)


class _Compiled:
    """The kernel compiled for one device, launched without re-binding arguments.

    ``JITFunction.__getitem__`` re-derives the specialization key on every
    launch (~10 µs of host time); the work buffer and row table are always
    16-byte-aligned allocations, so one binary serves every launch. Falls
    back to the JIT path when this Triton version's compiled-kernel launcher
    takes different arguments.
    """

    def __init__(self, work: torch.Tensor, rows: torch.Tensor) -> None:
        compiled = kernel().warmup(
            work, rows, BLOCK=BLOCK, num_warps=NUM_WARPS, grid=(1,), **COLUMNS
        )
        self._constexprs = constexpr_args()
        # grid -> the compiled kernel's launcher for it: indexing builds one
        # (~1-2 µs) that reads the current stream at each call, so it is kept.
        self._runners: dict[int, Any] = {}
        self._fast: Any = None
        try:
            compiled[(1, 1, 1)](work, rows, *self._constexprs)
            self._fast = compiled
        except Exception:  # noqa: BLE001 - any launcher mismatch means: use the JIT path
            self._fast = None

    @property
    def fast(self) -> bool:
        return self._fast is not None

    def bound(self, grid: int, work: Any, rows: torch.Tensor) -> Callable[[], None]:
        """The launch of ``grid`` programs over ``work`` and ``rows``, ready to call."""
        if self._fast is None:
            return functools.partial(launch_jit, grid, _as_tensor(work), rows)
        runner = self._runners.get(grid)
        if runner is None:
            runner = self._runners[grid] = self._fast[(grid, 1, 1)]
        return functools.partial(runner, work, rows, *self._constexprs)


class KernelLauncher:
    """Launches the zeroing kernel on one device, over its row table.

    Args:
        device: where the caches (and the row table) live.
        rows: int64 ``[n_rows, ROW_COLS]`` row table on ``device``.
        use_graphs: replay small work from CUDA graphs (CUDA only).
    """

    def __init__(self, device: torch.device, rows: torch.Tensor, *, use_graphs: bool) -> None:
        self.device = device
        self.rows = rows
        self.programs = num_programs(device)
        self._use_graphs = use_graphs and device.type == "cuda"
        self._compiled: _Compiled | None = None
        self._graphs: GraphSlots | None = None
        self._staging = PinnedStaging(device) if device.type == "cuda" else None
        # Recorded behind the latest launch (CUDA): what a fence waits for.
        self.last_done: torch.cuda.Event | None = None
        self._done: torch.cuda.Event | None = None

    @property
    def uses_graphs(self) -> bool:
        return self._graphs is not None

    def warmup(self) -> None:
        """Compile the kernel (and capture the graphs) touching no cache byte."""
        empty = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=self.device)
        if self.device.type != "cuda":
            launch_jit(1, empty, self.rows)
            return
        if self._compiled is None:
            self._compiled = _Compiled(empty, self.rows)
        if self._use_graphs and self._graphs is None:
            compiled = self._compiled
            try:
                self._graphs = GraphSlots(
                    self.device,
                    HEADER_WORDS + GRAPH_ITEMS * ITEM_COLS,
                    lambda work: compiled.bound(self.programs, work, self.rows)(),
                )
            except RuntimeError as e:  # capture refused (e.g. another capture running)
                logger.warning(
                    "kvtail: CUDA graph capture of the zeroing launch failed (%s); "
                    "launching directly instead (a few µs more host time per launch)",
                    e,
                )
                self._use_graphs = False
        torch.cuda.current_stream().synchronize()

    def run(self, work: bytes, units: int) -> None:
        """Zero what ``work`` (a packed work buffer of ``units`` work units)
        describes: written into a graph slot's buffer and replayed where it
        fits, else staged and launched; :attr:`last_done` recorded behind."""
        if self._use_graphs and self._graphs is None:
            self.warmup()
        graphs = self._graphs
        if graphs is not None and len(work) <= graphs.entries * 8:
            # The slot's buffer keeps older lines past these: the header
            # counts only these.
            graphs.next_bytes()[: len(work)] = work
            self.last_done = graphs.replay()
            return
        self.prepared(self.stage(work), units, self.rows)()
        self.record_done()

    def stage(self, work: bytes) -> torch.Tensor:
        """The work buffer on the device (a fresh, aligned allocation),
        ordered on the current stream."""
        table = np.frombuffer(work, dtype=np.int64)
        if self._staging is None:
            return torch.from_numpy(table.copy()).to(self.device)
        return self._staging.to_device(table)

    def prepared(self, work: Any, units: int, rows: torch.Tensor) -> Callable[[], None]:
        """A launch over ``units`` work units of ``work``, already on the
        device (:meth:`stage`, or :func:`work_at` an offset into it), with
        row table ``rows`` (this launcher's, or a 16-byte-aligned one of the
        caller's), ready to be called later, several times if need be. It
        records no event: call :meth:`record_done` after the last launch of
        a series."""
        grid = max(1, min(units, self.programs))
        if self.device.type != "cuda":
            return functools.partial(launch_jit, grid, work, rows)
        if self._compiled is None:
            self._compiled = _Compiled(_as_tensor(work), rows)
        return self._compiled.bound(grid, work, rows)

    def record_done(self) -> None:
        """Record :attr:`last_done` behind everything launched so far (CUDA)."""
        if self.device.type != "cuda":
            return
        if self._done is None:
            self._done = torch.cuda.Event()
        self._done.record()
        self.last_done = self._done
