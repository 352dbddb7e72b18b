"""Step5 pages (``pages/step5.py``, vLLM 0.33 on): the DSA layer's K/V and
its CSA region summaries, zeroed exactly.

Specs: the DSA layer's ``FullAttentionSpec`` through
``Step5DSAAttentionBackend``'s spec (``customize_attention_spec``: its
``customize_spec`` sets ``block_stride_alignment``); the summary layer's is
``Step5SparseSummaryCacheLayer.get_kv_cache_spec`` (a real instance), through
its backend's. Writers: FLASH_ATTN's store (``model_harness.plain_kv_writer``)
and the summary store's index math (``summary_writer``), both checked
against vLLM's Triton kernels in ``test_model_writers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode
from vllm.v1.kv_cache_layout import KVCacheLayout

from tests.scheduler.pages.model_harness import (
    LAYERS,
    PATHS,
    VERSION,
    ModelLayer,
    allocate,
    assert_tails_exact,
    class_at,
    expect,
    import_model,
    needs,
    num_blocks,
    plain_kv_writer,
    published,
    random_tokens,
)

pytestmark = needs((0, 33), "Step5 is new in vLLM 0.33")

S = "vllm.models.step5."
DSA = S + "nvidia.sparse_attention.Step5DSAAttentionBackend"
SUMMARY_MODULE = S + ("nvidia" if VERSION < (0, 34) else "common") + ".sparse_summary_cache"
SUMMARY = SUMMARY_MODULE + ".Step5SparseSummaryBackend"
CSA = S + "amd.csa_cache.Step5CSABackend"  # 0.34, ROCm: the summaries' own group

BLOCK, HEADS, HEAD_SIZE = 64, 2, 192
REGION, SUMMARY_BYTES = 8, 256


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8"])
def test_dsa_kv_tails_are_exact(kv_cache_dtype):
    backend = class_at(DSA)
    dtype = torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.uint8
    spec = published(
        backend,
        FullAttentionSpec(
            block_size=BLOCK,
            num_kv_heads=HEADS,
            head_size=HEAD_SIZE,
            dtype=dtype,
            kv_quant_mode=get_kv_quant_mode(kv_cache_dtype),
        ),
    )
    (layout,) = backend.supported_kv_cache_layouts()  # BLNHC
    pages = allocate(spec, layout, num_blocks(BLOCK))
    write = plain_kv_writer(HEAD_SIZE, HEADS, kv_cache_dtype, pages.config.num_blocks * BLOCK)
    case = expect(pages, write, BLOCK)
    for path, _ in PATHS:
        assert_tails_exact(pages, case, ModelLayer(backend, kv_cache_dtype), path)


def summary_spec(backend: type):
    """``Step5SparseSummaryCacheLayer(...).get_kv_cache_spec``: one 256-byte
    uint8 row per eight tokens, through ``backend``'s spec."""
    module = import_model(SUMMARY_MODULE)
    layer = module.Step5SparseSummaryCacheLayer(
        prefix="model.layers.0.self_attn.attn.sparse_summary_cache",
        target_impl=None,
        static_forward_context={},
    )
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK))
    return published(backend, layer.get_kv_cache_spec(config))


def summary_writer(block_tokens: int):
    """The summary store by its index math (summary_update.py ``_store_summary``:
    ``slot // BLOCK_SIZE * MEAN_BLOCK + slot % BLOCK_SIZE // 8 * 256``, called
    by ``_update_decode_values`` only for the token at ``position % 8 == 7``,
    the region's eighth): a region's summary exists once its last token is
    written. Each summary's bytes stand for the whole region."""
    regions = num_blocks(block_tokens) * block_tokens // REGION
    data = {
        name: random_tokens((regions, SUMMARY_BYTES), torch.uint8, seed=i)
        for i, name in enumerate(LAYERS)
    }

    def write(layer: str, view: torch.Tensor, slots: Sequence[int]) -> None:
        for slot in slots:
            if slot % REGION == REGION - 1:
                block, token = divmod(slot, block_tokens)
                view[block, 0, token // REGION] = data[layer][slot // REGION]

    return write


@pytest.mark.parametrize(
    "backend_path",
    [SUMMARY, pytest.param(CSA, marks=needs((0, 34), "Step5CSABackend is new in 0.34"))],
    ids=["summary", "rocm-csa"],
)
@pytest.mark.parametrize("layout", [KVCacheLayout.BLNHC, KVCacheLayout.LBHNC], ids=str)
def test_region_summary_tails_are_exact(backend_path, layout):
    backend = class_at(backend_path)
    spec = summary_spec(backend)
    assert (spec.tokens_per_state, spec.head_size, spec.dtype) == (REGION, 256, torch.uint8)
    pages = allocate(spec, layout, num_blocks(BLOCK))
    case = expect(pages, summary_writer(BLOCK), BLOCK)
    for path, _ in PATHS:
        assert_tails_exact(pages, case, ModelLayer(backend), path)
