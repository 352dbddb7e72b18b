"""KV cache views laid out as vLLM allocates them, built independently of vLLM.

One int8 backing buffer per layer group; every layer is an ``as_strided``
``[B, H, N, C]`` view whose strides follow a ``KVCacheLayout`` stride order
over the logical ``[L, B, H, N, C]`` axes (C in bytes, then viewed as dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Physical order of the logical axes [L, B, H, N, C], outermost first.
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]

GUARD = 64  # poisoned bytes before and after the views, never to be touched


@dataclass
class Backing:
    raw: torch.Tensor  # int8, the whole allocation (guards included)
    views: list[torch.Tensor]  # one [B, H, N, C] view per layer


def make_backing(
    layout: str,
    *,
    num_layers: int,
    num_pages: int,
    heads: int,
    slots: int,
    content: int,
    dtype: torch.dtype,
    pad: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0),
    seed: int = 0,
) -> Backing:
    """Allocate and poison a backing buffer, and view it per layer.

    ``pad[d]`` adds bytes to logical axis ``d``'s stride beyond the dense
    extent of the axes inside it (padding between slots, pages, layers...).
    ``content`` is C in elements of ``dtype``.
    """
    el = torch.empty((), dtype=dtype).element_size()
    shape = [num_layers, num_pages, heads, slots, content * el]
    strides = [0] * 5
    current = 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim] = current + (pad[dim] if dim != 4 else 0)
        current = strides[dim] * shape[dim]
    span = 1 + sum((s - 1) * st for s, st in zip(shape, strides, strict=False))
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(1, 127, (span + 2 * GUARD,), dtype=torch.int8, generator=gen)
    view5 = torch.as_strided(raw, shape, strides, storage_offset=GUARD)
    views = [view5[i].view(dtype) for i in range(num_layers)]
    return Backing(raw=raw, views=views)


def rebase(views: list[torch.Tensor], raw: torch.Tensor) -> list[torch.Tensor]:
    """The same byte geometry as ``views``, over another backing ``raw``."""
    out = []
    for v in views:
        el = v.element_size()
        as_bytes = torch.as_strided(
            raw,
            (*v.shape[:-1], v.shape[-1] * el),
            (*(s * el for s in v.stride()[:-1]), 1),
            v.storage_offset() * el,
        )
        out.append(as_bytes.view(v.dtype))
    return out


def to_device(backing: Backing, device: str | torch.device) -> Backing:
    """A copy of ``backing`` (bytes and view geometry) on ``device``."""
    raw = backing.raw.to(device)
    return Backing(raw=raw, views=rebase(backing.views, raw))
