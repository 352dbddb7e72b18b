"""Qwen4-exp QSA pages (``pages/qwen4_exp.py``): the sparse layer's K/V
(bf16/fp8 on both platforms, ROCm Octave from 0.33) and its compressed key
cache, zeroed exactly.

Specs: ``Qwen4ExpQSAAttention.get_kv_cache_spec`` (nvidia/ and amd/qsa.py,
called unbound on the fields it reads) and ``QSACompressedKeyCache(...)
.get_kv_cache_spec`` (a real instance), each through its backend's spec
(``customize_attention_spec``; the ROCm backend's ``customize_spec`` is
``RocmOctaveAttentionBackend``'s). Writers: FLASH_ATTN's store
(``model_harness.plain_kv_writer``; QSA's ``do_kv_cache_update`` and
``qsa_prepare``'s main-cache store address the same ``[block, token, head]``
rows); Octave slots from vLLM's ``rocm_octave.reference_quantize`` at the
reference reader's ``cache[block, :, pos % block_size]``; compressed keys at
the slots vLLM's ``compressed_qsa_slot_mapping`` gives.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
import torch
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.kv_cache_layout import KVCacheLayout

from tests.scheduler.pages.model_harness import (
    LAYERS,
    PATHS,
    VERSION,
    ModelLayer,
    allocate,
    assert_tails_exact,
    expect,
    import_model,
    needs,
    num_blocks,
    plain_kv_writer,
    published,
    random_tokens,
)

Q = "vllm.models.qwen4_exp."
# The layer's backend class: a FLASH_ATTN subclass through 0.33, its own in 0.34.
MAIN_CLASS = "Qwen4ExpQSAFlashAttentionBackend" if VERSION < (0, 34) else "Qwen4ExpQSABackend"
CACHE_MODULE = Q + ("common.qsa_cache" if VERSION < (0, 34) else "common.qsa_indexer")
COMPRESSED_CLASS = "QSAStateBackend" if VERSION < (0, 34) else "QSAIndexerBackend"

BLOCK, HEADS, HEAD_DIM = 64, 2, 256
OCTAVE_ROPE_DIM = 64


def qsa_module(platform: str):
    """``<platform>/qsa.py``, imported through its model (importing it alone
    is circular: qsa -> model -> qsa)."""
    import_model(f"{Q}{platform}.model")
    return sys.modules[f"{Q}{platform}.qsa"]


def main_spec(platform: str, kv_cache_dtype: str):
    module = qsa_module(platform)
    backend = getattr(module, MAIN_CLASS)
    layer = SimpleNamespace(
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_torch_dtype=STR_DTYPE_TO_TORCH_DTYPE[kv_cache_dtype],
    )
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK))
    spec = module.Qwen4ExpQSAAttention.get_kv_cache_spec(layer, config)
    return backend, published(backend, spec)


def main_cases() -> list:
    cases = [("nvidia", "bfloat16"), ("nvidia", "fp8"), ("amd", "bfloat16")]
    if VERSION >= (0, 34):
        cases.append(("amd", "fp8"))  # amd/qsa.py _QSA_CACHE_DTYPES, 0.34
    return cases


@pytest.mark.parametrize(("platform", "kv_cache_dtype"), main_cases())
def test_main_kv_tails_are_exact(platform, kv_cache_dtype):
    backend, spec = main_spec(platform, kv_cache_dtype)
    assert kv_cache_dtype in backend.supported_kv_cache_dtypes
    pages = allocate(spec, KVCacheLayout.BLNHC, num_blocks(BLOCK))
    write = plain_kv_writer(HEAD_DIM, HEADS, kv_cache_dtype, pages.config.num_blocks * BLOCK)
    case = expect(pages, write, BLOCK)
    for path, _ in PATHS:
        assert_tails_exact(pages, case, ModelLayer(backend, kv_cache_dtype), path)


def octave_writer(fmt, tokens: int):
    """``reference_quantize`` slots (one per token and KV head, from that
    token alone) at ``cache[block, :, pos % block_size]``, where
    ``reference_attention`` reads them (v1/attention/ops/rocm_octave.py)."""
    sq = import_model("vllm.v1.attention.ops.rocm_octave")
    slots_by_layer = {}
    for i, name in enumerate(LAYERS):
        key = torch.randn(tokens, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(i))
        value = torch.randn(tokens, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(9 + i))
        slots_by_layer[name] = sq.reference_quantize(key, value, fmt)

    def write(layer: str, view: torch.Tensor, slots: Sequence[int]) -> None:
        index = torch.tensor(list(slots), dtype=torch.int64)
        view[index // BLOCK, :, index % BLOCK] = slots_by_layer[layer][index]

    return write


@needs((0, 33), "the Octave kv_cache_dtypes are new in vLLM 0.33")
@pytest.mark.parametrize("kv_cache_dtype", ["octave_k3v4", "octave_k3v3", "octave_k3v3_compact"])
def test_rocm_octave_kv_tails_are_exact(kv_cache_dtype):
    sq = import_model("vllm.v1.attention.ops.rocm_octave")
    if HEAD_DIM not in sq._rope_dim_by_head_size:
        sq.register_rope_dim(HEAD_DIM, OCTAVE_ROPE_DIM)  # the model config's, at start-up
    fmt = sq.OctaveFormat.from_cache_dtype(
        kv_cache_dtype, HEAD_DIM, sq.registered_rope_dim(HEAD_DIM)
    )
    backend, spec = main_spec("amd", kv_cache_dtype)
    assert spec.state_content_bytes == fmt.slot_bytes and spec.num_head_slots is None
    pages = allocate(spec, KVCacheLayout.BLNHC, num_blocks(BLOCK))
    case = expect(pages, octave_writer(fmt, pages.config.num_blocks * BLOCK), BLOCK)
    for path, _ in PATHS:
        assert_tails_exact(pages, case, ModelLayer(backend, kv_cache_dtype), path)


def compressed_spec(dtype: torch.dtype, ratio: int):
    module = import_model(CACHE_MODULE)
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context={}),
        cache_config=SimpleNamespace(block_size=BLOCK),
    )
    cache = module.QSACompressedKeyCache(
        head_size=128,
        dtype=dtype,
        cache_config=config.cache_config,
        prefix="model.layers.0.self_attn.indexer.compressed_key_cache",
        vllm_config=config,
        compress_ratio=ratio,
    )
    backend = getattr(module, COMPRESSED_CLASS)
    return module, backend, published(backend, cache.get_kv_cache_spec(config))


def compressed_writer(module, ratio: int, width: int, dtype: torch.dtype):
    """Keys at the slots ``compressed_qsa_slot_mapping`` gives (only the
    token that completes a group of ``ratio`` has one), stored at
    ``[slot // COMP_PAGE_SIZE, slot % COMP_PAGE_SIZE]`` of the bound ``[B, N,
    1, C]`` view (ops/qsa_prepare.py ``compressed_block`` / ``compressed_row``)."""
    states = BLOCK // ratio
    blocks = num_blocks(BLOCK)
    keys = {
        name: random_tokens((blocks * states, width), dtype, seed=i)
        for i, name in enumerate(LAYERS)
    }
    table = torch.arange(blocks, dtype=torch.int32).unsqueeze(0)  # logical b -> block b

    def write(layer: str, view: torch.Tensor, slots: Sequence[int]) -> None:
        positions = torch.tensor(list(slots), dtype=torch.int64)
        comp = module.compressed_qsa_slot_mapping(
            table, torch.zeros_like(positions), positions, states, ratio
        )
        comp = comp[comp >= 0]
        view[comp // states, 0, comp % states] = keys[layer][comp]

    return write


def compressed_dtypes() -> list:
    dtypes = [torch.bfloat16, torch.float8_e4m3fn]
    if VERSION >= (0, 34):
        dtypes.append(torch.float8_e4m3fnuz)  # ROCm gfx942's fp8_dtype() (amd/qsa_indexer.py)
    return dtypes


@pytest.mark.parametrize("dtype", compressed_dtypes(), ids=str)
@pytest.mark.parametrize("ratio", [4, 8])
def test_compressed_key_tails_are_exact(dtype, ratio):
    module, backend, spec = compressed_spec(dtype, ratio)
    assert spec.tokens_per_state == ratio
    layout = backend.supported_kv_cache_layouts()[0]
    pages = allocate(spec, layout, num_blocks(BLOCK))
    case = expect(pages, compressed_writer(module, ratio, 128, dtype), BLOCK)
    for path, _ in PATHS:
        assert_tails_exact(pages, case, ModelLayer(backend), path)
