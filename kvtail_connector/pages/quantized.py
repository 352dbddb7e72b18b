"""Quantized pages of vLLM's generic backends whose writers keep a token's
bytes in its own cells, and TurboQuant's SoA pages, which do not.

Token ``n`` owns ``view[b, :, n, :]`` (the writer addresses block, token and
head by the view's strides and stays inside the cell), for:

- ``TRITON_ATTN`` per-token-head int8 / fp8 / int4: ``customize_spec`` makes a
  cell ``[K | K fp32 scale | V | V fp32 scale]`` (int4: two dims a byte, along
  the head dim); ``_pth_key_value_caches`` / ``_ensure_scale_caches`` view it,
  ``_reshape_cache_per_token_head`` / ``_reshape_cache_int4_kernel`` store one
  (token, head) each.
- ``B12X``: two head slots, the K and V planes ``[N, Hkv*D]``
  (``_kv_cache_views``: ``unbind(1)``), written by ``reshape_and_cache_flash``.
- ``TURBOQUANT`` with the AoS store (``impl._soa_store`` False): one packed
  slot per (token, head) at ``blk*s0 + n*s1 + h*s2`` of ``view.transpose(1,
  2)`` (``triton_turboquant_store``).
- ``ULTRAQUANT``: the same AoS slot (``ultraquant_store``), addressed from the
  start of ``_kv_cache_flat(kv_cache)``, which is the view's first byte only
  for a dense page or a view at storage offset 0 (checked).
- ``ROCM_OCTAVE`` (0.33 on): "one packed K+V slot per (token, KV head)"
  (``customize_spec``), quantized from that token alone
  (``rocm_octave.reference_quantize``); the store kernel "takes block/head/token
  strides; the slot is contiguous" (``supported_kv_cache_layouts``).

TurboQuant with the SoA store (``impl._soa_store``: gfx950 with FlyDSL): a page
is ``[data: token n's H heads at n*H*DB | fp16 metadata]``, field ``f`` of
head ``h`` and token ``n`` at u16 ``(H*N*DB)//2 + (h*F + f)*N + n``
(``turboquant_soa/triton_turboquant_store.py``: ``data_base``,
``head_meta_u16_base``): exact through a RegionCache.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from kvtail_connector.ops.geometry import PageRegion, RegionCache
from kvtail_connector.ops.ownership import regions_from_owner
from kvtail_connector.pages.layer import LayerPage
from kvtail_connector.pages.maps import PageCache, PageMap
from kvtail_connector.pages.plain import fused_writer_hint, kv_planes, plain_view
from kvtail_connector.pages.views import check_view

_B = "vllm.v1.attention.backends."
TRITON_BACKEND = _B + "triton_attn.TritonAttentionBackend"  # 0.32-0.34
B12X_BACKEND = _B + "b12x.B12xPagedAttentionBackend"  # 0.32-0.34
TURBOQUANT_BACKEND = _B + "turboquant_attn.TurboQuantAttentionBackend"  # 0.32-0.34
ULTRAQUANT_BACKEND = _B + "ultraquant_attn.UltraQuantAttentionBackend"  # 0.32-0.34
OCTAVE_BACKEND = _B + "rocm_octave_attn.RocmOctaveAttentionBackend"  # 0.33, 0.34

PER_TOKEN_HEAD_MODES = frozenset(
    {"INT8_PER_TOKEN_HEAD", "FP8_PER_TOKEN_HEAD", "INT4_PER_TOKEN_HEAD"}
)
TURBOQUANT_MODES = frozenset(
    {"TURBOQUANT_K8V4", "TURBOQUANT_4BIT_NC", "TURBOQUANT_K3V4_NC", "TURBOQUANT_3BIT_NC"}
)
OCTAVE_MODES = frozenset({"OCTAVE_K3V4", "OCTAVE_K3V3", "OCTAVE_K3V3_COMPACT"})
_SCALE_BYTES = 4  # one fp32 scale per (token, head) and side


def one_cell_per_head(page: LayerPage) -> bool:
    """A packed cell per (token, KV head): nothing but the content reshaped."""
    return (
        page.field("state_content_bytes") is not None
        and page.field("num_head_slots") is None
        and not page.field("kv_head_major_slots", False)
        and page.field("tokens_per_state", 1) == 1
    )


def _elem(page: LayerPage) -> int:
    dtype = page.field("dtype")
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 0


def _per_token_head(page: LayerPage) -> bool:
    """TritonAttentionBackend.customize_spec's cell: (hs_k + hs_v) * elem + 2
    fp32 scales, halved head sizes for int4."""
    if page.quant_mode not in PER_TOKEN_HEAD_MODES or not one_cell_per_head(page):
        return False
    hs_k, hs_v = int(page.field("head_size", 0)), int(page.field("head_size_v", 0))
    if page.quant_mode == "INT4_PER_TOKEN_HEAD":
        hs_k, hs_v = hs_k // 2, hs_v // 2
    cell = (hs_k + hs_v) * _elem(page) + 2 * _SCALE_BYTES
    return hs_k > 0 and page.field("state_content_bytes") == cell


def _b12x_planes(page: LayerPage) -> bool:
    """B12xPagedAttentionBackend.customize_spec: K and V planes of Hkv*D."""
    return (
        kv_planes(page)
        and page.field("head_size_v") == page.field("head_size")
        and page.field("tokens_per_state", 1) == 1
    )


@functools.cache
def _turboquant_config(preset: str, head_size: int) -> Any:
    """vLLM's own TurboQuantConfig for the preset (what customize_spec sizes by)."""
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    return TurboQuantConfig.from_cache_dtype(preset, head_size)


def _turboquant(page: LayerPage) -> bool:
    """TurboQuantAttentionBackend.customize_spec: one slot_size_aligned slot."""
    if page.quant_mode not in TURBOQUANT_MODES or not one_cell_per_head(page):
        return False
    config = _turboquant_config(page.quant_mode.lower(), int(page.field("head_size")))
    return bool(page.field("state_content_bytes") == config.slot_size_aligned)


def _soa_store(page: LayerPage) -> bool | None:
    """The impl's store switch (``TurboQuantAttentionImpl._soa_store``), None
    where the layer names no impl that has it."""
    value = getattr(getattr(page.layer, "impl", None), "_soa_store", None)
    return value if isinstance(value, bool) else None


def _ultraquant(page: LayerPage) -> bool:
    """UltraQuantAttentionBackend.customize_spec: one format.slot_size slot."""
    if page.quant_mode != "ULTRAQUANT_4BIT" or not one_cell_per_head(page):
        return False
    from vllm.v1.attention.ops.ultraquant.format import slot_size

    return page.field("state_content_bytes") == slot_size(int(page.field("head_size")))


def _ultraquant_view(page: LayerPage) -> PageCache:
    check_view(page)
    view = page.view
    if not view.transpose(1, 2).is_contiguous() and view.storage_offset() != 0:
        raise ValueError(
            "ultraquant_store addresses a strided cache from its storage's first byte "
            f"(_kv_cache_flat), not from this view's (offset {view.storage_offset()})"
        )
    return view


def _octave(page: LayerPage) -> bool:
    return page.quant_mode in OCTAVE_MODES and one_cell_per_head(page)


def soa_owner(heads: int, tokens: int, data_bytes: int, fields: int, cell: int) -> np.ndarray:
    """The token owning each byte of one SoA page of ``heads * tokens * cell``
    bytes (-1: none).

    Raises:
        ValueError: the metadata would overlap the data or leave the page.
    """
    owner = np.full(heads * tokens * cell, -1, dtype=np.int64)
    data_end = tokens * heads * data_bytes
    owner[:data_end] = np.repeat(np.arange(tokens), heads * data_bytes)
    word = np.arange(heads * fields * tokens)  # u16 (h, f, n) from the meta base
    first = 2 * (data_end // 2) + 2 * word
    if first[0] < data_end or first[-1] + 2 > owner.size:
        raise ValueError("the SoA metadata does not fit between the data and the page end")
    token = word % tokens
    owner[first], owner[first + 1] = token, token
    return owner


@functools.cache
def soa_regions(
    heads: int, tokens: int, data_bytes: int, fields: int, cell: int
) -> tuple[PageRegion, ...]:
    owner = soa_owner(heads, tokens, data_bytes, fields, cell)
    data_end = tokens * heads * data_bytes
    segments = [(0, data_end), (data_end, owner.size)]
    return regions_from_owner(owner, tokens, 1, segments)


def _soa_cache(page: LayerPage) -> PageCache:
    heads_view, tokens, cell = check_view(page)
    view, heads = page.view, int(page.field("num_kv_heads"))
    dense = (tokens * heads * cell, cell, heads * cell, 1)
    if view.dtype != torch.uint8 or heads_view != heads or tuple(view.stride()) != dense:
        raise ValueError(
            "the TurboQuant SoA store flattens the page with view(-1): expected dense "
            f"token-major uint8 pages (strides {dense}), got {view.dtype} "
            f"{tuple(view.shape)} strides {tuple(view.stride())}"
        )
    # The store launcher's sizes (triton_turboquant_store: key_data_bytes,
    # val_data_bytes, num_soa_fields), from the config the impl builds.
    config = _turboquant_config(page.quant_mode.lower(), int(page.field("head_size")))
    d = int(config.head_dim)
    key_bytes = d if config.key_fp8 else math.ceil(d * config.key_mse_bits / 8)
    data_bytes = key_bytes + math.ceil(d * config.effective_value_quant_bits / 8)
    fields = 2 if config.key_fp8 else 3  # V scale, V zero (and the K norm for MSE keys)
    return RegionCache(view, tokens, soa_regions(heads, tokens, data_bytes, fields, cell))


def _turboquant_hint(page: LayerPage) -> str | None:
    if not _turboquant(page) or _soa_store(page) is not None:
        return None
    return (
        "TurboQuant pages: the layer object names no TurboQuantAttentionImpl "
        "(impl._soa_store decides the AoS or SoA page layout); serve with another "
        "--kv-cache-dtype"
    )


TRITON_PER_TOKEN_HEAD = PageMap(
    layout="TRITON_ATTN per-token-head int8/fp8/int4 (cells with inline fp32 scales)",
    backends=frozenset({TRITON_BACKEND}),
    # On ROCm a fused AITER op may take the insert over (plain.FUSABLE_BACKENDS).
    covers=lambda page: _per_token_head(page) and page.engine.fused_kv_writer is None,
    cache=plain_view,
    hint=fused_writer_hint,
)

B12X_PLANES = PageMap(
    layout="B12X K|V planes (two head slots of Hkv*D)",
    backends=frozenset({B12X_BACKEND}),
    covers=_b12x_planes,
    cache=plain_view,
)

TURBOQUANT_AOS = PageMap(
    layout="TurboQuant AoS (one packed slot per token and head)",
    backends=frozenset({TURBOQUANT_BACKEND}),
    covers=lambda page: _turboquant(page) and _soa_store(page) is False,
    cache=plain_view,
    hint=_turboquant_hint,
)

TURBOQUANT_SOA = PageMap(
    layout="TurboQuant SoA (gfx950 FlyDSL: token data, then per-head fp16 metadata)",
    backends=frozenset({TURBOQUANT_BACKEND}),
    covers=lambda page: _turboquant(page) and _soa_store(page) is True,
    cache=_soa_cache,
)

ULTRAQUANT_AOS = PageMap(
    layout="UltraQuant (one FP4/UE8M0 slot per token and head)",
    backends=frozenset({ULTRAQUANT_BACKEND}),
    covers=_ultraquant,
    cache=_ultraquant_view,
)

ROCM_OCTAVE = PageMap(
    layout="ROCm Octave (one packed K+V slot per token and KV head)",
    backends=frozenset({OCTAVE_BACKEND}),
    covers=_octave,
    cache=plain_view,
)

MAPS = (
    TRITON_PER_TOKEN_HEAD,
    B12X_PLANES,
    TURBOQUANT_AOS,
    TURBOQUANT_SOA,
    ULTRAQUANT_AOS,
    ROCM_OCTAVE,
)
