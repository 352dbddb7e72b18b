"""MiniMax-M3 sparse attention: the bf16/fp8 pages that are plain cells, and
the layouts refused with the setting that works.

Every main-cache backend of a MiniMax-M3 sparse layer reports
``get_name() == "MINIMAX_M3_SPARSE"`` (and every indexer side cache
``"MINIMAX_M3_SPARSE_INDEXER"``) while the bytes inside a page differ by
platform and dtype, so the maps key on the class vLLM's selector returns
(``common/sparse_attention.py: select_main_backend_and_impl_cls``; the
indexer's ``indexer_backend_cls``). The NVIDIA NVFP4 pages, which are not
plain, are in :mod:`kvtail_connector.pages.minimax_m3_nvfp4`.
"""

from __future__ import annotations

import torch

from kvtail_connector.pages.layer import LayerPage
from kvtail_connector.pages.maps import PageMap
from kvtail_connector.pages.plain import one_row_view, plain_view, single_row, unpacked
from kvtail_connector.pages.refused import refused

_M = "vllm.models.minimax_m3."

# The Triton backend (Hopper, other CUDA, ROCm without AITER, fp8_e5m2) and
# the SM100 MSA backend for bf16/fp8 (vLLM 0.32-0.34, same paths). Writer:
# the fused QK-norm/RoPE/KV-insert op (``_custom_ops.fused_minimax_m3_qknorm_
# rope_kv_insert``, compiled; 0.34's docstring: it "stores exactly what
# reshape_and_cache_flash would"), and on 0.34 ROCm gfx942 without the HIP op
# ``triton_reshape_and_cache_flash`` into ``kv_cache.transpose(1, 2).split(128,
# -1)`` (amd/model.py ``_native_gfx942_qknorm_rope_cache``). Readers, every
# release: the Triton kernels (common/ops/sparse_attn.py: page*stride_kv_blk +
# head*stride_kv_h + n*stride_kv_pos + d, V at head_dim + d) and MSA's
# kv_cache.split(128, -1). Token n owns view[b, :, n, :]: K then V.
MAIN_BACKENDS = frozenset(
    {
        _M + "common.sparse_attention.MiniMaxM3SparseBackend",
        _M + "nvidia.sparse_attention_msa.MiniMaxM3SparseMSABackend",
    }
)

# The indexer side cache's bf16/fp8 backends: the Triton indexer (also its
# ROCm context-parallel impl) and the SM100 MSA indexer. The key is written by
# the same fused op, or by ``minimax_m3_insert_index_cache``
# (amd/ops/sparse_pa.py ``_insert_index_cache_kernel``, every release: block *
# stride_c_b + offset * stride_c_t + d of the bound [B, N, D] view); readers
# address the same rows. Token n owns view[b, 0, n, :].
INDEXER_BACKENDS = frozenset(
    {
        _M + "common.indexer.MiniMaxM3IndexerBackend",
        _M + "nvidia.indexer_msa.MiniMaxM3IndexerMSABackend",
    }
)

AITER_PA_BACKEND = _M + "amd.sparse_attention_msa.MiniMaxM3SparseAiterPABackend"
ROCM_NVFP4_BACKEND = _M + "amd.sparse_attention_nvfp4.MiniMaxM3SparseRocmNvfp4Backend"
# The ROCm indexers that run only beside the AITER sparse-PA attend (bf16/fp8
# index cache) or, in 0.34, the ROCm NVFP4 main cache: 0.32's AITER indexer,
# 0.33/0.34's MSA indexer (also the NVFP4 one's indexer_backend_cls).
ROCM_INDEXER_BACKENDS = frozenset(
    {
        _M + "amd.indexer_aiter.MiniMaxM3IndexerAiterBackend",
        _M + "amd.indexer_msa.MiniMaxM3IndexerMSABackend",
    }
)

HEAD_DIM = 128  # every MiniMax-M3 sparse backend's only head size

# The index cache dtypes of MiniMaxM3IndexerCache: bf16, and the platform's
# e4m3 for "fp8"/"fp8_e4m3" (float8_e4m3fnuz on ROCm gfx942, 0.34).
_INDEX_DTYPES = frozenset({torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz})

SHUFFLE_OFF = (
    "set VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT=0 and serve with a bf16 or fp8 --kv-cache-dtype "
    'and a bf16 index cache (attention_config indexer_kv_dtype "bf16", the default), so '
    "MiniMax-M3 uses its Triton sparse backend and Triton indexer, whose pages are mapped"
)


def _main_plain(page: LayerPage) -> bool:
    """The FullAttentionSpec MiniMaxM3SparseAttention.get_kv_cache_spec makes
    for a bf16/fp8 cache: K and V of 128 each, one cell per KV head."""
    return (
        unpacked(page)
        and page.field("head_size") == HEAD_DIM
        and page.field("head_size_v") == HEAD_DIM
        and page.field("tokens_per_state", 1) == 1
    )


def indexer_role(page: LayerPage) -> bool:
    """The spec is an index side cache's: ``MiniMaxM3IndexerCache.
    get_kv_cache_spec`` sets ``cache_role=SparseCacheRole.INDEXER`` (0.32-0.34)."""
    return getattr(page.field("cache_role"), "name", None) == "INDEXER"


def _indexer_plain(page: LayerPage) -> bool:
    """MiniMaxM3IndexerCache's bf16/fp8 spec: one key-only 128-wide row per token."""
    return (
        unpacked(page)
        and single_row(page)
        and indexer_role(page)
        and page.field("head_size") == HEAD_DIM
        and page.field("dtype") in _INDEX_DTYPES
    )


MAIN_PLAIN = PageMap(
    layout="MiniMax-M3 sparse K/V, bf16/fp8 (plain cells)",
    backends=MAIN_BACKENDS,
    covers=_main_plain,
    cache=plain_view,
)

INDEXER_PLAIN = PageMap(
    layout="MiniMax-M3 indexer keys, bf16/fp8 (plain rows)",
    backends=INDEXER_BACKENDS,
    covers=_indexer_plain,
    cache=one_row_view,
)


AITER_PA_REFUSED = refused(
    "MiniMax-M3 AITER sparse paged attention",
    {AITER_PA_BACKEND},
    "its 16-token shuffled pages are written by AITER's reshape_and_cache(asm_layout=True) "
    "or its fused QK-norm op, whose addressing is not in vLLM's source, so which bytes a "
    "token owns cannot be established: " + SHUFFLE_OFF,
)

ROCM_NVFP4_REFUSED = refused(
    "MiniMax-M3 ROCm NVFP4 (gfx950)",
    {ROCM_NVFP4_BACKEND},
    "every V data byte packs the E2M1 nibbles of two consecutive tokens "
    "(amd/ops/norm_rope_nvfp4_insert), so a tail that starts at an odd slot shares a byte "
    "with a valid token and no byte-wise zeroing is exact: serve MiniMax-M3 with "
    "--kv-cache-dtype fp8 or bfloat16 (with " + SHUFFLE_OFF + ")",
)

ROCM_INDEXER_REFUSED = refused(
    "MiniMax-M3 ROCm AITER/MSA indexer",
    ROCM_INDEXER_BACKENDS,
    "this indexer runs only beside the AITER sparse-PA attend, whose fused AITER op may "
    "write the index cache in a way vLLM's source does not show, or beside the ROCm NVFP4 "
    "main cache (refused: two tokens per V byte): " + SHUFFLE_OFF,
)

MAPS = (MAIN_PLAIN, INDEXER_PLAIN, AITER_PA_REFUSED, ROCM_NVFP4_REFUSED, ROCM_INDEXER_REFUSED)
