"""dots3_note's NOTE attention (NVIDIA): MLA latent rows, plain cells.

- ``DOTS3_NOTE_PADDED_MLA_SPARSE`` (``Dots3NotePaddedSparseBackend``, a
  FLASH_ATTN_MLA_SPARSE subclass; bf16/fp16): the DSA layer's rows are padded
  to the SWA layers' latent width (``head_size = physical_head_size``) so
  both share one page size. Its ``do_kv_cache_update`` writes each token's
  latent into ``kv_cache[..., :logical head_size]`` (``_logical_cache``) of
  its own row, and the kernels read the same slice: token ``n`` owns
  ``view[b, 0, n, :]``, whose last ``physical - logical`` elements nothing
  writes or reads.
- The NOTE SWA layers' ``Dots3NoteTritonMLABackend`` is TRITON_MLA with its
  own impl (``concat_and_cache_mla`` rows; ``_forward_swa_mqa`` reads rows by
  the cache's block/token strides): the same plain rows.

The DSA indexer (``DeepseekV2MLAAttention``'s ``DeepseekV32IndexerCache``,
backend ``DEEPSEEK_V32_INDEXER``) is the DeepSeek V3.2 indexer page, mapped
with the DeepSeek family.
"""

from __future__ import annotations

from kvtail_connector.pages.layer import LayerPage
from kvtail_connector.pages.maps import PageMap
from kvtail_connector.pages.plain import plain_view, single_row, unpacked

_A = "vllm.models.dots3_note.nvidia.attention."
PADDED_BACKEND = _A + "Dots3NotePaddedSparseBackend"  # 0.32-0.34
SWA_BACKEND = _A + "Dots3NoteTritonMLABackend"  # 0.32-0.34
SWA_HEAD_SIZE = 1088  # Dots3NoteTritonMLABackend.get_supported_head_sizes


def _latent_rows(page: LayerPage) -> bool:
    """An MLA spec: one latent row per token, nothing packed."""
    return unpacked(page) and single_row(page)


PADDED = PageMap(
    layout="dots3_note padded sparse MLA rows (plain, padded)",
    backends=frozenset({PADDED_BACKEND}),
    covers=lambda page: _latent_rows(page) and page.quant_mode == "NONE",
    cache=plain_view,
)

SWA = PageMap(
    layout="dots3_note NOTE SWA MLA rows (plain)",
    backends=frozenset({SWA_BACKEND}),
    covers=lambda page: _latent_rows(page) and page.field("head_size") == SWA_HEAD_SIZE,
    cache=plain_view,
)

MAPS = (PADDED, SWA)
