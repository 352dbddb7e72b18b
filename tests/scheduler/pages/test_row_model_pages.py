"""Pages of one row (or cell per head) per token, some with unwritten
padding: Inkling's conv window (``pages/inkling.py``), Kimi K3's KV-balanced
MLA rows (``pages/kimi_k3.py``, 0.34) and dots3_note's NOTE rows
(``pages/dots3_note.py``), zeroed exactly or refused.

Padding no writer touches keeps its bytes in valid tokens' rows (``keep``):
zeroing it with a tail would change nothing a kernel reads, and the maps
leave it alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec, get_kv_quant_mode
from vllm.v1.kv_cache_layout import KVCacheLayout

from tests.scheduler.pages.model_harness import (
    LAYERS,
    PATHS,
    ModelLayer,
    allocate,
    assert_refused,
    assert_tails_exact,
    class_at,
    expect,
    import_model,
    needs,
    num_blocks,
    published,
    random_tokens,
)

INKLING = "vllm.models.inkling.{}.sconv_swa_attn"
KIMI = "vllm.models.kimi_k3.nvidia.kv_balanced_mla.backend.KimiK3KvBalancedMLABackend"
DOTS3 = "vllm.models.dots3_note.nvidia.attention."

# Inkling: 2 KV heads of head_dim 16, hidden 40: streams K, V (16 each), attn-
# and MLP-output (20 each) = 72 elements, padded to a 128-element cell.
INK_HEADS, INK_HEAD_DIM, INK_HIDDEN, INK_KERNEL = 2, 16, 40, 4


def inkling_state(platform: str):
    """A real ``InklingConvState`` (its ``__init__`` reads the TP size and the
    model dtype), and the spec it publishes through its backend."""
    module = import_model(INKLING.format(platform))
    current = SimpleNamespace(
        model_config=SimpleNamespace(dtype=torch.bfloat16),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )
    with (
        mock.patch.object(module, "get_tensor_model_parallel_world_size", lambda: 1),
        mock.patch.object(module, "get_current_vllm_config", lambda: current),
    ):
        state = module.InklingConvState(
            num_kv_heads=INK_HEADS,
            head_dim=INK_HEAD_DIM,
            hidden_size=INK_HIDDEN,
            kernel_size=INK_KERNEL,
            prefix="model.layers.0.sconv",
        )
    spec = published(module.InklingSconvBackend, state.get_kv_cache_spec(None))
    return module.InklingSconvBackend, state, spec


def sconv_writer(state, block_tokens: int):
    """Each stream's channels of token ``slot`` at ``cache[slot // N, head,
    slot % N, off_s + c % WS]`` for every head (nvidia|amd/ops/sconv.py
    ``_fused_sconv_kernel``, step 1), all four streams; checked against the
    kernel in ``test_model_writers``."""
    tokens = num_blocks(block_tokens) * block_tokens
    data = {
        name: [
            random_tokens((tokens, INK_HEADS, width), torch.bfloat16, seed=8 * i + s)
            for s, (_, width) in enumerate(state.stream_ranges)
        ]
        for i, name in enumerate(LAYERS)
    }

    def write(layer: str, view: torch.Tensor, slots: Sequence[int]) -> None:
        index = torch.tensor(list(slots), dtype=torch.int64)
        n = view.shape[2]
        for (off, width), stream in zip(state.stream_ranges, data[layer], strict=True):
            view[index // n, :, index % n, off : off + width] = stream[index]

    return write


def keep_padding(raw_cell: int):
    def keep(expected: torch.Tensor, written: torch.Tensor, block: int, valid: int) -> None:
        expected[block, :, :valid, raw_cell:] = written[block, :, :valid, raw_cell:]

    return keep


@pytest.mark.parametrize("platform", ["nvidia", "amd"])
def test_inkling_conv_window_tails_are_exact(platform):
    backend, state, spec = inkling_state(platform)
    assert spec.block_size == INK_KERNEL and spec.head_size == 128
    pages = allocate(spec, KVCacheLayout.LBHNC, num_blocks(INK_KERNEL))
    raw_cell = 2 * INK_HEAD_DIM + 2 * (INK_HIDDEN // INK_HEADS)
    case = expect(pages, sconv_writer(state, INK_KERNEL), INK_KERNEL, keep_padding(raw_cell))
    layer = ModelLayer(backend, block_size=state.block_size)
    for path, _ in PATHS:
        assert_tails_exact(pages, case, layer, path)


def test_inkling_enlarged_block_is_exact_on_rocm():
    """The page unifier's enlarged block (``replace(spec, block_size=...)``,
    kv_cache_planning.py ``unify_kv_cache_spec_page_size``): ROCm's writer
    takes the bound view's N (amd/sconv_swa_attn.py ``cache_block_size``)."""
    backend, state, spec = inkling_state("amd")
    spec = replace(spec, block_size=8 * INK_KERNEL)
    pages = allocate(spec, KVCacheLayout.LBHNC, num_blocks(spec.block_size))
    raw_cell = 2 * INK_HEAD_DIM + 2 * (INK_HIDDEN // INK_HEADS)
    write = sconv_writer(state, spec.block_size)
    case = expect(pages, write, spec.block_size, keep_padding(raw_cell))
    for path, _ in PATHS:
        assert_tails_exact(pages, case, ModelLayer(backend, block_size=state.block_size), path)


def test_inkling_enlarged_block_is_refused_on_nvidia():
    """NVIDIA's writer addresses ``slot // owner.block_size`` (the kernel
    size, nvidia/short_conv.py), not the enlarged block: refused."""
    backend, state, spec = inkling_state("nvidia")
    spec = replace(spec, block_size=8 * INK_KERNEL)
    layer = ModelLayer(backend, block_size=state.block_size)
    assert_refused(spec, layer, KVCacheLayout.LBHNC, "owner.block_size")


# Kimi K3 (0.34): an fp8 latent row of 576 values per token, pages of 64.
KIMI_BLOCK, LATENT = 64, 576


def kimi_spec(backend: type, kv_cache_dtype: str):
    """``MultiHeadLatentAttention.get_kv_cache_spec`` (kimi_k3/nvidia/mla.py),
    unbound on the fields it reads."""
    mla = import_model("vllm.models.kimi_k3.nvidia.mla")
    layer = SimpleNamespace(
        kv_cache_dtype=kv_cache_dtype, head_size=LATENT, non_causal_multi_token_decode=False
    )
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=KIMI_BLOCK), model_config=None)
    return published(backend, mla.MultiHeadLatentAttention.get_kv_cache_spec(layer, config))


def row_writer(block_tokens: int, width: int, dtype: torch.dtype):
    """One row per token at ``[slot // N, 0, slot % N, :width]``: MLA's cache
    insert (``concat_and_cache_mla`` and Kimi's fused epilogues into
    ``[num_blocks, block_size, entry]``, kimi_k3/nvidia/ops/
    fused_mla_key_concat_kv_cache.py; CPU_MLA's torch twin
    ``flat[slots, :]``, v1/attention/backends/mla/cpu_mla.py)."""
    tokens = num_blocks(block_tokens) * block_tokens
    data = {name: random_tokens((tokens, width), dtype, seed=i) for i, name in enumerate(LAYERS)}

    def write(layer: str, view: torch.Tensor, slots: Sequence[int]) -> None:
        index = torch.tensor(list(slots), dtype=torch.int64)
        view[index // block_tokens, 0, index % block_tokens, :width] = data[layer][index]

    return write


@needs((0, 34), "KIMI_K3_KV_BALANCED_MLA is new in vLLM 0.34")
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_kimi_kv_balanced_latent_tails_are_exact(kv_cache_dtype):
    backend = class_at(KIMI)
    spec = kimi_spec(backend, kv_cache_dtype)
    pages = allocate(spec, KVCacheLayout.LBHNC, num_blocks(KIMI_BLOCK))
    case = expect(pages, row_writer(KIMI_BLOCK, LATENT, torch.uint8), KIMI_BLOCK)
    for path, _ in PATHS:
        assert_tails_exact(pages, case, ModelLayer(backend, kv_cache_dtype), path)


# dots3_note: the DSA rows (latent 512 + rope 64 = 576) padded to the SWA
# latent width 1088 (model.py: physical_head_size = swa_kv_lora_rank +
# swa_qk_rope_head_dim); the SWA layers' own 1088-wide rows.
DOTS_BLOCK, DSA_LATENT, SWA_LATENT = 64, 576, 1088


def dots3_dsa_spec(backend: type):
    """``Dots3NotePaddedMLAAttention.get_kv_cache_spec``: MLAAttention's
    bf16 spec (mla_attention.py ``get_kv_cache_spec``) with ``head_size``
    replaced by the physical width (dots3_note/nvidia/model.py)."""
    spec = MLAAttentionSpec(
        block_size=DOTS_BLOCK,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=DSA_LATENT,
        dtype=torch.bfloat16,
        cache_dtype_str="auto",
        kv_quant_mode=get_kv_quant_mode("auto"),
    )
    return published(backend, replace(spec, head_size=SWA_LATENT))


def test_dots3_padded_dsa_tails_are_exact():
    backend = class_at(DOTS3 + "Dots3NotePaddedSparseBackend")
    spec = dots3_dsa_spec(backend)
    (layout,) = backend.supported_kv_cache_layouts()  # BLHNC
    pages = allocate(spec, layout, num_blocks(DOTS_BLOCK))
    # do_kv_cache_update writes kv_cache[..., :head_size] (_logical_cache).
    write = row_writer(DOTS_BLOCK, DSA_LATENT, torch.bfloat16)

    def keep(expected, written, block, valid):
        expected[block, :, :valid, DSA_LATENT:] = written[block, :, :valid, DSA_LATENT:]

    case = expect(pages, write, DOTS_BLOCK, keep)
    for path, _ in PATHS:
        assert_tails_exact(pages, case, ModelLayer(backend), path)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_dots3_swa_rows_tails_are_exact(kv_cache_dtype):
    backend = class_at(DOTS3 + "Dots3NoteTritonMLABackend")
    dtype = torch.bfloat16 if kv_cache_dtype == "auto" else torch.uint8
    spec = published(
        backend,
        SlidingWindowMLASpec(
            block_size=DOTS_BLOCK,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=SWA_LATENT,
            dtype=dtype,
            cache_dtype_str=kv_cache_dtype,
            kv_quant_mode=get_kv_quant_mode(kv_cache_dtype),
            sliding_window=128,
        ),
    )
    pages = allocate(spec, KVCacheLayout.LBHNC, num_blocks(DOTS_BLOCK))
    case = expect(pages, row_writer(DOTS_BLOCK, SWA_LATENT, dtype), DOTS_BLOCK)
    for path, _ in PATHS:
        assert_tails_exact(pages, case, ModelLayer(backend, kv_cache_dtype), path)
