"""Vectorized torch path of the KV digest: the runtime path for caches that
are not on CUDA (and a second implementation to test the kernel against).

Per row, one gather of the served slots' bytes and one pass of int64 torch
arithmetic (which wraps modulo 2**64, as mix64-1 needs); slot lists are built
with numpy, never with a Python loop per slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvtail_connector.extras.ops.digest.plan import KindPlan, Row
from kvtail_connector.extras.ops.digest.reference import POS_MUL, WORD_MUL

_LOW31 = (1 << 31) - 1
_LOW32 = (1 << 32) - 1


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_M1 = _signed(0xFF51AFD7ED558CCD)
_M2 = _signed(0xC4CEB9FE1A85EC53)
_POS = _signed(POS_MUL)
_WORD = _signed(WORD_MUL)


def fmix64(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finalizer on int64 bit patterns (logical shifts)."""
    x = x ^ ((x >> 33) & _LOW31)
    x = x * _M1
    x = x ^ ((x >> 33) & _LOW31)
    x = x * _M2
    return x ^ ((x >> 33) & _LOW31)


def expand_requests(kind: KindPlan, segment: int) -> dict[str, np.ndarray]:
    """Every slot of a kind's requests this rank holds: block id, block-local
    slot, global token, cell of head 0 and the cell stride, one entry per slot
    (numpy per request; this is the path for caches not on CUDA)."""
    g = kind.group
    rank, world, ilv = g.dcp
    eb, spb = g.tokens_per_block, g.slots_per_block
    local = np.arange(spb, dtype=np.int64)
    # Token offset in its manager block of each block-local slot.
    offset = rank * ilv + (local // ilv) * (ilv * world) + local % ilv if world > 1 else local
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("block", "slot", "token", "cell", "cs")}
    for (start, end, first_block, cell, n_seg), table in zip(
        kind.requests, kind.tables, strict=True
    ):
        index = first_block + np.arange(len(table), dtype=np.int64)
        token = (index[:, None] * eb + offset[None, :]).reshape(-1)
        keep = (token >= start) & (token < end)
        token = token[keep]
        parts["block"].append(np.repeat(table, spb)[keep])
        parts["slot"].append(np.tile(local, len(table))[keep])
        parts["token"].append(token)
        parts["cell"].append(cell + token // segment)
        parts["cs"].append(np.full(len(token), n_seg, dtype=np.int64))
    out = {k: np.concatenate(v) if v else np.zeros(0, dtype=np.int64) for k, v in parts.items()}
    out["cell_stride"] = out.pop("cs")
    return out


def _byte_storage(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _row_bytes(row: Row, blocks: torch.Tensor, served: torch.Tensor) -> torch.Tensor:
    """``[n, run_bytes]`` content bytes of served slots ``served`` of ``blocks``."""
    raw = _byte_storage(row.tensor)
    offset = row.base - raw.data_ptr()
    num_blocks = int(blocks.max()) + 1
    elems = row.run_bytes // row.elem
    view = torch.as_strided(
        raw,
        (num_blocks, row.n_slots, elems, row.elem),
        (row.block_stride, row.slot_stride, row.elem_stride, 1),
        offset,
    )
    return view[blocks, served].reshape(-1, row.run_bytes)


def _words(content: torch.Tensor) -> torch.Tensor:
    """int64 ``[n, ceil(run / 4)]``: little-endian uint32 words, the last one
    zero-filled above a partial run."""
    n, run = content.shape
    padded = torch.zeros((n, -(-run // 4) * 4), dtype=torch.uint8, device=content.device)
    padded[:, :run] = content
    return padded.view(torch.int32).to(torch.int64) & _LOW32


def digest_rows(rows: Sequence[Row], slots: dict[str, np.ndarray], cells: torch.Tensor) -> None:
    """Add every (slot, row) term of a group to ``cells`` (int64, wrapping)."""
    if slots["slot"].size == 0:
        return
    device = cells.device
    for row in rows:
        k = slots["slot"] - row.first_slot
        served = (k >= 0) & (k % row.slot_step == 0) & (k // row.slot_step < row.n_slots)
        if not served.any():
            continue
        blocks = torch.from_numpy(slots["block"][served]).to(device)
        index = torch.from_numpy(k[served] // row.slot_step).to(device)
        words = _words(_row_bytes(row, blocks, index).to(device))
        tokens = torch.from_numpy(slots["token"][served]).to(device)
        word_index = torch.arange(words.shape[1], dtype=torch.int64, device=device)
        key = (
            _signed(row.plane)
            + (tokens * _POS)[:, None]
            + ((row.word_base + word_index) * _WORD)[None, :]
        )
        per_slot = fmix64(key ^ words).sum(dim=1)
        cell = slots["cell"][served] + row.out_head * slots["cell_stride"][served]
        cells.index_add_(0, torch.from_numpy(cell).to(device), per_slot)
