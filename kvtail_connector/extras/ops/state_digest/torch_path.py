"""The state digest in plain torch: CPU caches without the Triton interpreter,
or CUDA where Triton is not installed.

Vectorized over requests: per layer one gather of the requests' pages and
one pass of int64 arithmetic per state. It builds its indices on the host
(on CUDA that is a blocking copy per group: the price of having no Triton)
and holds ``[requests, words]`` int64 temporaries per state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtail_connector.extras.ops.digest.torch_path import fmix64 as fmix64_torch
from kvtail_connector.extras.ops.state_digest.reference import WORD_MUL, signed

_LOW32 = (1 << 32) - 1


def digest(
    layers: Sequence[Sequence[tuple[torch.Tensor, tuple[tuple[int, int], ...]]]],
    planes: Sequence[Sequence[Sequence[int]]],
    blocks: Sequence[Sequence[int | None]],
    device: torch.device,
) -> torch.Tensor:
    """``StateDigester.digest``'s result.

    Args:
        layers: per group, per layer: its ``[blocks, bytes]`` pages and states.
        planes: per group, layer and state: its plane (int64 bits).
        blocks: per request, per group: the block id or None.
        device: the pages' device.
    """
    out = torch.zeros((len(blocks), len(layers)), dtype=torch.int64, device=device)
    for j, group in enumerate(layers):
        rows = [i for i, per in enumerate(blocks) if per[j] is not None]
        if not rows or not group:
            continue
        index = torch.tensor([blocks[i][j] for i in rows], dtype=torch.int64).to(device)
        total = torch.zeros(len(rows), dtype=torch.int64, device=device)
        for li, (pages, states) in enumerate(group):
            gathered = pages.index_select(0, index)
            for si, (offset, nbytes) in enumerate(states):
                words = _words(gathered[:, offset : offset + nbytes])
                keys = torch.arange(words.shape[1], dtype=torch.int64, device=device)
                keys = keys * signed(WORD_MUL) + planes[j][li][si]
                total += fmix64_torch(keys[None, :] ^ words).sum(dim=1)
        out[torch.tensor(rows, dtype=torch.int64).to(device), j] = total
    return out


def _words(content: torch.Tensor) -> torch.Tensor:
    """int64 ``[n, ceil(bytes / 4)]``: little-endian uint32 words, the last
    one zero-filled above a partial run."""
    n, run = content.shape
    if run % 4 == 0 and content.is_contiguous() and content.storage_offset() % 4 == 0:
        padded = content
    else:
        padded = torch.zeros((n, -(-run // 4) * 4), dtype=torch.uint8, device=content.device)
        padded[:, :run] = content
    return padded.view(torch.int32).to(torch.int64) & _LOW32
