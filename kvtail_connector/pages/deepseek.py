"""DeepSeek V3.2 / V4 / V4.1 pages (vLLM 0.32-0.34): latent rows, packed
records with their scales apart, the compressor's state rows and the sparse
indexer's keys.

- V3.2 ``FLASHMLA_SPARSE``: one 576-value latent row per token, stored as
  ``fp8_ds_mla`` (656 B: 512 fp8 NoPE, 4 fp32 scales, 64 bf16 RoPE),
  ``nvfp4_ds_mla`` (352 B) or bf16. The writer (``deepseek_v32/common/
  kernels.py`` ``_fused_norm_rope_kernel``; ``concat_and_cache_mla`` under
  HiSparse) stores token ``n`` at ``block * stride(0) + n * stride(1)`` of the
  bound ``[B, N, C]`` cache and FlashMLA reads the same rows
  (``sparse_utils.flat_kv_row_view``): token ``n`` owns ``view[b, 0, n, :]``.
- V4 record (584 B; V4 everywhere, V4.1 off SM100): a page is
  ``[N x 576 data][N x 8 UE8M0 scales][pad]`` (``cache_utils.
  quantize_and_insert_k_kernel``, the compressor's ``_fused_kv_compress_norm_
  rope_insert_sparse_attn``, V4.1's ``_rope_quant_insert_kernel``, and the
  gathers that read it back: data at ``n * 576``, scales at
  ``N * 576 + n * 8``, N the bound cache's block). The padding is no token's.
- V4.1 records on SM100 (528 B MXFP8, 288 B NVFP4 compressed): split like V4
  on 0.32 (``[N x 512][N x 16]``, ``[N x 256][N x 32]``), one row per token
  on 0.33/0.34 (``_compat.deepseek_v41_records_interleaved``).
- Compressed caches (``tokens_per_state`` r > 1): the writers store state
  ``s`` only when its last token arrives (``(position + 1) % r == 0``), so a
  tail starts at state ``v // r`` (``tails.first_stale_slot``).
- V4 compressor state (``CompressorStateCache``, fp32): ``save_partial_states``
  stores token ``n``'s whole ``[kv | score]`` row at ``block * stride0 + n *
  stride1``: plain rows. (V4.1's compressor keeps a ring; not mapped.)
- Indexer keys (V3.2, V4, V4.1, Kimi K3, dots3_note): ``[N x D][N x 4]``
  values then scales, fp8 (132 B: 128 values, one fp32 or packed-UE8M0 scale)
  or MXFP4 (68 B: 64 packed values, 4 UE8M0 scales): ``_fp8_quant_and_cache_
  write``, ``_fused_kv_compress_norm_rope_insert_indexer(_mxfp4)_attn``,
  ``indexer_k_store``, Kimi's ``_index_k_insert`` / ``mxfp4_k_norm_quant_
  insert``. ROCm tiles the values 16 x 16 once a page holds more than one key
  (``SHUFFLE``): refused there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtail_connector import _compat
from kvtail_connector.ops.geometry import indexer_cache
from kvtail_connector.pages.layer import LayerPage
from kvtail_connector.pages.maps import PageCache, PageMap
from kvtail_connector.pages.refused import refused
from kvtail_connector.pages.views import dense_rows

_MLA = "vllm.v1.attention.backends.mla."
_V4 = "vllm.models.deepseek_v4."
_V41 = "vllm.models.deepseek_v41."

# Every class path below exists in 0.32, 0.33 and 0.34 unless marked.
V32_BACKEND = _MLA + "flashmla_sparse.FlashMLASparseBackend"
SWA_BACKEND = _MLA + "sparse_swa.DeepseekSparseSWABackend"  # default SWA (CPU, XPU, ROCm V4)
COMPRESSOR_BACKEND = _V4 + "compressor.CompressorBackend"
_V41_RECORD_LAYERS = frozenset(
    {
        _V41 + "sparse_mla.DeepseekV4FlashMLABackend",
        _V41 + "sparse_mla.FlashMLAMegaAttnBackend",
        _V41 + "nvidia.flashmla.DeepseekSparseSWAFlashMLABackend",
        SWA_BACKEND,
    }
)
V4_RECORD_BACKENDS = _V41_RECORD_LAYERS | {
    _V4 + "sparse_mla.DeepseekV4FlashMLABackend",
    _V4 + "nvidia.flashmla.DeepseekSparseSWAFlashMLABackend",
    _V4 + "cpu.cpu_mla.DeepseekV4CPUSparseBackend",
}
V41_RECORD_BACKENDS = _V41_RECORD_LAYERS
# DeepseekV32IndexerCache and its subclasses publish SparseCacheRole.INDEXER;
# the V4/V4.1 indexer caches keep the default role.
V32_INDEXER_BACKENDS = frozenset(
    {
        _MLA + "indexer.DeepseekV32IndexerBackend",  # V3.2, dots3_note, Mistral (0.34)
        "vllm.models.kimi_k3.common.dsa_cache.KimiK3IndexerBackend",  # 0.34
    }
)
V4_INDEXER_BACKENDS = frozenset(
    {
        _MLA + "indexer.DeepseekV4IndexerBackend",
        _MLA + "indexer.DeepseekV41IndexerBackend",
        _MLA + "sparse_indexer.DeepseekV41SparseIndexerBackend",
        _V4 + "cpu.cpu_mla.DeepseekV4CPUIndexerBackend",
    }
)
ROCM_MXFP4_INDEXER = _MLA + "rocm_paged_mxfp4_indexer.DeepseekV41RocmMxfp4IndexerBackend"

LATENT = 576  # V3.2: kv_lora_rank 512 + RoPE 64
V4_HEAD = 512  # V4: 448 NoPE + 64 RoPE ("head_size stays semantic")
SCALE_BYTES = 4  # an indexer key's scale bytes (one fp32, or 4 UE8M0)
INDEXER_KEYS = (128 + SCALE_BYTES, 64 + SCALE_BYTES)  # fp8, MXFP4
# 2 * coff * head_dim: c4 (coff 2) and c128 (coff 1) of the 512 latent, c4 indexer.
STATE_ROWS = (2048, 1024, 512)

# (cache_dtype_str, kv_quant_mode, dtype, state_content_bytes) of V3.2's row.
_V32_ROWS = frozenset(
    {
        ("fp8_ds_mla", "FP8_PER_TENSOR", torch.uint8, 656),
        ("nvfp4_ds_mla", "NVFP4_DS_MLA", torch.uint8, 352),
        ("auto", "NONE", torch.bfloat16, None),
        ("bfloat16", "NONE", torch.bfloat16, None),
    }
)
_DS_MLA_MODES = {"fp8_ds_mla": "FP8_PER_TENSOR", "nvfp4_ds_mla": "NVFP4_DS_MLA"}
V4_SPLIT = (576, 8)  # the V4 record: data bytes, scale bytes
V41_SPLIT = {528: (512, 16), 288: (256, 32)}  # the V4.1 records on 0.32
# V4.1 record -> the cache dtypes that write it (the SWA record stays MXFP8).
_V41_DTYPES = {528: ("fp8_ds_mla", "nvfp4_ds_mla"), 288: ("nvfp4_ds_mla",)}


def _role(page: LayerPage) -> str | None:
    role = page.field("cache_role")
    return None if role is None else str(getattr(role, "value", role))


def _one_row(page: LayerPage) -> bool:
    """One MLA row per state, no head slots, tokens_per_state an int."""
    return (
        page.field("num_kv_heads") == 1
        and page.field("head_size_v", 0) == 0
        and page.field("num_head_slots") is None
        and not page.field("kv_head_major_slots", False)
        and type(page.field("tokens_per_state", 1)) is int
    )


def _v32_latent(page: LayerPage) -> bool:
    """MLAAttention.get_kv_cache_spec for a V3.2 sparse layer."""
    row = (
        page.field("cache_dtype_str"),
        page.quant_mode,
        page.field("dtype"),
        page.field("state_content_bytes"),
    )
    return (
        _one_row(page)
        and page.field("head_size") == LATENT
        and row in _V32_ROWS
        and page.field("tokens_per_state", 1) == 1
        and page.field("model_version") is None
        and _role(page) in (None, "sparse")
    )


def _packed_record(page: LayerPage, record: int, dtypes: tuple[str, ...]) -> bool:
    """DeepseekV4SWACache's / DeepseekV4Attention's packed spec."""
    cache_dtype = page.field("cache_dtype_str")
    return (
        _one_row(page)
        and page.field("head_size") == V4_HEAD
        and page.field("dtype") == torch.uint8
        and page.field("state_content_bytes") == record
        and cache_dtype in dtypes
        and page.quant_mode == _DS_MLA_MODES[cache_dtype]
        and page.field("model_version") == "deepseek_v4"
        and _role(page) in (None, "sparse")
        and page.field("tokens_per_state", 1) >= 1
    )


def _v41_record(page: LayerPage) -> bool:
    record = page.field("state_content_bytes")
    return record in _V41_DTYPES and _packed_record(page, record, _V41_DTYPES[record])


def _compressor_state(page: LayerPage) -> bool:
    """CompressorStateCache.get_kv_cache_spec: fp32 ``[kv | score]`` rows."""
    return (
        _one_row(page)
        and page.field("head_size") in STATE_ROWS
        and page.field("dtype") == torch.float32
        and page.quant_mode == "NONE"
        and page.field("state_content_bytes") is None
        and page.field("tokens_per_state", 1) == 1
        and page.field("model_version") is None
    )


def on_rocm() -> bool:
    """Whether this process runs vLLM's ROCm platform (tiled indexer keys)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_rocm())


def _tiled(page: LayerPage) -> bool:
    # ROCm writers tile the values once a page holds more than one key
    # (DeepseekV32ROCmIndexerCache.uses_shuffled_layout, indexer_k_store's
    # ``is_rocm() and block_size > 1``, indexer_k_quant_and_cache_triton).
    return page.view.dim() == 4 and int(page.view.shape[2]) > 1 and on_rocm()


def _indexer(role: str) -> Callable[[LayerPage], bool]:
    def covers(page: LayerPage) -> bool:
        """An indexer key cache: uint8 keys of 132 (fp8) or 68 (MXFP4) bytes."""
        return (
            _one_row(page)
            and page.field("head_size") in INDEXER_KEYS
            and page.field("dtype") == torch.uint8
            and page.quant_mode == "NONE"
            and page.field("state_content_bytes") is None
            and page.field("model_version") is None
            and _role(page) == role
            and not _tiled(page)
        )

    return covers


def _split(page: LayerPage, data: int, scales: int, whole_blocks: bool) -> PageCache:
    """``[N x data][N x scales]`` pages. The writers address scales at
    ``N * data`` from the page start, N their cache block: the view's N, which
    with ``whole_blocks`` (the SWA insert takes the spec's block) must be the
    spec's, i.e. pages not split into kernel blocks."""
    view = dense_rows(page)
    if view.dtype != torch.uint8:
        raise ValueError(f"expected a uint8 view of packed records, got {view.dtype}")
    n, states = int(view.shape[2]), int(getattr(page.spec, "num_states", view.shape[2]))
    if whole_blocks and n != states:
        raise ValueError(
            f"the view's pages hold {n} records but the writer addresses scales after "
            f"{states} (the spec's block): kernel-block splitting would misplace them"
        )
    return indexer_cache(view, data, scales)


def _v41_cache(page: LayerPage) -> PageCache:
    if _compat.deepseek_v41_records_interleaved():
        return dense_rows(page)
    data, scales = V41_SPLIT[int(page.field("state_content_bytes"))]
    return _split(page, data, scales, whole_blocks=True)


def _indexer_cache(page: LayerPage) -> PageCache:
    return _split(page, int(page.field("head_size")) - SCALE_BYTES, SCALE_BYTES, False)


TILED_HINT = (
    "on ROCm a page of more than one indexer key holds its values tiled 16 x 16 "
    "(SHUFFLE), a layout the wrapper does not map"
)


def _indexer_hint(page: LayerPage) -> str | None:
    return TILED_HINT if _tiled(page) else None


V32_ROWS = PageMap(
    layout="DeepSeek V3.2 FLASHMLA_SPARSE latent rows, fp8_ds_mla/nvfp4_ds_mla/bf16 (plain)",
    backends=frozenset({V32_BACKEND}),
    covers=_v32_latent,
    cache=dense_rows,
)

V4_RECORDS = PageMap(
    layout="DeepSeek V4 fp8_ds_mla records, 584 B (data then scales per page)",
    backends=V4_RECORD_BACKENDS,
    covers=lambda page: _packed_record(page, 584, ("fp8_ds_mla",)),
    cache=lambda page: _split(page, *V4_SPLIT, whole_blocks=True),
)

V41_RECORDS = PageMap(
    layout="DeepSeek V4.1 records, 528 B MXFP8 / 288 B NVFP4 (0.32 split, 0.33+ rows)",
    backends=V41_RECORD_BACKENDS,
    covers=_v41_record,
    cache=_v41_cache,
)

COMPRESSOR_STATE = PageMap(
    layout="DeepSeek V4 compressor state rows, fp32 (plain)",
    backends=frozenset({COMPRESSOR_BACKEND}),
    covers=_compressor_state,
    cache=dense_rows,
)

V32_INDEXER = PageMap(
    layout="DeepSeek V3.2 indexer keys, fp8/MXFP4 (values then scales)",
    backends=V32_INDEXER_BACKENDS,
    covers=_indexer("indexer"),
    cache=_indexer_cache,
    hint=_indexer_hint,
)

V4_INDEXER = PageMap(
    layout="DeepSeek V4/V4.1 indexer keys, fp8/MXFP4 (values then scales)",
    backends=V4_INDEXER_BACKENDS,
    covers=_indexer("sparse"),
    cache=_indexer_cache,
    hint=_indexer_hint,
)

ROCM_MXFP4_REFUSED = refused(
    "DeepSeek V4.1 ROCm paged MXFP4 indexer",
    {ROCM_MXFP4_INDEXER},
    "AITER's paged MXFP4 kernels write and read this cache in place, in a layout "
    "vLLM's source does not show, so which bytes a key owns cannot be established "
    "(the fp8 indexer keys are tiled on ROCm too, and not mapped either)",
)

MAPS = (
    V32_ROWS,
    V4_RECORDS,
    V41_RECORDS,
    COMPRESSOR_STATE,
    V32_INDEXER,
    V4_INDEXER,
    ROCM_MXFP4_REFUSED,
)
