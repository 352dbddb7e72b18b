"""Kimi K3's KV-balanced MLA decode backend (vLLM 0.34): plain latent rows.

``KIMI_K3_KV_BALANCED_MLA`` (selected only by ``--attention-backend``) reads
an fp8 cache of 576 values per token (``kv_lora_rank + rope``), one row per
token, in pages of 32 or 64 (``get_supported_kernel_block_sizes``); its
``MLAAttentionSpec`` is the K3 MLA layer's own (no ``customize_spec``). The
rows are written by ``concat_and_cache_mla`` (MLACommonImpl) or Kimi's fused
epilogue ``fused_mla_qkv_quant_kv_cache_fp8_insert`` ("insert the fp8 latent
into the paged cache" ``[num_blocks, block_size, 576]`` at ``slot_mapping``),
so token ``n`` owns ``view[b, 0, n, :]``. Its other MLA backends are vLLM's
generic ones (``plain``); K3.1's DSA indexer (``KimiK3IndexerBackend``) uses
the DeepSeek V3.2 indexer page and is mapped with it.
"""

from __future__ import annotations

from kvtail_connector.pages.layer import LayerPage
from kvtail_connector.pages.maps import PageMap
from kvtail_connector.pages.plain import plain_view, single_row, unpacked

KV_BALANCED_BACKEND = (
    "vllm.models.kimi_k3.nvidia.kv_balanced_mla.backend.KimiK3KvBalancedMLABackend"
)
LATENT_ROW = 576  # kv_lora_rank 512 + rope 64 (kv_balanced_mla.decode: LATENT, ROPE)


def _covers(page: LayerPage) -> bool:
    """The K3 MLA spec for an fp8 (per-tensor scale) cache, not fp8_ds_mla."""
    return (
        unpacked(page)
        and single_row(page)
        and page.quant_mode == "FP8_PER_TENSOR"
        and page.field("head_size") == LATENT_ROW
    )


KV_BALANCED = PageMap(
    layout="Kimi K3 KV-balanced MLA latent rows, fp8 (plain)",
    backends=frozenset({KV_BALANCED_BACKEND}),
    covers=_covers,
    cache=plain_view,
)

MAPS = (KV_BALANCED,)
