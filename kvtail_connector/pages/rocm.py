"""ROCm paged-attention pages: K x-packed, V transposed or interleaved.

``ROCM_ATTN`` (and ``ROCM_AITER_FA`` with ``VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT``)
publish K and V as two head slots: ``register_kv_caches`` hands each layer a
``[B, 2, N, Hkv*D]`` view (``customize_spec``: ``num_head_slots=2``,
``state_content_bytes = Hkv*D*elem``), and the attention code re-views each
``[N, Hkv*D]`` plane (contiguous) the way vLLM's writers fill it, with
``x = 16 // elem``:

- K (``PagedAttention.split_kv_cache``): ``[Hkv, D/x, N, x]``: element ``d`` of
  slot ``n``, head ``h``, at ``h*D*N + (d//x)*N*x + n*x + d%x``;
- V, plain (``split_kv_cache``): ``[Hkv, D, N]``: at ``h*D*N + d*N + n``;
- V, interleaved (the AITER shuffle writer; on 0.33 also ROCM_ATTN's fused
  QK-norm/RoPE writer): ``[Hkv, N/x, D, x]``: at ``h*D*N + (n//x)*D*x + d*x + n%x``.

So slot ``n`` owns x-element runs in each of K's ``D/x`` groups and single
elements of V: this module builds that element -> slot map per plane and
turns it into exact regions.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from kvtail_connector import _compat
from kvtail_connector.ops.geometry import PageRegion, RegionCache
from kvtail_connector.ops.ownership import regions_from_owner
from kvtail_connector.pages.layer import LayerPage
from kvtail_connector.pages.maps import PageCache, PageMap
from kvtail_connector.pages.plain import fused_writer_hint, kv_planes
from kvtail_connector.pages.views import check_view


def key_owner(slots: int, heads: int, head_size: int, x: int) -> np.ndarray:
    """Slot of each element of one x-packed K plane (``[Hkv, D/x, N, x]``)."""
    h, g, n, i = np.meshgrid(
        np.arange(heads), np.arange(head_size // x), np.arange(slots), np.arange(x), indexing="ij"
    )
    owner = np.empty(slots * heads * head_size, dtype=np.int64)
    owner[(h * head_size * slots + g * slots * x + n * x + i).ravel()] = n.ravel()
    return owner


def value_owner(slots: int, heads: int, head_size: int, x: int, interleaved: bool) -> np.ndarray:
    """Slot of each element of one V plane: ``[Hkv, D, N]`` or, interleaved,
    ``[Hkv, N/x, D, x]``."""
    h, d, n = np.meshgrid(np.arange(heads), np.arange(head_size), np.arange(slots), indexing="ij")
    if interleaved:
        where = h * head_size * slots + (n // x) * head_size * x + d * x + n % x
    else:
        where = h * head_size * slots + d * slots + n
    owner = np.empty(slots * heads * head_size, dtype=np.int64)
    owner[where.ravel()] = n.ravel()
    return owner


def rocm_regions(
    view: torch.Tensor, num_kv_heads: int, head_size: int, v_interleaved: bool
) -> tuple[PageRegion, ...]:
    """The regions of one ``[B, 2, N, Hkv*D]`` ROCm page (K plane, then V plane).

    Raises:
        ValueError: a view the ROCm attention code could not re-view.
    """
    if view.dim() != 4 or view.shape[1] != 2 or view.shape[3] != num_kv_heads * head_size:
        raise ValueError(
            f"ROCm page of shape {tuple(view.shape)}: expected [B, 2, N, Hkv*D] "
            f"with Hkv*D = {num_kv_heads}*{head_size}"
        )
    el = view.element_size()
    x = 16 // el
    slots, content = int(view.shape[2]), int(view.shape[3])
    if view.stride(3) != 1 or view.stride(2) != content or head_size % x:
        raise ValueError(
            f"ROCm page with strides {tuple(view.stride())} and head size {head_size}: "
            f"expected contiguous [N, Hkv*D] planes and D divisible by x={x}"
        )
    plane = slots * content
    segments = [(h * head_size * slots, (h + 1) * head_size * slots) for h in range(num_kv_heads)]
    owners = (
        key_owner(slots, num_kv_heads, head_size, x),
        value_owner(slots, num_kv_heads, head_size, x, v_interleaved),
    )
    regions: list[PageRegion] = []
    for index, owner in enumerate(owners):
        assert owner.size == plane
        shift = index * int(view.stride(1)) * el
        regions.extend(
            replace(r, offset=r.offset + shift)
            for r in regions_from_owner(owner, slots, el, segments)
        )
    return tuple(regions)


ROCM_ATTN_BACKEND = "vllm.v1.attention.backends.rocm_attn.RocmAttentionBackend"
AITER_FA_BACKEND = "vllm.v1.attention.backends.rocm_aiter_fa.AiterFlashAttentionBackend"


def _planes(page: LayerPage) -> bool:
    """K and V published as two head slots of ``Hkv * D`` elements each (the
    specs both backends' ``customize_spec`` make), on a layer whose backend
    uses the planes (``_compat.rocm_v_interleaved``), written by the backend's
    own writers (not AITER's fused QK-norm/RoPE/KV insert)."""
    return (
        kv_planes(page)
        and page.engine.fused_kv_writer is None
        and _compat.rocm_v_interleaved(page.backend_name, page.layer) is not None
    )


def _planes_cache(page: LayerPage) -> PageCache:
    check_view(page)
    interleaved = _compat.rocm_v_interleaved(page.backend_name, page.layer)
    assert interleaved is not None  # _planes checked it
    spec = page.spec
    regions = rocm_regions(page.view, int(spec.num_kv_heads), int(spec.head_size), interleaved)
    return RegionCache(page.view, int(page.view.shape[2]), regions)


ROCM_PLANES = PageMap(
    layout="ROCm paged-attention planes (K x-packed, V transposed or interleaved)",
    backends=frozenset({ROCM_ATTN_BACKEND, AITER_FA_BACKEND}),
    covers=_planes,
    cache=_planes_cache,
    hint=fused_writer_hint,
)

MAPS = (ROCM_PLANES,)
