"""MiniMax-M3 NVFP4 pages (NVIDIA SM100): data, then block scales, per head slot.

Main cache (``MiniMaxM3SparseMSANvfp4Backend.customize_spec``: ``2 * Hkv``
head slots of 72 bytes per token; LBHNC only, so a page is one contiguous
``[2 * Hkv, 128, 72]`` run). Slot ``s = 2h + side`` (K = 0, V = 1) is not
``[128 tokens, 72 bytes]`` but, at ``S = 9216 * s``:

- E2M1 data, token ``t``: bytes ``S + 64t + [0, 64)``;
- K block scales (linear), token ``t``, group ``g``: ``S + 8192 + 8t + g``;
- V block scales (token-quad order): ``S + 8192 + 32*(t//4) + 4g + t%4``.

So view row ``n`` is not token ``n``: zeroing ``view[b, :, v:, :]`` would
wipe the scales of every valid token. Sources: ``nvfp4_kv_cache_slots``
(``cache[:, 0::2]``, ``cache[:, 1::2]``) and ``fmha_sm100.nvfp4_kv.
nvfp4_head_slot_views`` (data ``[128, 64]`` then scales ``[128, 8]``), and the
V-scale order of ``fmha_sm100.decode_q8kv4.interleave_v_scales`` ("the vLLM
NVFP4 cache order"; 0.33's prefill call passes ``kv_layout="vllm"``:
"K-linear/V-token-quad"); 0.34's CuTe writer (``_nvfp4_cache_views``) stores
the same. vLLM 0.32 ships neither ``fmha_sm100`` source (its installed tree
has only the docstring of ``nvfp4_kv_cache_views``), so the V-scale order is
not established there and the layout is refused on 0.32.

Index cache (0.34, ``MiniMaxM3IndexerNvfp4Backend``; MLA spec of 72 bytes,
one key per token): data ``64t + [0, 64)`` then linear scales
``8192 + 8t + g`` (``gather_nvfp4_index_k``: "64 B per token ... scales
token*8+group"), the values-then-scales page ``ops.indexer_cache`` describes.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvtail_connector import _compat
from kvtail_connector.ops.geometry import PageRegion, RegionCache, indexer_cache
from kvtail_connector.ops.ownership import regions_from_owner
from kvtail_connector.pages.flashinfer_nvfp4 import side_owner
from kvtail_connector.pages.layer import LayerPage
from kvtail_connector.pages.maps import PageCache, PageMap
from kvtail_connector.pages.minimax_m3 import indexer_role
from kvtail_connector.pages.plain import single_row
from kvtail_connector.pages.views import check_view

_M = "vllm.models.minimax_m3."
MAIN_BACKEND = _M + "nvidia.sparse_attention_msa.MiniMaxM3SparseMSANvfp4Backend"
INDEXER_BACKEND = _M + "nvidia.indexer_nvfp4.MiniMaxM3IndexerNvfp4Backend"

PAGE_TOKENS = 128  # fmha_sm100's only NVFP4 page size (nvfp4_head_slot_views)
DATA_BYTES = 64  # one token's 128 E2M1 values, two per byte
SCALE_BYTES = 8  # one token's E4M3 scales, one per 16 values
CELL_BYTES = DATA_BYTES + SCALE_BYTES  # nvfp4_kv_cache_full_dim(128)
SLOT_BYTES = PAGE_TOKENS * CELL_BYTES  # one head slot: all data, then all scales


def slot_owner(heads: int) -> np.ndarray:
    """The token owning each byte of one ``[2 * heads, 128, 72]`` main page:
    each head slot is a one-head FlashInfer NVFP4 side (data, then scales: K
    linear, V in the 4-token order)."""
    sides = [
        side_owner(1, PAGE_TOKENS, 128, hnd=True, swizzled=s % 2 == 1) for s in range(2 * heads)
    ]
    return np.concatenate(sides)


@functools.cache
def main_regions(heads: int) -> tuple[PageRegion, ...]:
    """The regions of one main page (offsets from the page start)."""
    half = DATA_BYTES * PAGE_TOKENS
    segments = [
        (slot * SLOT_BYTES + part, slot * SLOT_BYTES + part + length)
        for slot in range(2 * heads)
        for part, length in ((0, half), (half, SLOT_BYTES - half))
    ]
    return regions_from_owner(slot_owner(heads), PAGE_TOKENS, 1, segments)


def _packed(page: LayerPage, cell: int, heads: int) -> bool:
    """uint8 NVFP4 cells of ``cell`` bytes in ``heads`` head slots, no other
    packing; 128-value K and V."""
    return (
        page.quant_mode == "NVFP4"
        and page.field("dtype") == torch.uint8
        and page.field("head_size") == 128
        and page.field("head_size_v") == 128
        and page.field("num_head_slots") == heads
        and page.field("state_content_bytes") == cell
        and page.field("tokens_per_state", 1) == 1
    )


def _main_covers(page: LayerPage) -> bool:
    # 0.34 marks these slots head-major for NIXL's re-shard guard; 0.32/0.33
    # have no such field (the default here keeps them covered).
    return (
        _packed(page, CELL_BYTES, 2 * int(page.field("num_kv_heads", 0)))
        and page.field("kv_head_major_slots", True) is True
        and _compat.nvfp4_head_slot_layout_in_tree()
    )


def _main_hint(page: LayerPage) -> str | None:
    if _compat.nvfp4_head_slot_layout_in_tree():
        return None
    return (
        "MiniMax-M3 NVFP4 pages on vLLM 0.32: the order of their V block scales is defined "
        "only by fmha_sm100, which vLLM 0.32's source tree does not carry, so it cannot be "
        "established: serve MiniMax-M3 with --kv-cache-dtype fp8 or bfloat16 on vLLM 0.32, "
        "or use vLLM 0.33 or later"
    )


def _dense_rows(page: LayerPage, heads: int) -> torch.Tensor:
    """The view, once checked to be ``heads`` contiguous 128 x 72-byte slots
    per page (the one layout nvfp4_head_slot_views accepts)."""
    view = page.view
    check_view(page)
    shape, strides = tuple(view.shape[1:]), tuple(view.stride()[1:])
    expected = (SLOT_BYTES, CELL_BYTES, 1)
    if view.dtype != torch.uint8 or shape != (heads, PAGE_TOKENS, CELL_BYTES):
        raise ValueError(
            f"expected uint8 pages of {heads} slots x {PAGE_TOKENS} x {CELL_BYTES}, got "
            f"{view.dtype} {tuple(view.shape)}"
        )
    if strides[1:] != expected[1:] or (heads > 1 and strides[0] != expected[0]):
        raise ValueError(
            f"expected contiguous [{heads}, {PAGE_TOKENS}, {CELL_BYTES}] pages (the LBHNC "
            f"layout fmha_sm100 reads), got strides {tuple(view.stride())}"
        )
    return view


def _main_cache(page: LayerPage) -> PageCache:
    heads = int(page.field("num_kv_heads"))
    view = _dense_rows(page, 2 * heads)
    return RegionCache(view, PAGE_TOKENS, main_regions(heads))


def _indexer_covers(page: LayerPage) -> bool:
    """MiniMaxM3IndexerCache's NVFP4 spec: one 72-byte key per token, the
    quantization inside the cell (the spec's own quant mode is NONE)."""
    return (
        page.quant_mode == "NONE"
        and single_row(page)
        and indexer_role(page)
        and page.field("dtype") == torch.uint8
        and page.field("head_size") == CELL_BYTES
        and page.field("num_head_slots") is None
        and page.field("state_content_bytes") is None
    )


def _indexer_cache(page: LayerPage) -> PageCache:
    return indexer_cache(_dense_rows(page, 1), DATA_BYTES, SCALE_BYTES)


MAIN = PageMap(
    layout="MiniMax-M3 NVFP4 K/V head slots (data, then K-linear / V-token-quad scales)",
    backends=frozenset({MAIN_BACKEND}),
    covers=_main_covers,
    cache=_main_cache,
    hint=_main_hint,
)

INDEXER = PageMap(
    layout="MiniMax-M3 NVFP4 indexer keys (data, then linear scales)",
    backends=frozenset({INDEXER_BACKEND}),
    covers=_indexer_covers,
    cache=_indexer_cache,
)

MAPS = (MAIN, INDEXER)
