"""MiniMax-M3 sparse attention pages (``pages/minimax_m3.py``,
``pages/minimax_m3_nvfp4.py``): every layout vLLM 0.32-0.34 can give a
MiniMax-M3 layer, zeroed exactly or refused naming the layer and backend.

Specs: the main cache's is ``MiniMaxM3SparseAttention.get_kv_cache_spec``
(nvidia/model.py; called unbound on the fields it reads), the indexer's
``MiniMaxM3IndexerCache.get_kv_cache_spec`` (common/indexer.py, a real
instance), both through ``customize_attention_spec`` as the runner applies it.
Writers: bf16/fp8 K/V through ``triton_reshape_and_cache_flash`` (what the
fused insert "stores exactly", 0.34 _custom_ops.py; 0.34 ROCm's native path,
amd/model.py ``_native_gfx942_qknorm_rope_cache``), index keys through
``minimax_m3_insert_index_cache`` (amd/ops/sparse_pa.py), both vLLM's Triton
kernels under the interpreter; NVFP4 through vLLM's own page views
(``nvfp4_kv_cache_views``) and V-scale order (``interleave_v_scales``).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtail_connector.ops import RegionCache
from tests.scheduler.pages.model_harness import (
    LAYERS,
    PATHS,
    VERSION,
    ModelLayer,
    allocate,
    assert_refused,
    assert_tails_exact,
    before,
    class_at,
    expect,
    import_model,
    needs,
    num_blocks,
    plain_kv_writer,
    published,
    random_tokens,
)

M = "vllm.models.minimax_m3."
TRITON = M + "common.sparse_attention.MiniMaxM3SparseBackend"
MSA = M + "nvidia.sparse_attention_msa.MiniMaxM3SparseMSABackend"
MSA_NVFP4 = M + "nvidia.sparse_attention_msa.MiniMaxM3SparseMSANvfp4Backend"
AITER_PA = M + "amd.sparse_attention_msa.MiniMaxM3SparseAiterPABackend"
ROCM_NVFP4 = M + "amd.sparse_attention_nvfp4.MiniMaxM3SparseRocmNvfp4Backend"  # 0.34
INDEXER = M + "common.indexer.MiniMaxM3IndexerBackend"
INDEXER_MSA = M + "nvidia.indexer_msa.MiniMaxM3IndexerMSABackend"
INDEXER_NVFP4 = M + "nvidia.indexer_nvfp4.MiniMaxM3IndexerNvfp4Backend"  # 0.34
ROCM_INDEXER = (
    M + "amd.indexer_aiter.MiniMaxM3IndexerAiterBackend"  # 0.32
    if VERSION < (0, 33)
    else M + "amd.indexer_msa.MiniMaxM3IndexerMSABackend"  # 0.33, 0.34
)

BLOCK = 128  # every MiniMax-M3 backend's only kernel block size
HEADS, HEAD_DIM = 2, 128


def main_spec(kv_cache_dtype: str, backend: type) -> FullAttentionSpec:
    """What a main-cache layer of ``backend`` publishes: vLLM's own
    ``get_kv_cache_spec`` on the layer's fields, then the backend's spec."""
    model = import_model(M + "nvidia.model")
    layer = SimpleNamespace(
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_torch_dtype=STR_DTYPE_TO_TORCH_DTYPE[kv_cache_dtype],
    )
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK))
    return published(backend, model.MiniMaxM3SparseAttention.get_kv_cache_spec(layer, config))


def index_spec(indexer_kv_dtype: str, backend: type):
    """``MiniMaxM3IndexerCache(...).get_kv_cache_spec`` for this index dtype."""
    module = import_model(M + "common.indexer")
    current = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}))
    with mock.patch.object(module, "get_current_vllm_config", lambda: current):
        cache = module.MiniMaxM3IndexerCache(
            HEAD_DIM, "model.layers.0.self_attn.attn.indexer", None, indexer_kv_dtype, backend
        )
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK))
    return published(backend, cache.get_kv_cache_spec(config))


@pytest.mark.parametrize("backend_path", [TRITON, MSA], ids=["triton", "msa"])
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLNHC], ids=str)
def test_main_kv_tails_are_exact(backend_path, kv_cache_dtype, layout):
    backend = class_at(backend_path)
    spec = main_spec(kv_cache_dtype, backend)
    pages = allocate(spec, layout, num_blocks(BLOCK))
    write = plain_kv_writer(HEAD_DIM, HEADS, kv_cache_dtype, pages.config.num_blocks * BLOCK)
    case = expect(pages, write, BLOCK)
    for path, _ in PATHS:
        caches = assert_tails_exact(pages, case, ModelLayer(backend, kv_cache_dtype), path)
        assert all(isinstance(c, torch.Tensor) for c in caches)  # the plain view itself


def index_writer():
    """``minimax_m3_insert_index_cache`` into the bound ``[B, N, D]`` view
    (``MiniMaxM3IndexerCache.bind_kv_cache``: ``kv_cache.squeeze(1)``), by its
    kernel's index math (amd/ops/sparse_pa.py ``_insert_index_cache_kernel``:
    ``block_id * stride_c_b + block_off * stride_c_t + offs_d * stride_c_d``;
    the kernel does not run under Triton's interpreter: "mask has unsupported
    dtype")."""
    keys = {
        name: random_tokens((num_blocks(BLOCK) * BLOCK, HEAD_DIM), torch.bfloat16, seed=i)
        for i, name in enumerate(LAYERS)
    }

    def write(layer: str, view: torch.Tensor, slots: Sequence[int]) -> None:
        index = torch.tensor(list(slots), dtype=torch.int64)
        cache = view.squeeze(1)
        cache[index // BLOCK, index % BLOCK] = keys[layer][index].to(cache.dtype)

    return write


@pytest.mark.parametrize("backend_path", [INDEXER, INDEXER_MSA], ids=["triton", "msa"])
@pytest.mark.parametrize("indexer_kv_dtype", ["bf16", "fp8"])
def test_indexer_key_tails_are_exact(backend_path, indexer_kv_dtype):
    backend = class_at(backend_path)
    spec = index_spec(indexer_kv_dtype, backend)
    pages = allocate(spec, KVCacheLayout.LBHNC, num_blocks(BLOCK))
    case = expect(pages, index_writer(), BLOCK)
    for path, _ in PATHS:
        assert_tails_exact(pages, case, ModelLayer(backend), path)


# NVFP4 pages: one head slot is [128 tokens x 64 data bytes][128 x 8 scales].
def nvfp4_main_writer(heads: int):
    """Token data stored through vLLM's own split of the page
    (``msa_cutlass_sparse_decode.nvfp4_kv_cache_views`` ->
    ``fmha_sm100.nvfp4_kv.nvfp4_head_slot_views``), V scales in the order the
    kernels read them (``decode_q8kv4.interface.interleave_v_scales``: "the
    vLLM NVFP4 cache order")."""
    views = import_model(M + "nvidia.msa_cutlass_sparse_decode")
    interleave = import_model("vllm.third_party.fmha_sm100.decode_q8kv4.interface")
    # perm[i]: the linear (token * 8 + group) scale stored at byte i.
    perm = interleave.interleave_v_scales(torch.arange(BLOCK * 8).view(1, 1, BLOCK, 8)).flatten()
    tokens = num_blocks(BLOCK) * BLOCK
    data = {
        name: [
            random_tokens((tokens, heads, w), torch.uint8, seed=4 * i + j)
            for j, w in enumerate((64, 8, 64, 8))
        ]
        for i, name in enumerate(LAYERS)
    }

    def write(layer: str, view: torch.Tensor, slots: Sequence[int]) -> None:
        k_data, k_scale, v_data, v_scale = views.nvfp4_kv_cache_views(view)
        kd, ks, vd, vs = data[layer]
        for slot in slots:
            b, n = divmod(slot, BLOCK)
            k_data[b, :, n], k_scale[b, :, n], v_data[b, :, n] = kd[slot], ks[slot], vd[slot]
        for b in sorted({s // BLOCK for s in slots}):
            stored = v_scale[b].reshape(heads, BLOCK * 8)
            linear = torch.empty_like(stored)
            linear[:, perm] = stored
            linear = linear.view(heads, BLOCK, 8)
            for slot in (s for s in slots if s // BLOCK == b):
                linear[:, slot % BLOCK] = vs[slot]
            v_scale[b] = interleave.interleave_v_scales(linear.unsqueeze(0))[0]

    return write


@needs((0, 33), "vLLM 0.32 ships no fmha_sm100, which defines the NVFP4 V-scale order")
def test_nvfp4_main_tails_are_exact_scales_included():
    backend = class_at(MSA_NVFP4)
    spec = main_spec("nvfp4", backend)
    assert (spec.num_head_slots, spec.state_content_bytes) == (2 * HEADS, 72)
    (layout,) = backend.supported_kv_cache_layouts()
    pages = allocate(spec, layout, num_blocks(BLOCK))
    case = expect(pages, nvfp4_main_writer(HEADS), BLOCK)
    for path, _ in PATHS:
        caches = assert_tails_exact(pages, case, ModelLayer(backend, "nvfp4"), path)
        assert all(isinstance(c, RegionCache) for c in caches)


@before((0, 33), "the NVFP4 V-scale order is in vLLM's tree from 0.33")
def test_nvfp4_main_is_refused_on_032_with_the_settings_that_work():
    backend = class_at(MSA_NVFP4)
    spec = main_spec("nvfp4", backend)
    assert_refused(spec, ModelLayer(backend, "nvfp4"), KVCacheLayout.LBHNC, "fmha_sm100", "fp8")


def nvfp4_index_writer():
    """The NVFP4 index page (0.34 nvidia/ops/qkv_index_fused_epilogue.py
    ``_nvfp4_cache_views`` with one slot, and gather_nvfp4_index_k.py's
    docstring): token ``t``'s 64 code bytes at ``64 t``, its 8 scales at
    ``128 * 64 + 8 t`` (re-implemented here: the writers are CUDA)."""
    tokens = num_blocks(BLOCK) * BLOCK
    data = {
        name: (
            random_tokens((tokens, 64), torch.uint8, 2 * i),
            random_tokens((tokens, 8), torch.uint8, 2 * i + 1),
        )
        for i, name in enumerate(LAYERS)
    }

    def write(layer: str, view: torch.Tensor, slots: Sequence[int]) -> None:
        codes, scales = data[layer]
        for slot in slots:
            b, t = divmod(slot, BLOCK)
            page = view[b, 0].view(-1)  # one contiguous [128, 72] page
            page[64 * t : 64 * t + 64] = codes[slot]
            page[BLOCK * 64 + 8 * t : BLOCK * 64 + 8 * t + 8] = scales[slot]

    return write


@needs((0, 34), "the NVFP4 index cache is new in vLLM 0.34")
def test_nvfp4_index_tails_are_exact_scales_included():
    backend = class_at(INDEXER_NVFP4)
    spec = index_spec("nvfp4", backend)
    assert (spec.head_size, spec.dtype) == (72, torch.uint8)
    pages = allocate(spec, KVCacheLayout.LBHNC, num_blocks(BLOCK))
    case = expect(pages, nvfp4_index_writer(), BLOCK)
    for path, _ in PATHS:
        caches = assert_tails_exact(pages, case, ModelLayer(backend), path)
        assert all(isinstance(c, RegionCache) for c in caches)


def aiter_pa_spec() -> FullAttentionSpec:
    """amd/model.py ``get_kv_cache_spec`` with AITER sparse PA on: K and V as
    two head slots of ``num_kv_heads * head_dim`` elements (0.32 ~821, 0.33
    ~838, 0.34 ~934; 0.34's ROCm model does not import on CPU)."""
    return FullAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_size=HEAD_DIM,
        head_size_v=HEAD_DIM,
        dtype=torch.bfloat16,
        num_head_slots=2,
        state_content_bytes=HEADS * HEAD_DIM * 2,
    )


def test_aiter_sparse_pa_is_refused_with_the_settings_that_work():
    backend = class_at(AITER_PA)
    layer = ModelLayer(backend, "bfloat16")
    assert_refused(
        published(backend, aiter_pa_spec()),
        layer,
        KVCacheLayout.LBHNC,
        "AITER",
        "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT=0",
    )


@needs((0, 34), "MiniMax-M3's ROCm NVFP4 backend is new in vLLM 0.34")
def test_rocm_nvfp4_is_refused_two_tokens_share_a_byte():
    backend = class_at(ROCM_NVFP4)
    spec = main_spec("nvfp4", backend)
    assert_refused(
        spec,
        ModelLayer(backend, "nvfp4"),
        KVCacheLayout.LBHNC,
        "two consecutive tokens",
        "--kv-cache-dtype fp8",
    )


@pytest.mark.parametrize("indexer_kv_dtype", ["bf16", "fp8"])
def test_rocm_aiter_indexers_are_refused(indexer_kv_dtype):
    backend = class_at(ROCM_INDEXER)
    spec = index_spec(indexer_kv_dtype, backend)
    assert_refused(spec, ModelLayer(backend), KVCacheLayout.LBHNC, "AITER")
