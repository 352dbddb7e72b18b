"""Qwen4-exp QSA: the sparse layer's K/V and its compressed key cache, plain
cells.

- ``QWEN4_EXP_QSA_TRITON`` (bf16/fp8): ``reshape_and_cache_flash`` into
  ``kv_cache.transpose(1, 2).split(D, -1)`` and ``qsa_prepare``'s main-cache
  store (``slot // PAGE * stride_block + slot % PAGE * stride_token +
  head * stride_head``): token ``n`` owns ``view[b, :, n, :]``. The backends
  declare ``supports_kv_connector() == False``, but the layer assigns its
  backend directly, so vLLM's selector never applies that (audit §4.1).
- ROCm Octave (0.33 on: ``octave_k3v4|k3v3|k3v3_compact``):
  ``RocmOctaveAttentionBackend.customize_spec`` makes each cell "one packed
  K+V slot per (token, KV head)", quantized from that token alone
  (``rocm_octave.reference_quantize``), addressed by block/head/token
  strides: still ``view[b, :, n, :]``.
- Compressed key cache (``QSACompressedKeyCache``, ``tokens_per_state =
  compress_ratio``): ``qsa_prepare`` stores group ``s`` of ``r`` tokens at
  ``view[b, 0, s, :]`` once its last token arrives (``compressed_qsa_slot_
  mapping``: only ``(position + 1) % r == 0``); the tail starts at state
  ``v // r`` (``tails.first_stale_slot`` floors).
- The raw-key ring (``QSAKeyStateCache`` / ``QSARawKeyCache``) is a
  ``CircularBufferSpec``: no tails (``kvgroups``), never mapped here.
"""

from __future__ import annotations

import torch

from kvtail_connector.pages.layer import LayerPage
from kvtail_connector.pages.maps import PageMap
from kvtail_connector.pages.plain import one_row_view, plain_view, unpacked
from kvtail_connector.pages.quantized import one_cell_per_head

_Q = "vllm.models.qwen4_exp."

MAIN_BACKENDS = frozenset(
    {
        _Q + "nvidia.qsa.Qwen4ExpQSAFlashAttentionBackend",  # 0.32, 0.33
        _Q + "amd.qsa.Qwen4ExpQSAFlashAttentionBackend",  # 0.32, 0.33
        _Q + "nvidia.qsa.Qwen4ExpQSABackend",  # 0.34
        _Q + "amd.qsa.Qwen4ExpQSABackend",  # 0.34
    }
)
# Only the ROCm classes take an Octave kv_cache_dtype (0.33, 0.34).
OCTAVE_BACKENDS = frozenset(
    {
        _Q + "amd.qsa.Qwen4ExpQSAFlashAttentionBackend",
        _Q + "amd.qsa.Qwen4ExpQSABackend",
    }
)
COMPRESSED_BACKENDS = frozenset(
    {
        _Q + "common.qsa_cache.QSAStateBackend",  # 0.32, 0.33
        _Q + "common.qsa_indexer.QSAIndexerBackend",  # 0.34
    }
)

# bf16, or the fp8 indexer's e4m3: float8_e4m3fn (NVIDIA), the platform's
# fp8_dtype() on ROCm 0.34 (amd/qsa_indexer.py: float8_e4m3fnuz on gfx942).
_COMPRESSED_DTYPES = frozenset({torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz})

# The Octave kv_cache_dtypes. KVQuantMode.CUSTOM (a plugin handler's mode) has
# OCTAVE_K3V4's value in 0.33/0.34, so the mode alone does not say Octave.
_OCTAVE_DTYPES = frozenset({"octave_k3v4", "octave_k3v3", "octave_k3v3_compact"})


def _main(page: LayerPage) -> bool:
    return (
        unpacked(page)
        and page.field("head_size") == page.field("head_size_v")
        and page.field("tokens_per_state", 1) == 1
    )


def _octave(page: LayerPage) -> bool:
    """RocmOctaveAttentionBackend.customize_spec's spec: one cell of
    ``state_content_bytes`` per (token, KV head), nothing else reshaped."""
    return (
        page.quant_mode.startswith("OCTAVE_")
        and page.kv_cache_dtype in _OCTAVE_DTYPES
        and one_cell_per_head(page)
    )


def _compressed(page: LayerPage) -> bool:
    """QSACompressedKeyCache.get_kv_cache_spec: one key row per group of
    ``tokens_per_state`` tokens, slot-mapped (the ring is not)."""
    return (
        unpacked(page)
        and page.field("num_kv_heads") == 1
        and page.field("head_size_v", 0) == 0
        and page.field("dtype") in _COMPRESSED_DTYPES
        and getattr(page.spec, "uses_slot_mapping", True)
    )


MAIN = PageMap(
    layout="Qwen4-exp QSA K/V, bf16/fp8 (plain cells)",
    backends=MAIN_BACKENDS,
    covers=_main,
    cache=plain_view,
)

OCTAVE = PageMap(
    layout="Qwen4-exp QSA K/V, ROCm Octave (one packed cell per token and KV head)",
    backends=OCTAVE_BACKENDS,
    covers=_octave,
    cache=plain_view,
)

COMPRESSED = PageMap(
    layout="Qwen4-exp QSA compressed keys (plain, one state per compress_ratio tokens)",
    backends=COMPRESSED_BACKENDS,
    covers=_compressed,
    cache=one_row_view,
)

MAPS = (MAIN, OCTAVE, COMPRESSED)
