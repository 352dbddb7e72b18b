"""Step5 (vLLM 0.33 on): the DSA layer's K/V and its region summaries, plain
cells.

- ``STEP5_DSA`` (``Step5DSAAttentionBackend``, a FLASH_ATTN subclass whose
  ``customize_spec`` only sets ``block_stride_alignment``): FLASH_ATTN's
  writer stores token ``n`` into ``kv_cache.transpose(1, 2).split(192, -1)``
  (``do_kv_cache_update``), the impl reads the same split; token ``n`` owns
  ``view[b, :, n, :]``.
- ``STEP5_CSA_SUMMARY`` (``tokens_per_state=8``): ``_store_summary`` writes
  the 256-byte FP8 summary of tokens ``8s .. 8s+7`` at ``view[b, 0, s, :]``
  (``slot // BLOCK_SIZE * MEAN_BLOCK + slot % BLOCK_SIZE // 8 * 256``), once,
  when the eighth token arrives; a partially loaded region has no summary, so
  the tail starts at state ``v // 8`` (``tails.first_stale_slot`` floors).
  0.34 on ROCm gives the summaries their own group (``Step5CSABackend``),
  same spec and writer.
- ``STEP5_CSA_TAIL_RING`` is a ``CircularBufferSpec`` (no slot mapping): its
  group has no tails (``kvgroups``), so it never reaches a page map.
"""

from __future__ import annotations

import torch

from kvtail_connector.pages.layer import LayerPage
from kvtail_connector.pages.maps import PageMap
from kvtail_connector.pages.plain import plain_view, unpacked
from kvtail_connector.pages.views import dense_rows

_S = "vllm.models.step5."

DSA_BACKEND = _S + "nvidia.sparse_attention.Step5DSAAttentionBackend"  # 0.33, 0.34
SUMMARY_BACKENDS = frozenset(
    {
        _S + "nvidia.sparse_summary_cache.Step5SparseSummaryBackend",  # 0.33
        _S + "common.sparse_summary_cache.Step5SparseSummaryBackend",  # 0.34
        _S + "amd.csa_cache.Step5CSABackend",  # 0.34, ROCm
    }
)

DSA_HEAD_SIZE = 192  # Step5DSAAttentionBackend.supports_head_size
REGION_TOKENS = 8  # tokens one summary covers
SUMMARY_BYTES = 256  # one FP8 summary


def _dsa(page: LayerPage) -> bool:
    return (
        unpacked(page)
        and page.field("head_size") == DSA_HEAD_SIZE
        and page.field("head_size_v") == DSA_HEAD_SIZE
        and page.field("tokens_per_state", 1) == 1
    )


def _summary(page: LayerPage) -> bool:
    """Step5SparseSummaryCacheLayer.get_kv_cache_spec: one 256-byte row per
    eight tokens."""
    return (
        unpacked(page)
        and page.field("num_kv_heads") == 1
        and page.field("head_size") == SUMMARY_BYTES
        and page.field("head_size_v") == 0
        and page.field("dtype") == torch.uint8
        and page.field("tokens_per_state") == REGION_TOKENS
    )


DSA = PageMap(
    layout="Step5 DSA K/V (plain cells)",
    backends=frozenset({DSA_BACKEND}),
    covers=_dsa,
    cache=plain_view,
)

SUMMARY = PageMap(
    layout="Step5 CSA region summaries (plain, one state per 8 tokens)",
    backends=SUMMARY_BACKENDS,
    covers=_summary,
    cache=dense_rows,  # summary_layout() asserts the same of the bound [B, R, 256] view
)

MAPS = (DSA, SUMMARY)
