"""zero_kv_blocks on per-layer views made by vLLM's own allocator helpers.

``create_kv_cache_views`` is what vLLM hands to ``register_kv_caches``; this
checks every layout, kernel-block splitting and a padded MLA page against the
reference, byte for byte over the backing buffer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtail_connector.ops import KVZeroer, reference_zero_kv_blocks
from tests.helpers.layouts import rebase
from tests.ops.test_zero_kv_blocks import PATH_IDS, PATHS

kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
KVCacheLayout = pytest.importorskip("vllm.v1.kv_cache_layout").KVCacheLayout

pytestmark = pytest.mark.vllm


def vllm_views(spec, layout, num_layers, num_blocks, kernel_block_size=None, offset=0):
    layer_stride, block_stride, *_ = kvi.compute_layout_strides(
        spec, num_blocks, num_layers, layout
    )
    tensor = kvi.KVCacheTensor(
        size=0,
        layers=[f"l{i}" for i in range(num_layers)],
        layer_stride=layer_stride,
        block_stride=block_stride,
        offset=offset,
    )
    span = offset + num_layers * num_blocks * spec.page_size_bytes + 256
    raw = torch.randint(
        1, 127, (span,), dtype=torch.int8, generator=torch.Generator().manual_seed(7)
    )
    views = kvi.create_kv_cache_views(
        raw, spec, num_blocks, layout, tensor, kernel_block_size=kernel_block_size
    )
    return raw, views


def check(raw, views, backend, device, pages_per_block, items):
    expected = raw.clone()
    for _, b, v in items:
        reference_zero_kv_blocks(
            rebase(views, expected), (), [(b, v)], pages_per_block=pages_per_block
        )
    dev_raw = raw.to(device)
    zeroer = KVZeroer([(rebase(views, dev_raw), pages_per_block)], implementation=backend)
    zeroer.zero(np.array(items, dtype=np.int64))
    assert torch.equal(dev_raw.cpu(), expected)


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_vllm_layouts(backend, device, layout):
    spec = kvi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    raw, views = vllm_views(spec, layout, num_layers=3, num_blocks=5, offset=64)
    check(raw, views, backend, device, 1, [(0, 2, 5), (0, 4, 1), (0, 0, 0)])


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC], ids=lambda x: x.name)
def test_vllm_kernel_block_splitting(backend, device, layout):
    spec = kvi.FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=8, dtype=torch.float16)
    raw, views = vllm_views(spec, layout, num_layers=2, num_blocks=4, kernel_block_size=8)
    assert views[0].shape[0] == 16  # 4 kernel pages per manager block
    # Tails inside page 0, page 2 and on a page boundary.
    check(raw, views, backend, device, 4, [(0, 1, 3), (0, 2, 17), (0, 3, 8)])


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
def test_vllm_padded_fp8_mla_page(backend, device):
    # 584-byte fp8 slots (DeepSeek-V4-like); pages padded to a 1 KiB multiple.
    spec = kvi.MLAAttentionSpec(
        block_size=16,
        num_kv_heads=1,
        head_size=584,
        dtype=torch.float8_e4m3fn,
        alignment=1024,
    )
    assert spec.page_size_bytes > spec.unpadded_page_size_bytes
    raw, views = vllm_views(spec, KVCacheLayout.LBHNC, num_layers=2, num_blocks=4)
    check(raw, views, backend, device, 1, [(0, 1, 9), (0, 3, 0)])
