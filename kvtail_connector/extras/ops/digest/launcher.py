"""KV digest of requests' valid slots: :class:`KVDigester` (its results: ``results.py``).

A digest is a per (group, global KV head, token segment) sum of the
``mix64-1`` terms of every 32-bit word of every valid slot (the definition:
``ops/digest/reference.py``). It is keyed by logical coordinates only, so a
producer and a consumer that place the same tokens in other blocks, block
sizes, page layouts or ranks get the same sums, and each consumer rank checks
the heads it holds.

On CUDA one call is one host-to-device copy (work table, zeroed output), ONE
kernel launch for all requests, groups, layers and heads, and one
non-blocking copy of the sums into pinned host memory followed by an event:
nothing waits for the device until :meth:`PendingDigest.result`. The host
work per request is O(1) in its length (its range, a slice of its block
table, one vectorized range check); the kernel derives every slot's block,
token and address. Elsewhere (CPU caches) a vectorized torch path computes
the same sums.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from kvtail_connector.extras.ops.digest import torch_path
from kvtail_connector.extras.ops.digest.compiled import CompiledLaunch
from kvtail_connector.extras.ops.digest.plan import (
    HEADER,
    MODE_VECTORS,
    DigestGroup,
    GroupRows,
    GroupSpan,
    KindPlan,
    Row,
    choose_chunk,
    group_rows,
    row_table,
    span_request,
    work_buffer,
)
from kvtail_connector.extras.ops.digest.reference import ALGORITHM
from kvtail_connector.extras.ops.digest.results import DigestLayout, PendingDigest
from kvtail_connector.ops.integers import as_int
from kvtail_connector.ops.staging import PinnedStaging

__all__ = [
    "ALGORITHM",
    "DEFAULT_SEGMENT",
    "DigestGroup",
    "GroupSpan",
    "KVDigester",
    "PendingDigest",
]

DEFAULT_SEGMENT = 1024
MIN_SEGMENT = 256
Implementation = Literal["auto", "triton", "torch"]
# Lanes of one tile; its (slots, words) shape is chosen per digester. 4 warps,
# 8 words per thread; a cap of 96 registers per thread beat 64 and no cap on
# both shapes of the H200 sweep (benchmarks/digest_variants.py, RESULTS.md §6:
# bf16 1.97 vs 1.36 TB/s, fp8 MLA 1.51 vs 0.87 TB/s).
TILE = 1024
NUM_WARPS = 4
MAX_REGISTERS = 96
PROGRAMS_PER_SM = 8
# Tokens of one work unit (with one row): None chooses per launch
# (plan.choose_chunk); a power of two <= the segment fixes it.
CHUNK_TOKENS: int | None = None
NUM_STAGES = 1
STREAM = False
# Where a tile's slots hold a whole block of every row (vector rows): the
# next tile's bytes are loaded while this one's are hashed.
PREFETCH = True
_INTERPRETER_PROGRAMS = 4
_TILE_WORDS = (256, 128, 64, 32, 16, 8)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def choose_tile(rows: Sequence[Any], tile: int = TILE) -> tuple[int, int]:
    """``(slots, words)`` of the kernel's tile (at most ``tile`` lanes, no
    larger than the rows need) that wastes the fewest lanes over ``rows`` (a
    full block's served slots times content words); ties go to the larger,
    then the wider tile (longer contiguous loads)."""
    if not rows:
        return 16, 128
    max_slots = _pow2_at_least(max(r.n_slots for r in rows))
    max_words = _pow2_at_least(max(r.n_words for r in rows))
    best: tuple[float, int, int, int] = (-1.0, 0, 1, 1)
    for words in _TILE_WORDS:
        words = min(words, max_words)
        slots = min(max(tile // words, 1), max_slots)
        used = padded = 0
        for r in rows:
            used += r.n_words * r.n_slots
            padded += -(-r.n_words // words) * words * (-(-r.n_slots // slots) * slots)
        score = (used / padded, slots * words, words, slots)
        if score > best:
            best = score
    return best[3], best[2]


class KVDigester:
    """Digests requests' valid slots over the KV cache groups of one rank.

    Args:
        groups: the rank's cache groups (see :class:`DigestGroup`).
        segment: tokens per segment, a power of two >= 256 (so a multiple of
            any block size <= 256).
        implementation: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``),
            ``"torch"``, or ``"auto"``: Triton on CUDA, torch otherwise.
        tile, num_warps, programs_per_sm, max_registers, chunk_tokens,
            num_stages, stream: launch tuning (benchmarks only); ``tile`` is
            a ``(slots, words)`` pair of powers of two; ``max_registers``
            caps ptxas (0: no cap); ``chunk_tokens`` (a power of two, at most
            ``segment``; None: chosen per launch) the tokens of one work
            unit; ``num_stages`` the
            software pipelining of the slot loop; ``stream`` loads cache
            bytes evict-first; ``prefetch`` loads a unit's next tile while
            hashing one (where a tile's slots hold a block of every row).

    Raises:
        ValueError: naming the field, for invalid groups or options.
    """

    def __init__(
        self,
        groups: Sequence[DigestGroup],
        *,
        segment: int = DEFAULT_SEGMENT,
        implementation: Implementation = "auto",
        tile: tuple[int, int] | None = None,
        num_warps: int | None = None,
        programs_per_sm: int = PROGRAMS_PER_SM,
        max_registers: int | None = None,
        chunk_tokens: int | None = CHUNK_TOKENS,
        num_stages: int = NUM_STAGES,
        stream: bool = STREAM,
        prefetch: bool = PREFETCH,
    ) -> None:
        if isinstance(groups, DigestGroup):
            raise ValueError("groups: expected a sequence of DigestGroup, got a single one")
        segment = as_int("segment", segment)
        if segment < MIN_SEGMENT or segment & (segment - 1):
            raise ValueError(f"segment: must be a power of two >= {MIN_SEGMENT}, got {segment}")
        self.segment = segment
        if chunk_tokens is not None:
            chunk_tokens = as_int("chunk_tokens", chunk_tokens, minimum=1)
            if chunk_tokens & (chunk_tokens - 1) or chunk_tokens > segment:
                raise ValueError(
                    f"chunk_tokens: must be a power of two <= segment ({segment}) or None, "
                    f"got {chunk_tokens}"
                )
        self.chunk_tokens = chunk_tokens
        self.num_stages = as_int("num_stages", num_stages, minimum=1)
        self.stream = bool(stream)
        self.algorithm = ALGORITHM
        self._groups: list[GroupRows] = [group_rows(g, i) for i, g in enumerate(groups)]
        ids = [g.group_id for g in self._groups]
        if len(set(ids)) != len(ids):
            raise ValueError(f"groups: group ids must be distinct, got {ids}")
        devices = {r.tensor.device for g in self._groups for r in g.rows}
        devices |= {c.device for g in groups for c in _tensors(g.caches)}
        if len(devices) > 1:
            raise ValueError(
                f"groups: all caches must be on one device, got {sorted(map(str, devices))}"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        if implementation == "auto":
            implementation = "triton" if self.device.type == "cuda" else "torch"
        if implementation not in ("triton", "torch"):
            raise ValueError(
                f"implementation: expected 'auto', 'triton' or 'torch', got {implementation!r}"
            )
        if implementation == "triton" and self.device.type != "cuda" and not _interpreting():
            raise ValueError(
                "implementation: 'triton' needs CUDA caches, or TRITON_INTERPRET=1 for CPU caches"
            )
        self.implementation: Implementation = implementation
        self._row_start: list[int] = []
        all_rows: list[Row] = []
        for g in self._groups:
            self._row_start.append(len(all_rows))
            all_rows.extend(g.rows)
        self.tile = tile if tile is not None else choose_tile(all_rows)
        # Compile only the load paths and the DCP mapping some row needs.
        self._any_mode = any(r.mode != MODE_VECTORS for r in all_rows)
        self._dcp_split = any(g.dcp[1] > 1 and g.dcp[2] > 1 for g in self._groups)
        self._whole_slots = all(r.n_words <= self.tile[1] for r in all_rows)
        self.prefetch = (
            bool(prefetch)
            and not self._any_mode
            and all(r.n_slots <= self.tile[0] for r in all_rows)
        )
        lanes = self.tile[0] * self.tile[1]
        self.num_warps = num_warps or max(1, min(NUM_WARPS, lanes // 256))
        # The general load paths need more registers than the cap allows.
        if max_registers is None:
            max_registers = 0 if self._any_mode else MAX_REGISTERS
        self._launch_options = {"maxnreg": max_registers} if max_registers else {}
        self._programs = _INTERPRETER_PROGRAMS
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else 0
            self._programs = _sm_count(index) * programs_per_sm
        self._rows: torch.Tensor | None = None
        self._staging: PinnedStaging | None = None
        self._compiled: CompiledLaunch | None = None
        if implementation == "triton":
            self._rows = torch.from_numpy(row_table(all_rows)).to(self.device)
            if self.device.type == "cuda":
                self._staging = PinnedStaging(self.device)

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def heads(self, group: int) -> tuple[int, ...]:
        """Global KV heads of group ``group`` this rank counts."""
        return self._groups[group].heads

    def warmup(self) -> None:
        """Compile the kernel for this digester (no cache byte is read)."""
        if self.implementation == "triton":
            work = np.zeros(HEADER, dtype=np.int64)  # no kinds, no units
            work[2] = HEADER
            self._launch(torch.from_numpy(work).to(self.device), 0)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()

    def digest(self, requests: Sequence[Sequence[GroupSpan | None]]) -> PendingDigest:
        """Digest the spans of ``requests`` (per request, per group: a
        :class:`GroupSpan`, or None to skip the group), in one launch.

        Enqueued on the current stream; returns without waiting for it.

        Raises:
            ValueError: naming ``requests[i][g]``: a bad range or block id.
        """
        layout, kinds, n_cells, row_tokens = self._plan(requests)
        if self.implementation == "torch":
            cells = torch.zeros(n_cells, dtype=torch.int64, device=self.device)
            for kind in kinds:
                slots = torch_path.expand_requests(kind, self.segment)
                torch_path.digest_rows(kind.group.rows, slots, cells)
            return PendingDigest(cells.cpu(), None, layout, launched=False)
        chunk = self.chunk_tokens or choose_chunk(row_tokens, self._programs, self.segment)
        work, units, out_offset = work_buffer(kinds, n_cells, self.segment, chunk)
        if units == 0:
            return PendingDigest(torch.zeros(n_cells, dtype=torch.int64), None, layout, False)
        if self._staging is not None:
            staged = self._staging.to_device(work)
        else:
            staged = torch.from_numpy(work)
        self._launch(staged, units)
        out = staged[out_offset:]
        if self.device.type != "cuda":
            return PendingDigest(out.clone(), None, layout, launched=True)
        host = torch.empty(n_cells, dtype=torch.int64, pin_memory=True)
        host.copy_(out, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingDigest(host, event, layout, launched=True)

    def _plan(
        self, requests: Sequence[Sequence[GroupSpan | None]]
    ) -> tuple[DigestLayout, list[KindPlan], int, int]:
        """Per request and group: a range, a table slice, where its cells are;
        and the launch's tokens times rows."""
        if isinstance(requests, GroupSpan) or not isinstance(requests, Sequence):
            raise ValueError("requests: expected a sequence (per request) of per-group spans")
        groups = self._groups
        kinds = [
            KindPlan(g, first, [], []) for g, first in zip(groups, self._row_start, strict=True)
        ]
        spans: list[list[tuple[int, int, tuple[int, ...]] | None]] = []
        n_cells = 0
        segment = self.segment
        row_tokens = 0
        for q, request in enumerate(requests):
            if not isinstance(request, Sequence) or len(request) != len(groups):
                raise ValueError(
                    f"requests[{q}]: expected one GroupSpan or None per group ({len(groups)})"
                )
            row: list[tuple[int, int, tuple[int, ...]] | None] = []
            for g, span in enumerate(request):
                if span is None:
                    row.append(None)
                    continue
                if not isinstance(span, GroupSpan):
                    raise ValueError(f"requests[{q}][{g}]: expected a GroupSpan or None")
                group = groups[g]
                table, (start, end, first_block, n_seg) = span_request(
                    group, span, segment, f"requests[{q}][{g}]"
                )
                row.append((n_cells, n_seg, group.heads))
                if table is not None:
                    kind = kinds[g]
                    kind.tables.append(table)
                    kind.requests.append((start, end, first_block, n_cells, n_seg))
                    row_tokens += (end - start) * len(group.rows)
                n_cells += len(group.heads) * n_seg
            spans.append(row)
        return DigestLayout(spans), [k for k in kinds if k.requests], n_cells, row_tokens

    def _constexprs(self) -> dict[str, Any]:
        slots, words = self.tile
        return {
            "SLOTS": slots,
            "WORDS": words,
            "ANY_MODE": self._any_mode,
            "DCP_SPLIT": self._dcp_split,
            "WHOLE_SLOTS": self._whole_slots,
            "STREAM": self.stream,
            "NUM_STAGES": self.num_stages,
            "PREFETCH": self.prefetch,
        }

    def _launch(self, work: torch.Tensor, units: int) -> None:
        from kvtail_connector.extras.ops.digest.kernel import kv_digest_kernel

        grid = max(1, min(units, self._programs))
        if self.device.type != "cuda":  # the interpreter
            kv_digest_kernel[(grid,)](
                work, self._rows, **self._constexprs(), num_warps=self.num_warps
            )
            return
        if self._compiled is None:
            self._compiled = CompiledLaunch(
                kv_digest_kernel,
                work,
                self._rows,
                self._constexprs(),
                {"num_warps": self.num_warps, **self._launch_options},
            )
        self._compiled(grid, work, self._rows)


def _tensors(caches: Sequence[Any]) -> list[torch.Tensor]:
    return [c.tensor if hasattr(c, "tensor") else c for c in caches]
