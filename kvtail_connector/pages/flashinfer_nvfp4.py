"""FlashInfer NVFP4 pages (``--kv-cache-dtype nvfp4``/``nvfp4_4over6``): per
side, every token's data, then every token's block scales.

``FlashInferBackend.customize_spec`` publishes ``2 * Hkv`` head slots (K heads,
then V heads) of ``F = D/2 + D/16`` bytes (``nvfp4_kv_cache_full_dim``), but
the ``[B, 2*Hkv, N, F]`` view is not how the page is used: ``_nvfp4_kv_views``
(flashinfer.py, vLLM 0.32 l.116, 0.33 l.126, 0.34 l.128) re-views side ``s``
(K = 0, V = 1) as the page's bytes from ``s * Hkv*N*F`` on, split by
``nvfp4_split_data_scale`` (torch_utils.py 0.32 l.561, 0.33 l.547, 0.34 l.567)
into ``[data | scales]`` (``dd = D/2`` data bytes, ``S = D/16`` scales a token):

- HND: data ``h*N*dd + n*dd + j``; scales ``Hkv*N*dd + h*N*S + n*S + g``;
- NHD: data ``n*Hkv*dd + h*dd + j``; scales ``Hkv*N*dd + n*Hkv*S + h*S + g``.

Writers (``FlashInferImpl.do_kv_cache_update``; 0.32 l.2623, 0.33 l.2806,
0.34 l.2837), keyed on the impl's path flags:

- ``impl.nvfp4_fa2`` (SM80/90/12x): FlashInfer's
  ``nvfp4_quantize_append_paged_kv_cache_with_slot_mapping`` into exactly
  those views; its kernel (``NVFP4QuantizeAppendPagedKVCacheWithSlotMapping``
  in include/flashinfer/page.cuh, identical in flashinfer-python 0.7.0.post1,
  0.7.2.post1 and 0.7.4, the pins of vLLM 0.32 and 0.33 and the release after
  0.34's 0.7.3) addresses data and scales by the views' page/token/head
  strides, scale ``g`` at ``+ g``: the layout above, linear.
- ``impl.nvfp4_trtllm`` (SM100): ``reshape_and_cache_flash`` ->
  ``reshape_and_cache_nvfp4_dispatch`` (csrc nvfp4_kv_cache_kernels.cu): K
  scales linear, V scales in trtllm-gen's 4-token swizzle
  (``swizzle_scale_offset``: ``(n, g)`` at row ``4*(n//4) + g//(S/4)``, column
  ``(g % (S/4))*4 + n%4``), so a token's V scales share 32-bit words with its
  quad. The 0.32-0.34 wheels carry that kernel version (their
  ``_C_stable_libtorch`` holds "block_size must be divisible by 4 for NVFP4
  KV cache swizzle", the unconditional swizzle). Head-major only: SM100 takes
  LBHNC/BLHNC, and on a token-major page this writer would put V at
  ``Hkv*F`` (its ``split`` of the transposed view), not where the views read.

So view row ``n`` is not token ``n``: the map is an owner array per page,
cut into regions (``ops.ownership.regions_from_owner``).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvtail_connector.ops.geometry import PageRegion, RegionCache
from kvtail_connector.ops.ownership import regions_from_owner
from kvtail_connector.pages.layer import LayerPage
from kvtail_connector.pages.maps import PageCache, PageMap
from kvtail_connector.pages.views import check_view

BACKEND = "vllm.v1.attention.backends.flashinfer.FlashInferBackend"  # 0.32-0.34
QUAD = 4  # tokens whose V scales the trtllm-gen swizzle interleaves


def full_dim(head_size: int) -> int:
    """``nvfp4_kv_cache_full_dim``: E2M1 data (2 a byte), then one E4M3 scale
    per 16 values."""
    return head_size // 2 + head_size // 16


def side_owner(heads: int, tokens: int, head_size: int, hnd: bool, swizzled: bool) -> np.ndarray:
    """The token owning each byte of one side (``heads * tokens * F`` bytes):
    ``[data | scales]``; ``swizzled`` puts the scales in trtllm-gen's V order."""
    dd, s = head_size // 2, head_size // 16
    h = np.arange(heads)[:, None, None]
    n = np.arange(tokens)[None, :, None]
    j = np.arange(dd)[None, None, :]
    g = np.arange(s)[None, None, :]
    owner = np.full(heads * tokens * (dd + s), -1, dtype=np.int64)
    data = h * tokens * dd + n * dd + j if hnd else n * heads * dd + h * dd + j
    owner[data.ravel()] = np.broadcast_to(n, data.shape).ravel()
    row, col = n, g
    if swizzled:
        row = QUAD * (n // QUAD) + g // (s // QUAD)
        col = (g % (s // QUAD)) * QUAD + n % QUAD
    scales = heads * tokens * dd + (
        h * tokens * s + row * s + col if hnd else row * heads * s + h * s + col
    )
    owner[scales.ravel()] = np.broadcast_to(n, scales.shape).ravel()
    return owner


@functools.cache
def page_regions(
    heads: int, tokens: int, head_size: int, hnd: bool, v_swizzled: bool
) -> tuple[PageRegion, ...]:
    """The regions of one ``[K side | V side]`` page (offsets from its start)."""
    k = side_owner(heads, tokens, head_size, hnd, swizzled=False)
    v = side_owner(heads, tokens, head_size, hnd, swizzled=v_swizzled)
    side, data = k.size, heads * tokens * (head_size // 2)
    segments = [(b, b + data) for b in (0, side)] + [(b + data, b + side) for b in (0, side)]
    return regions_from_owner(np.concatenate([k, v]), tokens, 1, segments)


def _impl_flag(page: LayerPage, name: str) -> bool:
    return getattr(getattr(page.layer, "impl", None), name, None) is True


def _spec_covered(page: LayerPage) -> bool:
    """FlashInferBackend.customize_spec's NVFP4 spec, nothing else reshaped."""
    heads, head_size = int(page.field("num_kv_heads", 0)), int(page.field("head_size", 0))
    return (
        page.quant_mode == "NVFP4"
        and page.field("dtype") == torch.uint8
        and head_size > 0
        and head_size % 16 == 0
        and page.field("head_size_v") == head_size
        and page.field("num_head_slots") == 2 * heads
        and page.field("state_content_bytes") == full_dim(head_size)
        and not page.field("kv_head_major_slots", False)
        and page.field("tokens_per_state", 1) == 1
    )


def _side_major(page: LayerPage) -> bool:
    """Whether the view is head-major (HND), as ``_nvfp4_kv_views`` decides;
    ValueError for strides it rejects (vLLM itself cannot run on them)."""
    view = page.view
    _, slots, tokens, cell = (int(x) for x in view.shape)
    check_view(page)
    if view.dtype != torch.uint8:
        raise ValueError(f"expected uint8 NVFP4 pages, got {view.dtype}")
    strides = tuple(view.stride()[1:])
    if strides == (tokens * cell, cell, 1):
        return True
    if strides == (cell, slots * cell, 1):
        return False
    raise ValueError(f"_nvfp4_kv_views takes only dense HND or NHD pages, got strides {strides}")


def _regions_cache(page: LayerPage, v_swizzled: bool) -> PageCache:
    hnd = _side_major(page)
    heads, tokens = int(page.field("num_kv_heads")), int(page.view.shape[2])
    head_size = int(page.field("head_size"))
    if v_swizzled:
        if not hnd:
            raise ValueError(
                "the SM100 trtllm-gen NVFP4 writer puts a token-major page's V side where "
                "_nvfp4_kv_views does not read it (SM100 serves head-major layouts only)"
            )
        if tokens % QUAD or (head_size // 16) % QUAD:
            raise ValueError(
                f"the V-scale swizzle needs a block size and scales per token divisible by "
                f"{QUAD} (got {tokens} tokens, {head_size // 16} scales)"
            )
    regions = page_regions(heads, tokens, head_size, hnd, v_swizzled)
    return RegionCache(page.view, tokens, regions)


def _hint(page: LayerPage) -> str | None:
    if not _spec_covered(page) or _impl_flag(page, "nvfp4_fa2") or _impl_flag(page, "nvfp4_trtllm"):
        return None
    return (
        "FlashInfer NVFP4 pages: the layer object names no FlashInferImpl NVFP4 path "
        "(impl.nvfp4_fa2 / impl.nvfp4_trtllm), which decides the order of the V block "
        "scales; serve with another --kv-cache-dtype"
    )


FA2_LINEAR = PageMap(
    layout="FlashInfer NVFP4, FA2 path (per side: data, then linear scales)",
    backends=frozenset({BACKEND}),
    covers=lambda page: _spec_covered(page) and _impl_flag(page, "nvfp4_fa2"),
    cache=lambda page: _regions_cache(page, v_swizzled=False),
    hint=_hint,
)

TRTLLM_SWIZZLED = PageMap(
    layout="FlashInfer NVFP4, SM100 trtllm-gen path (V scales in 4-token swizzle)",
    backends=frozenset({BACKEND}),
    covers=lambda page: _spec_covered(page) and _impl_flag(page, "nvfp4_trtllm"),
    cache=lambda page: _regions_cache(page, v_swizzled=True),
)

MAPS = (FA2_LINEAR, TRTLLM_SWIZZLED)
