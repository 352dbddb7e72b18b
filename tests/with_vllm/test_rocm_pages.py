"""ROCm paged-attention pages (ROCM_ATTN): tails zeroed exactly, K x-packed.

The views are what vLLM allocates for the backend (its own ``customize_spec``
and ``create_kv_cache_views``, both layouts it accepts); pages are written
through vLLM's own ``PagedAttention.split_kv_cache`` views at the indices its
cache writers store to (``reshape_and_cache`` in csrc/cache_kernels.cu and the
head-major branch of ``triton_reshape_and_cache_flash``: K
``[B, Hkv, D/x, N, x]``, V ``[B, Hkv, D, N]``; the interleaved V of 0.33's
fused writer and of AITER's shuffle layout: ``[B, Hkv, N/x, D, x]``). The
reference is the page written with only the valid slots.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm.v1.attention.backends.rocm_aiter_fa import AiterFlashAttentionBackend
from vllm.v1.attention.backends.rocm_attn import RocmAttentionBackend
from vllm.v1.attention.ops.paged_attn import PagedAttention
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtail_connector.core.cache_sets import cache_sets
from kvtail_connector.core.kvgroups import group_infos
from kvtail_connector.ops import KVZeroer, RegionCache
from kvtail_connector.pages import UnmappedPage, layer_cache
from tests.ops.test_zero_kv_blocks import PATH_IDS, PATHS

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS = 2, 32, 16, 5


class _Impl:
    def __init__(self, interleaved: bool) -> None:
        self._use_interleaved_v_cache = interleaved  # 0.33's fused writer flag


class _Layer:
    def __init__(self, backend=RocmAttentionBackend, interleaved=False) -> None:
        self.attn_backend = backend
        self.impl = _Impl(interleaved)


def rocm_caches(dtype, layout):
    spec = RocmAttentionBackend.customize_spec(
        FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=dtype)
    )
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, len(LAYERS), layout)
    tensor = KVCacheTensor(
        size=0, layers=list(LAYERS), layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.zeros(len(LAYERS) * NUM_BLOCKS * spec.page_size_bytes, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )
    return raw, dict(zip(LAYERS, views, strict=True)), config


def write(view, slots, keys, values, interleaved):
    """Store token ``s``'s K and V at flat slot ``s``, for each ``s`` in
    ``slots``, as vLLM's ROCm writers do."""
    key_cache, value_cache = PagedAttention.split_kv_cache(view.transpose(0, 1), HEADS, HEAD_SIZE)
    x = key_cache.shape[-1]
    d = torch.arange(HEAD_SIZE)
    if interleaved:
        b = value_cache.shape[0]
        # The interleaved writer's V: [B, Hkv, N/x, D, x] over the same plane.
        value_cache = value_cache.reshape(b, HEADS, BLOCK // x, HEAD_SIZE, x)
    for slot in slots:
        block, n = divmod(slot, BLOCK)
        for h in range(HEADS):
            key_cache[block, h, d // x, n, d % x] = keys[slot, h]
            if interleaved:
                value_cache[block, h, n // x, d, n % x] = values[slot, h]
            else:
                value_cache[block, h, d, n] = values[slot, h]


def kv_data(tokens, dtype):
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.uint8:
        return tuple(
            torch.randint(1, 0x70, (tokens, HEADS, HEAD_SIZE), dtype=torch.uint8, generator=gen)
            for _ in range(2)
        )
    return tuple(torch.randn(tokens, HEADS, HEAD_SIZE, generator=gen).to(dtype) for _ in range(2))


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LHBNC], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["v-plain", "v-interleaved"])
def test_rocm_attn_tails_match_pages_written_with_only_the_valid_slots(
    backend, device, layout, dtype, interleaved
):
    raw, views, config = rocm_caches(dtype, layout)
    keys, values = kv_data(NUM_BLOCKS * BLOCK, dtype)
    for view in views.values():
        write(view, range(NUM_BLOCKS * BLOCK), keys, values, interleaved)
    # Mid x-group of V (interleaved), a group edge, one slot kept, a whole block.
    items = [(1, 9), (2, 8), (3, 1), (4, 0)]
    expected = raw.clone()
    for view in views.values():
        mirror = torch.as_strided(
            expected.view(view.dtype), view.shape, view.stride(), view.storage_offset()
        )
        for block, valid in items:
            mirror[block].zero_()
            write(mirror, range(block * BLOCK, block * BLOCK + valid), keys, values, interleaved)
    layer = _Layer(interleaved=interleaved)
    sets = cache_sets(views, config, group_infos(config, 1), {name: layer for name in views})
    assert all(isinstance(c, RegionCache) for c in sets[0].caches)
    KVZeroer([(sets[0].caches, sets[0].pages_per_block)], implementation=backend).zero(
        np.array([(0, b, v) for b, v in items], dtype=np.int64)
    )
    assert torch.equal(raw, expected), f"{int((raw != expected).sum())} bytes differ"


def test_the_view_is_not_the_slot_layout():
    # Zeroing view[b, :, s:, :] would wipe K groups and V rows of valid slots.
    _, views, _ = rocm_caches(torch.bfloat16, KVCacheLayout.LBHNC)
    view = views[LAYERS[0]]
    keys, values = kv_data(NUM_BLOCKS * BLOCK, torch.bfloat16)
    write(view, range(NUM_BLOCKS * BLOCK), keys, values, False)
    naive = view.clone()
    naive[1, :, 5:, :] = 0
    expected = view.clone()
    expected[1].zero_()
    write(expected, range(BLOCK, BLOCK + 5), keys, values, False)
    assert not torch.equal(naive, expected)


def test_aiter_fa_without_the_shuffle_layout_passes_the_view_through():
    # ROCM_AITER_FA reports "FLASH_ATTN"; without the shuffle layout (off on
    # this machine: no aiter) its spec is unchanged and its pages are
    # [B, H, N, 2*D], exact as a view.
    plain = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16
    )
    assert AiterFlashAttentionBackend.customize_spec(plain) == plain
    view = torch.zeros(4, HEADS, BLOCK, 2 * HEAD_SIZE, dtype=torch.bfloat16)
    assert layer_cache("l0", view, plain, _Layer(AiterFlashAttentionBackend)) is view
    _, views, config = rocm_caches(torch.bfloat16, KVCacheLayout.LBHNC)
    spec = config.kv_cache_groups[0].kv_cache_spec
    assert isinstance(layer_cache("l0", views[LAYERS[0]], spec, _Layer()), RegionCache)


def test_a_view_rocm_attention_could_not_split_is_refused():
    spec = RocmAttentionBackend.customize_spec(
        FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16
        )
    )
    wrong = torch.zeros(4, 2, BLOCK, 2 * HEADS * HEAD_SIZE, dtype=torch.bfloat16)[:, :, :, :64]
    with pytest.raises(
        UnmappedPage, match=r"layer 'l0' \(backend ROCM_ATTN .*ROCm page with strides"
    ):
        layer_cache("l0", wrong, spec, _Layer())
