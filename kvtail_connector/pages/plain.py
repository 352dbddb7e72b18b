"""Plain pages: token slot ``n`` owns exactly ``view[b, :, n, :]``.

Only for the backends audited to write and read their pages through the view
vLLM allocates (their writers store token ``n`` of a page at index ``n`` of
the view's N dim, every head slot of it, and no other bytes), and only for
specs that reshape nothing: no packed cells, no head slots other than the KV
heads, no head-major packing, and a quant mode that stores each element in
place (none, or per-tensor fp8). Anything else needs its own map.
"""

from __future__ import annotations

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
        _B + "triton_attn.TritonAttentionBackend",
        _B + "triton_flash_attn.TritonFlashAttentionBackend",
        _B + "triton_flashinfer.TritonFlashInferBackend",
        _B + "flashinfer.FlashInferBackend",
        _B + "flashinfer_ts.FlashInferTSBackend",
        _B + "flash_attn_diffkv.FlashAttentionDiffKVBackend",
        _B + "triton_attn_diffkv.TritonAttentionDiffKVBackend",
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

# Plain with the backend's own writer, but on ROCm vLLM may hand the pages to
# AITER's fused QK-norm + RoPE + KV insert, whose addressing of a strided page
# vLLM's source does not show: refused while that pass is on.
ROCM_AITER_BACKENDS = frozenset(
    {
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


def plain_view(page: LayerPage) -> PageCache:
    check_view(page)
    return page.view


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

FUSED_WRITER_HINT = (
    "turn off vLLM's fused QK-norm/RoPE/KV-cache pass "
    '(--compilation-config \'{"pass_config": {"fuse_qk_norm_rope_kvcache": false}}\'), '
    "whose AITER op writes these pages in a way vLLM's source does not show"
)


def fused_writer_hint(page: LayerPage) -> str | None:
    return FUSED_WRITER_HINT if page.engine.fused_kv_writer else None


ROCM_AITER_PLAIN = PageMap(
    layout="plain cells, ROCm AITER without the fused QK-norm/RoPE/KV writer",
    backends=ROCM_AITER_BACKENDS,
    covers=lambda page: unpacked(page) and not page.engine.fused_kv_writer,
    cache=plain_view,
    hint=fused_writer_hint,
)

AMX_MLA_PLAIN = PageMap(
    layout="plain cells, dense pages (AMX_MLA)",
    backends=frozenset({AMX_MLA_BACKEND}),
    covers=unpacked,
    cache=_dense_pages_view,
)

MAPS = (PLAIN, ROCM_AITER_PLAIN, AMX_MLA_PLAIN)
