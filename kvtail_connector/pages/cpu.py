"""CPU_ATTN pages: which bytes hold which token slot, learned from vLLM's own writer.

vLLM's CPU attention backend views each layer's ``[B, H, N, 2*D]`` cache as
``[B, H, 2N, D]``, keeps K in the first half and V in the second, and its
ISA-specific writer lays the tokens out its own way: K transposed (``vec``,
``vec16``), K tiled by 16 tokens in VNNI pairs and V with two tokens
interleaved element by element (``amx``). So slot ``s`` is *not*
``view[b, :, s, :]``. Instead of assuming a layout per ISA, the wrapper writes
each slot alone through ``cpu_attn_reshape_and_cache`` into a zeroed scratch
page, maps every element to the slot that wrote it (an element two slots
write is a layout it refuses), and turns the map into exact page regions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from kvtail_connector.ops.geometry import PageRegion, RegionCache
from kvtail_connector.ops.ownership import regions_from_owner
from kvtail_connector.pages.layer import LayerPage
from kvtail_connector.pages.maps import PageCache, PageMap
from kvtail_connector.pages.plain import unpacked
from kvtail_connector.pages.views import check_view

BACKEND = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"

# cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
# isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
PageWriter = Callable[..., None]


def vllm_writer() -> PageWriter:
    """vLLM's CPU attention cache writer."""
    from vllm import _custom_ops as ops

    return ops.cpu_attn_reshape_and_cache  # type: ignore[no-any-return]


def learn_owner(
    shape: tuple[int, int, int],
    strides: tuple[int, int, int],
    dtype: torch.dtype,
    key_dtype: torch.dtype,
    isa: str,
    kv_cache_dtype: str,
    writer: PageWriter,
) -> np.ndarray:
    """The slot each element of one page belongs to (-1: none), by writing
    every slot alone into a zeroed scratch page.

    Args:
        shape, strides: the page's ``(H, N, 2*D)`` and its element strides.

    Raises:
        ValueError: two slots write one element, or the writer fails.
    """
    heads, slots, content = shape
    span = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))
    flat = torch.zeros(span, dtype=dtype)
    page = torch.as_strided(flat, (1, *shape), (span, *strides))
    k_cache, v_cache = page.view(1, heads, 2 * slots, content // 2).chunk(2, dim=2)
    ones = torch.ones((1, heads, content // 2), dtype=key_dtype)
    owner = np.full(span, -1, dtype=np.int64)
    for s in range(slots):
        flat.zero_()
        try:
            writer(
                ones,
                ones,
                k_cache,
                v_cache,
                torch.tensor([s], dtype=torch.int64),
                isa,
                kv_cache_dtype=kv_cache_dtype,
            )
        except RuntimeError as e:
            raise ValueError(f"vLLM's cache writer failed on a scratch page: {e}") from e
        written = (flat != 0).numpy()
        clash = written & (owner >= 0)
        if clash.any():
            at = int(np.argmax(clash))
            raise ValueError(
                f"page layout: slots {int(owner[at])} and {s} both write element {at} "
                "of the page, so no slot's bytes can be zeroed alone"
            )
        owner[written] = s
    return owner


@functools.cache
def _regions(
    dtype: torch.dtype,
    key_dtype: torch.dtype,
    shape: tuple[int, int, int],
    strides: tuple[int, int, int],
    isa: str,
    kv_cache_dtype: str,
    writer: PageWriter,
) -> tuple[PageRegion, ...]:
    owner = learn_owner(shape, strides, dtype, key_dtype, isa, kv_cache_dtype, writer)
    heads, slots, content = shape
    half = slots * content // 2
    # Each head's K and V halves: decomposed apart (each its own slot step).
    segments = [
        (h * strides[0] + part * half, h * strides[0] + (part + 1) * half)
        for h in range(heads)
        for part in (0, 1)
    ]
    el = torch.empty((), dtype=dtype).element_size()
    return regions_from_owner(owner, slots, el, segments)


def cpu_attn_regions(
    view: torch.Tensor,
    isa: str,
    kv_cache_dtype: str = "auto",
    key_dtype: torch.dtype | None = None,
    writer: PageWriter | None = None,
) -> tuple[PageRegion, ...]:
    """The regions of one ``[B, H, N, C]`` CPU_ATTN page for ``isa``.

    Args:
        view: the layer's cache as ``register_kv_caches`` hands it.
        isa: ``layer.isa``, as vLLM's CPU metadata builder set it.
        kv_cache_dtype: the layer's ``kv_cache_dtype`` (fp8 caches are uint8
            pages written from ``key_dtype`` keys).
        key_dtype: the model dtype (``layer.dtype``); only read for fp8 caches.
        writer: the cache writer to learn from (default: vLLM's).

    Raises:
        ValueError: a page vLLM's views cannot have, or a writer whose slots do
            not own disjoint elements, with the reason.
    """
    if view.dim() != 4 or view.shape[3] % 2:
        raise ValueError(f"CPU_ATTN page of shape {tuple(view.shape)}: expected [B, H, N, 2*D]")
    _, heads, slots, content = (int(x) for x in view.shape)
    strides = (int(view.stride(1)), int(view.stride(2)), int(view.stride(3)))
    if strides[2] != 1 or strides[1] != content or strides[0] < slots * content:
        raise ValueError(
            f"CPU_ATTN page with strides {tuple(view.stride())}: expected contiguous "
            "[N, 2*D] rows per head (the layout vLLM's CPU backend allocates)"
        )
    if kv_cache_dtype == "auto" or key_dtype is None:
        key_dtype = view.dtype if kv_cache_dtype == "auto" else torch.bfloat16
    return _regions(
        view.dtype,
        key_dtype,
        (heads, slots, content),
        strides,
        isa,
        kv_cache_dtype,
        writer or vllm_writer(),
    )


def _learned_cache(page: LayerPage) -> PageCache:
    check_view(page)
    # The ISA vLLM's CPU metadata builder chose, and the model dtype fp8 keys come in.
    isa, dtype = getattr(page.layer, "isa", None), getattr(page.layer, "dtype", None)
    if not isinstance(isa, str):
        raise ValueError("vLLM's CPU metadata builder set no ISA on it (layer.isa)")
    key_dtype = dtype if isinstance(dtype, torch.dtype) else None
    try:
        regions = cpu_attn_regions(page.view, isa, page.kv_cache_dtype, key_dtype)
    except ValueError as e:
        raise ValueError(
            f"{str(e).rstrip('.')} (ISA {isa!r}; vLLM picks the CPU attention ISA from "
            '--dtype, the block size and the head size: on x86, --dtype float32 selects "vec")'
        ) from e
    return RegionCache(page.view, int(page.view.shape[2]), regions)


CPU_ATTN = PageMap(
    layout="CPU attention pages (learned from vLLM's CPU cache writer)",
    backends=frozenset({BACKEND}),
    covers=unpacked,
    cache=_learned_cache,
)

MAPS = (CPU_ATTN,)
