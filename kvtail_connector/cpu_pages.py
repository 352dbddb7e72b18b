"""CPU_ATTN pages: which bytes hold which token slot, learned from vLLM's own writer.

vLLM's CPU attention backend views each layer's ``[B, H, N, 2*D]`` cache as
``[B, H, 2N, D]``, keeps K in the first half and V in the second, and its
ISA-specific writer may store K transposed (the "vec" ISA: ``[D, N]``). So
slot ``s`` is *not* ``view[b, :, s, :]``, and zeroing through the view would
wipe other tokens' keys. Instead of assuming a layout per ISA, the wrapper
writes each slot once through ``cpu_attn_reshape_and_cache`` into a scratch
page, maps every element to the slot that wrote it, and turns that map into
exact page regions (or refuses to start).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvtail_connector.ops.geometry import PageRegion, regions_from_owner

BACKEND_NAME = "CPU_ATTN"


@functools.cache
def _regions(
    dtype: torch.dtype, heads: int, slots: int, content: int, isa: str, kv_cache_dtype: str
) -> tuple[PageRegion, ...]:
    from vllm import _custom_ops as ops

    scratch = torch.zeros((1, heads, slots, content), dtype=dtype)
    k_cache, v_cache = scratch.view(1, heads, 2 * slots, content // 2).chunk(2, dim=2)
    ones = torch.ones((1, heads, content // 2), dtype=dtype)
    flat = scratch.view(-1)
    owner = torch.full((flat.numel(),), -1, dtype=torch.int64)
    for s in range(slots):
        ops.cpu_attn_reshape_and_cache(
            ones,
            ones,
            k_cache,
            v_cache,
            torch.tensor([s], dtype=torch.int64),
            isa,
            kv_cache_dtype=kv_cache_dtype,
        )
        new = (flat != 0) & (owner < 0)
        owner[new] = s
    return regions_from_owner(owner.tolist(), slots, scratch.element_size())


def cpu_attn_regions(
    view: torch.Tensor, isa: str, kv_cache_dtype: str = "auto"
) -> tuple[PageRegion, ...]:
    """The regions of one ``[B, H, N, C]`` CPU_ATTN page for ``isa``.

    Raises:
        ValueError: the writer's layout is not per-slot affine (cannot be
            zeroed exactly), with the layer-independent reason.
    """
    if view.dim() != 4 or view.shape[3] % 2:
        raise ValueError(f"CPU_ATTN page of shape {tuple(view.shape)}: expected [B, H, N, 2*D]")
    _, heads, slots, content = view.shape
    return _regions(view.dtype, int(heads), int(slots), int(content), isa, kv_cache_dtype)


def layer_isa(layer_object: Any) -> str | None:
    """The ISA vLLM's CPU metadata builder chose for this layer (``layer.isa``)."""
    isa = getattr(layer_object, "isa", None)
    return isa if isinstance(isa, str) else None
