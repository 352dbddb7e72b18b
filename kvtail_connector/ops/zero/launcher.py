"""Launch mechanics of ``zero_kv_slots_kernel``: compile once, launch cheaply.

The kernel is persistent and reads its sizes from the work buffer, so every
launch on a device has the same arguments but the buffer: one compiled
binary serves all of them, and a CUDA graph of (copy the work buffer in,
launch) replays any work that fits the graph's buffer for a few µs of host
time. Larger work goes through pinned staging and a direct launch.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvtail_connector.ops.staging import GraphSlots, PinnedStaging
from kvtail_connector.ops.zero.plan import Line, fill_line_work, fill_packed_work, line_work
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


def _launch_jit_with(grid: int, work: Any, rows: torch.Tensor) -> None:
    launch_jit(grid, _as_tensor(work), rows)


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
    fresh 16-byte-aligned allocations, so one binary serves every launch.
    Falls back to the JIT path when this Triton version's compiled-kernel
    launcher takes different arguments.
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

    def __call__(self, grid: int, work: Any, rows: torch.Tensor) -> None:
        if self._fast is None:
            launch_jit(grid, _as_tensor(work), rows)
            return
        self._runner(grid)(work, rows, *self._constexprs)

    def bound(self, grid: int, work: Any, rows: torch.Tensor) -> Callable[[], None]:
        """``functools.partial(self, grid, work, rows)``, one call shorter: a
        launch made ready ahead, for work launched later (per layer)."""
        if self._fast is None:
            return functools.partial(launch_jit, grid, _as_tensor(work), rows)
        return functools.partial(self._runner(grid), work, rows, *self._constexprs)

    def _runner(self, grid: int) -> Any:
        runner = self._runners.get(grid)
        if runner is None:
            runner = self._runners[grid] = self._fast[(grid, 1, 1)]
        return runner


class KernelLauncher:
    """Launches the zeroing kernel over one row table on one device.

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
        self._staged_done: torch.cuda.Event | None = None

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
                    lambda work: compiled(self.programs, work, self.rows),
                )
            except RuntimeError as e:  # capture refused (e.g. another capture running)
                logger.warning(
                    "kvtail: CUDA graph capture of the zeroing launch failed (%s); "
                    "launching directly instead (a few µs more host time per launch)",
                    e,
                )
                self._use_graphs = False
        torch.cuda.current_stream().synchronize()

    def stage(self, work: np.ndarray) -> torch.Tensor:
        """The work buffer on the device, ordered on the current stream."""
        if self._staging is None:
            return torch.from_numpy(work).to(self.device)
        return self._staging.to_device(work)

    def launch_staged(self, work: Any, units: int, *, record_event: bool = True) -> None:
        """Launch over an already staged work buffer of ``units`` work units.

        ``record_event=False`` leaves :attr:`last_done` behind this launch until
        :meth:`record_done` (a series of launches pays for one event)."""
        grid = max(1, min(units, self.programs))
        if self.device.type != "cuda":
            launch_jit(grid, work, self.rows)
            return
        if self._compiled is None:
            self._compiled = _Compiled(_as_tensor(work), self.rows)
        self._compiled(grid, work, self.rows)
        if record_event:
            self.record_done()

    def bound_staged(self, work: Any, units: int) -> Callable[[], None]:
        """:meth:`launch_staged` of ``work`` made ready, to be called later
        (several times if need be) without recording an event: the caller
        calls :meth:`record_done` after the last launch of a series."""
        grid = max(1, min(units, self.programs))
        if self.device.type != "cuda":
            return functools.partial(launch_jit, grid, work, self.rows)
        if self._compiled is None:
            self._compiled = _Compiled(_as_tensor(work), self.rows)
        return self._compiled.bound(grid, work, self.rows)

    def launch_with(self, units: int) -> Callable[[Any, torch.Tensor], None]:
        """``f(work, rows)``: a launch over ``units`` work units with a row
        table of the caller's (each layer its own, all sharing one work
        buffer), no event recorded (see :meth:`record_done`). ``rows`` must
        be an allocation of its own (16-byte aligned, as compiled)."""
        grid = max(1, min(units, self.programs))
        compiled = self._compiled
        if self.device.type != "cuda" or compiled is None or not compiled.fast:
            return functools.partial(_launch_jit_with, grid)
        runner, constexprs = compiled._runner(grid), compiled._constexprs
        return lambda work, rows: runner(work, rows, *constexprs)

    def record_done(self) -> None:
        """Record :attr:`last_done` behind everything launched so far (CUDA)."""
        if self.device.type != "cuda":
            return
        if self._staged_done is None:
            self._staged_done = torch.cuda.Event()
        self._staged_done.record()
        self.last_done = self._staged_done

    def run_lines(self, lines: Sequence[Line]) -> None:
        """Zero ``lines``: written straight into a graph slot's buffer and
        replayed where they fit, else staged and launched."""
        if self._use_graphs and self._graphs is None:
            self.warmup()
        graphs = self._graphs
        if graphs is not None and HEADER_WORDS + ITEM_COLS * len(lines) <= graphs.entries:
            fill_line_work(graphs.next_buffer(), lines)
            self.last_done = graphs.replay()
            return
        work, units = line_work(lines)
        self.launch_staged(self.stage(work), units)

    def run_packed(self, packed: bytes, n_tail: int, rows: int, chunks: int) -> None:
        """Zero ``n_tail`` packed tail lines (``plan.fill_packed_work``): written
        straight into a graph slot's buffer and replayed where they fit, else
        staged and launched."""
        if self._use_graphs and self._graphs is None:
            self.warmup()
        graphs = self._graphs
        if graphs is not None and HEADER_WORDS + ITEM_COLS * n_tail <= graphs.entries:
            fill_packed_work(graphs.next_bytes(), packed, n_tail, rows, chunks)
            self.last_done = graphs.replay()
            return
        work = np.empty(HEADER_WORDS + ITEM_COLS * n_tail, dtype=np.int64)
        units = fill_packed_work(work.data.cast("B"), packed, n_tail, rows, chunks)
        self.launch_staged(self.stage(work), units)

    def run(self, work: np.ndarray, units: int) -> None:
        """Zero what ``work`` describes: a graph replay if it fits, else stage + launch."""
        if self._use_graphs and self._graphs is None:
            self.warmup()
        if self._graphs is not None and work.size <= self._graphs.entries:
            self.last_done = self._graphs.run(work)
            return
        self.launch_staged(self.stage(work), units)
