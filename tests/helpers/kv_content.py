"""Logical KV content placed into caches the way vLLM places tokens.

``logical[l, h, t]`` is the content of layer ``l``, global KV head ``h``,
token ``t``; :func:`place` writes it through per-layer ``[B, H, N, C]`` views
for a block table, kernel-page split, TP head offset and DCP rank, so tests
can lay the same tokens out in many ways. Placement uses the project's
``dcp_local_valid_slots`` (checked against vLLM's dealing in test_dcp.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtail_connector.ops import dcp_local_valid_slots


def logical_content(
    layers: int, heads: int, tokens: int, content: int, dtype: torch.dtype, seed: int = 0
) -> torch.Tensor:
    """``[layers, heads, tokens, content]`` of random bytes viewed as ``dtype``."""
    el = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (layers, heads, tokens, content * el), generator=gen)
    return raw.to(torch.uint8).view(dtype)


def slot_of(
    t: int, block_ids: Sequence[int], n: int, pages_per_block: int, world: int, ilv: int
) -> tuple[int, int, int] | None:
    """``(DCP rank, page, page slot)`` holding token ``t``."""
    eb = pages_per_block * n * world
    offset = t % eb
    rank = (offset // ilv) % world
    local = dcp_local_valid_slots(offset, rank, world, ilv)
    return rank, block_ids[t // eb] * pages_per_block + local // n, local % n


def place(
    views: Sequence[torch.Tensor],
    logical: torch.Tensor,
    block_ids: Sequence[int],
    tokens: range,
    *,
    pages_per_block: int = 1,
    head_offset: int = 0,
    dcp: tuple[int, int, int] = (0, 1, 1),
) -> None:
    """Write ``logical[l, head_offset + h, t]`` for ``t`` in ``tokens`` into
    ``views[l][page, h, slot]`` of this DCP rank (``dcp = (rank, world, I)``)."""
    rank, world, ilv = dcp
    n = int(views[0].shape[2])
    pages, slots, held = [], [], []
    for t in tokens:
        owner, page, slot = slot_of(t, block_ids, n, pages_per_block, world, ilv)
        if owner == rank:
            pages.append(page)
            slots.append(slot)
            held.append(t)
    if not held:
        return
    p, s, ts = torch.tensor(pages), torch.tensor(slots), torch.tensor(held)
    for layer, view in enumerate(views):
        for h in range(view.shape[1]):
            view[p.to(view.device), h, s.to(view.device)] = logical[layer, head_offset + h, ts].to(
                view.device
            )


def byte_views(views: Sequence[torch.Tensor], raw: torch.Tensor) -> list[torch.Tensor]:
    """``[B, H, N, C * elem]`` uint8 views of ``views``' bytes over backing ``raw``."""
    out = []
    for v in views:
        el = v.element_size()
        out.append(
            torch.as_strided(
                raw.view(torch.uint8),
                (*v.shape[:-1], v.shape[-1] * el),
                (*(s * el for s in v.stride()[:-1]), 1),
                v.storage_offset() * el,
            )
        )
    return out
