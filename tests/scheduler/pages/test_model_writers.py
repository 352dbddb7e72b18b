"""The model page tests write pages by index math re-implemented from vLLM's
writers (running vLLM's Triton writers over whole pages under the interpreter
takes minutes); here each is checked against vLLM's own kernel, run under
the interpreter on a few slots: both store into blank pages, and every byte
one writes the other writes too.

Slots: the first and last of a block, one of a group's middle, one across a
block boundary, and for region summaries a whole region and part of one.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode
from vllm.v1.kv_cache_layout import KVCacheLayout

from tests.scheduler.pages import test_row_model_pages as rows
from tests.scheduler.pages import test_step5_pages as step5
from tests.scheduler.pages.model_harness import (
    LAYERS,
    VERSION,
    Writer,
    allocate,
    import_model,
    needs,
    plain_kv_writer,
    random_tokens,
    vllm_plain_kv_store,
)

LAYER = LAYERS[0]


def written_bytes(spec, layout, write) -> torch.Tensor:
    """Which bytes of blank pages ``write(view)`` stores to."""
    pages = allocate(spec, layout, 3, stale=False)
    write(pages.views[LAYER])
    return pages.raw != 0


def assert_same_bytes(spec, layout, ours, theirs) -> None:
    mine, vllms = written_bytes(spec, layout, ours), written_bytes(spec, layout, theirs)
    assert vllms.any()
    assert torch.equal(mine, vllms), f"{int((mine != vllms).sum())} bytes differ"


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLNHC], ids=str)
def test_plain_kv_index_math_is_triton_reshape_and_cache_flash(kv_cache_dtype, layout):
    heads, head_size, block = 2, 64, 16
    dtype = torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.uint8
    spec = FullAttentionSpec(
        block_size=block,
        num_kv_heads=heads,
        head_size=head_size,
        dtype=dtype,
        kv_quant_mode=get_kv_quant_mode(kv_cache_dtype),
    )
    slots = [0, 5, block - 1, block, 2 * block + 7]
    ours: Writer = plain_kv_writer(head_size, heads, kv_cache_dtype, 3 * block)
    keys, values = (
        random_tokens((len(slots), heads, head_size), torch.bfloat16, s) for s in (1, 2)
    )
    assert_same_bytes(
        spec,
        layout,
        lambda view: ours(LAYER, view, slots),
        lambda view: vllm_plain_kv_store(view, slots, keys, values, kv_cache_dtype),
    )


@triton.jit
def _summaries(
    Mean, Slots, store: tl.constexpr, MEAN_BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr
):
    """Calls vLLM's ``_store_summary`` for one closing slot per program, as
    ``_update_decode_values`` does for the row at ``position % 8 == 7``
    (the whole update does not run under the interpreter: its libdevice
    ``exp``)."""
    slot = tl.load(Slots + tl.program_id(0))
    dim = tl.arange(0, 256)
    numerator = tl.full((256,), 1.5, tl.float32)  # fp8 0x3c: no zero byte
    store(Mean, slot, dim, numerator, tl.full((256,), 1.0, tl.float32), MEAN_BLOCK, BLOCK_SIZE)


@needs((0, 33), "Step5 is new in vLLM 0.33")
def test_summary_index_math_is_store_summary():
    ops = import_model(
        step5.S + ("nvidia" if VERSION < (0, 34) else "common") + ".ops.summary_update",
        writer=True,
    )
    block = 64
    spec = step5.summary_spec(step5.class_at(step5.SUMMARY))
    slots = [*range(block, block + 8), *range(2 * block + 8, 2 * block + 13), 2 * block - 1]

    def vllms(view: torch.Tensor) -> None:
        closing = torch.tensor([s for s in slots if s % 8 == 7], dtype=torch.int64)
        mean = view[:, 0]
        _summaries[(closing.numel(),)](
            mean, closing, ops._store_summary, MEAN_BLOCK=mean.stride(0), BLOCK_SIZE=block
        )

    ours = step5.summary_writer(block)
    assert_same_bytes(spec, KVCacheLayout.LBHNC, lambda view: ours(LAYER, view, slots), vllms)


@pytest.mark.parametrize("platform", ["nvidia", "amd"])
def test_sconv_index_math_is_fused_sconv(platform):
    """Step 1 of ``fused_sconv`` (nvidia|amd/ops/sconv.py) inserts each
    token's stream channels into its paged slot."""
    sconv = import_model(f"vllm.models.inkling.{platform}.ops.sconv", writer=True)
    _, state, spec = rows.inkling_state(platform)
    block = spec.block_size
    slots = [0, block - 1, block, 2 * block + 1]
    ours = rows.sconv_writer(state, block)

    def vllms(view: torch.Tensor) -> None:
        t = len(slots)
        for s, (off, width) in enumerate(state.stream_ranges):
            x = random_tokens((t, rows.INK_HEADS * width), torch.bfloat16, seed=s).contiguous()
            weight = torch.zeros(rows.INK_HEADS * width, block, dtype=torch.bfloat16)
            sconv.fused_sconv(
                x,
                weight,
                view,
                torch.tensor(slots, dtype=torch.int64),  # positions
                torch.arange(3, dtype=torch.int32).unsqueeze(0),  # block table
                torch.zeros(t, dtype=torch.int32),  # seq_idx
                torch.tensor(slots, dtype=torch.int64),  # slot mapping
                torch.zeros(t, dtype=torch.int32),  # query start
                off,
                width,
                block,
            )

    assert_same_bytes(spec, KVCacheLayout.LBHNC, lambda view: ours(LAYER, view, slots), vllms)
