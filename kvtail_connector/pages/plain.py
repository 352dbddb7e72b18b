"""Plain pages: token slot ``n`` owns exactly ``view[b, :, n, :]``.

Only for the backends audited to write and read their pages through the view
vLLM allocates (their writers store token ``n`` of a page at index ``n`` of
the view's N dim, every head slot of it, and no other bytes), and only for
specs that reshape nothing: no packed cells, no head slots other than the KV
heads, no head-major packing, and a quant mode that stores each element in
place (none, or per-tensor fp8). Anything else needs its own map.
"""

from __future__ import annotations

import torch

from kvtail_connector.pages.layer import LayerPage
from kvtail_connector.pages.maps import PageCache, PageMap
from kvtail_connector.pages.views import check_view

_B = "vllm.v1.attention.backends."

# Backends whose own writers store token n of a page at index n of the view's
# N dim, all of it and nothing else, for unpacked specs (vLLM 0.32-0.34; the
# audit and its sources: docs/compatibility.md, "Page layouts"). Keyed by class:
# ROCm's AITER FlashAttention backend reports "FLASH_ATTN".
PLAIN_BACKENDS = frozenset(
    {
        _B + "flash_attn.FlashAttentionBackend",
        _B + "flex_attention.FlexAttentionBackend",
        _B + "triton_flash_attn.TritonFlashAttentionBackend",
        _B + "triton_flashinfer.TritonFlashInferBackend",
        _B + "flashinfer.FlashInferBackend",
        _B + "flashinfer_ts.FlashInferTSBackend",
        _B + "flash_attn_diffkv.FlashAttentionDiffKVBackend",
        _B + "hpc_attn.HpcAttentionBackend",
        _B + "mla.flashmla.FlashMLABackend",
        _B + "mla.flashinfer_mla.FlashInferMLABackend",
        _B + "mla.cutlass_mla.CutlassMLABackend",
        _B + "mla.triton_mla.TritonMLABackend",
        _B + "mla.flashattn_mla.FlashAttnMLABackend",
        _B + "mla.flashattn_mla.XPUFlashAttnMLABackend",
        _B + "mla.rocm_aiter_mla.AiterMLABackend",
        _B + "mla.aiter_triton_mla.AiterTritonMLABackend",
        _B + "mla.tokenspeed_mla.TokenspeedMLABackend",
        _B + "mla.cpu_mla.CPUMLABackend",
        "vllm.model_executor.models.extract_hidden_states.CacheOnlyAttentionBackend",
        "vllm.models.step5.nvidia.sparse_attention.Step5SplitKVFlashAttentionBackend",
    }
)

# Plain with the backend's own writer, but on ROCm vLLM's compiled graph may
# hand the writes to a fused AITER op (QK-norm/RoPE/KV insert, or RoPE/KV insert
# through the impl's do_rope_and_kv_cache_update), whose addressing of a strided
# page vLLM's source does not show: refused while such a pass is on.
FUSABLE_BACKENDS = frozenset(
    {
        _B + "triton_attn.TritonAttentionBackend",
        _B + "triton_attn_diffkv.TritonAttentionDiffKVBackend",
        _B + "rocm_aiter_fa.AiterFlashAttentionBackend",
        _B + "rocm_aiter_unified_attn.RocmAiterUnifiedAttentionBackend",
    }
)

# AMX_MLA's CPU writer addresses row ``slot`` at ``slot * stride(N)`` from the
# cache's start, ignoring the page stride: plain only where pages are dense.
AMX_MLA_BACKEND = _B + "mla.amx_mla.AMXMLABackend"

# Quant modes that keep each element in its cell (no scales beside the data).
IN_PLACE_MODES = frozenset({"NONE", "FP8_PER_TENSOR"})


def unpacked(page: LayerPage) -> bool:
    """The spec reshapes nothing: one cell per KV head (or the MLA latent),
    no packed content, no head-major slots, elements stored in place."""
    return (
        page.quant_mode in IN_PLACE_MODES
        and page.field("num_head_slots") is None
        and page.field("state_content_bytes") is None
        and not page.field("kv_head_major_slots", False)
    )


def kv_planes(page: LayerPage) -> bool:
    """K and V published as two head slots of ``Hkv * D`` elements each (a
    ``[N, Hkv*D]`` plane per side), elements stored in place."""
    heads, head_size = int(page.field("num_kv_heads", 0)), int(page.field("head_size", 0))
    dtype = page.field("dtype")
    elem = dtype.itemsize if isinstance(dtype, torch.dtype) else 0
    return (
        page.quant_mode in IN_PLACE_MODES
        and page.field("num_head_slots") == 2
        and page.field("state_content_bytes") == heads * head_size * elem
        and not page.field("kv_head_major_slots", False)
    )


def single_row(page: LayerPage) -> bool:
    """One row per token and no V: a single KV head (an MLA latent, an index key)."""
    return (
        page.field("num_kv_heads") == 1
        and page.field("head_size_v", 0) == 0
        and page.field("tokens_per_state", 1) == 1
    )


def plain_view(page: LayerPage) -> PageCache:
    check_view(page)
    return page.view


def one_row_view(page: LayerPage) -> PageCache:
    """The view, where token ``n`` owns one row ``view[b, 0, n, :]`` (a
    single head slot: a key row, a latent, a compressed state)."""
    check_view(page)
    view = page.view
    if view.shape[1] != 1:
        raise ValueError(f"expected one head slot (a row per token), got {tuple(view.shape)}")
    return view


def _dense_pages_view(page: LayerPage) -> PageCache:
    _, slots, _ = check_view(page)
    view = page.view
    if view.stride(0) != slots * view.stride(2) or view.shape[1] != 1:
        raise ValueError(
            f"AMX_MLA writes row slot at slot * {view.stride(2)} elements from the cache's "
            f"start, which is not this view's page stride {view.stride(0)} (a block-outermost "
            "layout); use the default KV cache layout"
        )
    return view


PLAIN = PageMap(
    layout="plain cells (token n owns view[b, :, n, :])",
    backends=PLAIN_BACKENDS,
    covers=unpacked,
    cache=plain_view,
)


def fused_writer_hint(page: LayerPage) -> str | None:
    """The setting that gives the backend its own writer back, where a fused
    AITER writer is on."""
    setting = page.engine.fused_kv_writer
    if setting is None:
        return None
    return (
        "vLLM's compiled graph writes these pages with a fused AITER op whose addressing "
        f"of the page vLLM's source does not show; turn that off ({setting})"
    )


OWN_WRITER_PLAIN = PageMap(
    layout="plain cells, written by the backend's own writer (no fused AITER writer)",
    backends=FUSABLE_BACKENDS,
    covers=lambda page: unpacked(page) and page.engine.fused_kv_writer is None,
    cache=plain_view,
    hint=fused_writer_hint,
)

AMX_MLA_PLAIN = PageMap(
    layout="plain cells, dense pages (AMX_MLA)",
    backends=frozenset({AMX_MLA_BACKEND}),
    covers=unpacked,
    cache=_dense_pages_view,
)

MAPS = (PLAIN, OWN_WRITER_PLAIN, AMX_MLA_PLAIN)
