"""DeepSeek V3.2 / V4 / V4.1 pages (``pages/deepseek.py``): tails zeroed byte
for byte as vLLM's writers leave a page written with only the valid tokens,
on 0.32, 0.33 and 0.34.

Specs come from vLLM's own ``get_kv_cache_spec`` (the layer stood in by a
namespace), views from ``compute_layout_strides`` + ``create_kv_cache_views``.
Pages are written by the index math of vLLM's writers (line numbers for
0.32 / 0.33 / 0.34), which ``test_*_writer_puts_bytes_where_the_index_math_
says`` checks against vLLM's own Triton writers run under the interpreter
wherever they do not need a GPU instruction:

- rows (V3.2 ``fp8_ds_mla`` / ``nvfp4_ds_mla`` / bf16; V4.1 records on 0.33+):
  state ``n`` of block ``b`` is ``view[b, 0, n, :]``: deepseek_v32/common/
  kernels.py ``mla_block_idx * mla_cache_block_stride + mla_block_off *
  mla_cache_entry_stride`` at 306 / 313 / 313 (nvfp4), 358 / 365 / 365
  (fp8_ds_mla), 381 / 388 / 388 (bf16); deepseek_v41/common/ops/
  fused_compress_quant_cache.py ``values = page + (slot % CACHE_BLOCK) * 528``,
  ``scales = values + 512`` at - / 465-466 / 465-466, 288: - / 528-530 / 528-530.
- split, data at ``n * D`` and scales at ``N * D + n * S`` of the page: the V4
  record, deepseek_v4/common/ops/cache_utils.py 97+102 / 98+103 / 98+103,
  fused_compress_quant_cache.py 265-268 / 267-270 / 267-270, deepseek_v41 ...
  fused_compress_quant_cache.py 326-327 / 398-399 / 398-399; V4.1 records on
  0.32, the same file 393-394 (528) and 457-460 (288); indexer keys,
  deepseek_v32 kernels.py 110+113 / 113+116 / 113+116, deepseek_v4
  fused_compress_quant_cache.py 827-830 / 830-833 / 830-833 (fp8) and
  1014-1017 / 1021-1024 / 1021-1024 (MXFP4), deepseek_v41/common/ops/
  indexer_k_store.py 203+206 / 208+211 / 208+211, kimi_k3/nvidia/ops/
  dsa_indexer.py 73-76 and dsa_indexer_mxfp4.py 107-112 (0.34).
- compressed states (ratio r): state ``s`` is written when token
  ``(s + 1) * r - 1`` arrives (``if (position + 1) % COMPRESS_RATIO != 0:
  return``, deepseek_v4 fused_compress_quant_cache.py 201 / 203 / 203).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace as NS
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtail_connector.ops import RegionCache
from kvtail_connector.pages import UnmappedPage, deepseek, layer_cache
from tests.helpers.stub_imports import import_with_stubs
from tests.helpers.vllm_triton import import_writer
from tests.ops.test_zero_kv_blocks import PATH_IDS, PATHS
from tests.scheduler.pages import model_harness as mh

ZEROERS = pytest.mark.parametrize("zeroer", [b for b, _ in PATHS], ids=PATH_IDS)
LAYOUTS = pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC], ids=str)
V41_ROWS = mh.VERSION >= (0, 33)  # the V4.1 records' layout on this release (see above)
_MLA = "vllm.v1.attention.backends.mla."


@contextlib.contextmanager
def cpu_build_imports() -> Iterator[None]:
    """Import vLLM modules as its CPU build does: 0.34's ``jit_warmup_triton_
    helper`` asks ``HAS_TRITON`` at decoration time, which this suite's conftest
    turns on (for 0.34's config check) beside its placeholder ``triton``."""
    helper = importlib.import_module("vllm.model_executor.warmup.jit_warmup_triton_helper")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(helper, "HAS_TRITON", False, raising=False)
        yield


def vllm_module(module: str) -> Any:
    with cpu_build_imports():
        return import_with_stubs(module)


def backend(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(vllm_module(module), name)


def layer(path: str) -> NS:
    return NS(attn_backend=backend(path))


def _config(cache_dtype: str, block_size: int) -> NS:
    return NS(
        cache_config=NS(block_size=block_size, cache_dtype=cache_dtype),
        model_config=NS(dtype=torch.bfloat16),
    )


# Specs, from vLLM's own get_kv_cache_spec --------------------------------


def v32_spec(cache_dtype: str) -> Any:
    mla = vllm_module("vllm.model_executor.layers.attention.mla_attention")
    impl = NS(get_fp8_ds_mla_row_bytes=lambda: 656)  # 0.34's AttentionImpl default
    self = NS(
        kv_cache_dtype=cache_dtype,
        head_size=576,
        sliding_window=None,
        indexer=None,
        non_causal_multi_token_decode=False,
        topk_buffer_width=None,
        impl=impl,
    )
    return mla.MLAAttention.get_kv_cache_spec(self, _config(cache_dtype, 64))


def v32_indexer_spec(head: int = 132) -> Any:
    v2 = vllm_module("vllm.model_executor.models.deepseek_v2")
    self = NS(cache_config=NS(block_size=64), head_dim=head, dtype=torch.uint8)
    return v2.DeepseekV32IndexerCache.get_kv_cache_spec(self, _config("fp8_ds_mla", 64))


def swa_spec(record: int, cache_dtype: str) -> Any:
    swa = vllm_module(_MLA + "sparse_swa")
    self = NS(
        bounded_replay=False,
        block_size=64,
        head_dim=512,
        dtype=torch.uint8,
        window_size=128,
        cache_config=NS(cache_dtype=cache_dtype),
        packed_bytes_per_token=record,
        packed_page_alignment=576 if record == 584 else 512,
        packed_block_stride_alignment=None,
    )
    return swa.DeepseekV4SWACache.get_kv_cache_spec(self, _config(cache_dtype, 64))


def compressed_spec(model: str, record: int, ratio: int, cache_dtype: str) -> Any:
    attn = vllm_module(f"vllm.models.{model}.attention")
    self = NS(
        compress_ratio=ratio,
        kv_cache_dtype=cache_dtype,
        head_dim=512,
        kv_cache_torch_dtype=torch.uint8,
        is_kv_source=True,
        compressed_bytes_per_token=record,
        kv_page_alignment=576 if record == 584 else 512,
    )
    return attn.DeepseekV4Attention.get_kv_cache_spec(self, _config(cache_dtype, 256))


def v4_indexer_spec(model: str, head: int, ratio: int) -> Any:
    attn = vllm_module(f"vllm.models.{model}.attention")
    self = NS(
        cache_config=NS(block_size=256),
        head_dim=head,
        dtype=torch.uint8,
        compress_ratio=ratio,
        sparse_logits=False,
        rocm_mxfp4=False,
    )
    return attn.DeepseekV4IndexerCache.get_kv_cache_spec(self, _config("fp8_ds_mla", 256))


def state_spec(ratio: int) -> Any:
    compressor = vllm_module("vllm.models.deepseek_v4.compressor")
    coff = 2 if ratio == 4 else 1
    self = NS(
        block_size=4 if ratio == 4 else 8,
        state_dim=2 * coff * 512,
        dtype=torch.float32,
        sliding_window=coff * ratio,
    )
    return compressor.CompressorStateCache.get_kv_cache_spec(self, _config("fp8_ds_mla", 256))


# Writers: the index math of vLLM's writers -------------------------------


def _states(slots: Sequence[int], n: int, ratio: int) -> Iterator[tuple[int, int]]:
    """``(block, state)`` of each state the tokens at ``slots`` complete."""
    for slot in slots:
        block, token = divmod(int(slot), n * ratio)
        if (token + 1) % ratio == 0:
            yield block, token // ratio


def writer(
    n: int, ratio: int, width: int, split: tuple[int, int] | None, dtype: torch.dtype = torch.uint8
) -> mh.Writer:
    """Store each completed state's ``width`` bytes (elements) as a row, or
    ``split`` into (data, scales) at ``s * D`` and ``N * D + s * S``."""
    states = mh.num_blocks(n * ratio) * n
    tokens = {k: mh.random_tokens((states, width), dtype, i) for i, k in enumerate(mh.LAYERS)}

    def write(name: str, view: torch.Tensor, slots: Sequence[int]) -> None:
        assert view.shape[2] == n
        for block, s in _states(slots, n, ratio):
            token = tokens[name][block * n + s]
            if split is None:
                view[block, 0, s] = token
                continue
            data, scales = split
            page = view[block, 0].view(-1)  # [N * C], contiguous
            page[s * data : (s + 1) * data] = token[:data]
            page[n * data + s * scales : n * data + (s + 1) * scales] = token[data:]

    return write


def check(
    spec: Any, layout: KVCacheLayout, write: mh.Writer, path: str, zeroer: str, ratio: int
) -> tuple[mh.Pages, mh.Expectation, list[Any]]:
    n = spec.num_states
    pages = mh.allocate(spec, layout, mh.num_blocks(n * ratio))
    case = mh.expect(pages, write, n * ratio)
    caches = mh.assert_tails_exact(pages, case, layer(path), zeroer)
    return pages, case, caches


def assert_rows_would_be_wrong(pages: mh.Pages, case: mh.Expectation, ratio: int) -> None:
    """Zeroing view rows from the first stale state wipes valid scales."""
    naive = case.written.clone()
    for view in mh.rebase(pages.views, naive).values():
        for block, valid in case.items:
            view[block, :, valid // ratio :, :] = 0
    assert not torch.equal(naive, case.expected)


# V3.2 FLASHMLA_SPARSE rows -------------------------------------------------


@ZEROERS
@LAYOUTS
@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "nvfp4_ds_mla", "auto"])
def test_v32_latent_rows_tails_are_exact(zeroer, layout, cache_dtype):
    spec = v32_spec(cache_dtype)
    bf16 = cache_dtype == "auto"
    width = 576 if bf16 else spec.state_content_bytes
    write = writer(64, 1, width, None, torch.bfloat16 if bf16 else torch.uint8)
    _, _, caches = check(spec, layout, write, deepseek.V32_BACKEND, zeroer, 1)
    assert all(isinstance(c, torch.Tensor) for c in caches)


# V4 / V4.1 packed records ---------------------------------------------------

_V4, _V41 = "vllm.models.deepseek_v4.", "vllm.models.deepseek_v41."
RECORD_CASES = [
    # (model, record, ratio, cache_dtype, backend)
    ("deepseek_v4", 584, 1, "fp8_ds_mla", deepseek.SWA_BACKEND),
    ("deepseek_v4", 584, 1, "fp8_ds_mla", _V4 + "nvidia.flashmla.DeepseekSparseSWAFlashMLABackend"),
    ("deepseek_v4", 584, 4, "fp8_ds_mla", _V4 + "sparse_mla.DeepseekV4FlashMLABackend"),
    ("deepseek_v4", 584, 128, "fp8_ds_mla", _V4 + "cpu.cpu_mla.DeepseekV4CPUSparseBackend"),
    ("deepseek_v41", 584, 2, "fp8_ds_mla", _V41 + "sparse_mla.DeepseekV4FlashMLABackend"),
    (
        "deepseek_v41",
        528,
        1,
        "nvfp4_ds_mla",
        _V41 + "nvidia.flashmla.DeepseekSparseSWAFlashMLABackend",
    ),
    ("deepseek_v41", 528, 2, "fp8_ds_mla", _V41 + "sparse_mla.FlashMLAMegaAttnBackend"),
    ("deepseek_v41", 288, 2, "nvfp4_ds_mla", _V41 + "sparse_mla.DeepseekV4FlashMLABackend"),
]
SPLITS = {584: (576, 8), 528: (512, 16), 288: (256, 32)}


def record_spec(model: str, record: int, ratio: int, cache_dtype: str) -> Any:
    if ratio == 1:
        return swa_spec(record, cache_dtype)
    return compressed_spec(model, record, ratio, cache_dtype)


def record_split(record: int) -> tuple[int, int] | None:
    return None if record != 584 and V41_ROWS else SPLITS[record]


@ZEROERS
@LAYOUTS
@pytest.mark.parametrize(
    ("model", "record", "ratio", "cache_dtype", "path"),
    RECORD_CASES,
    ids=[f"{r}B-r{k}-{p.rsplit('.', 1)[1]}" for _, r, k, _, p in RECORD_CASES],
)
def test_packed_record_tails_are_exact(zeroer, layout, model, record, ratio, cache_dtype, path):
    spec = record_spec(model, record, ratio, cache_dtype)
    assert spec.state_content_bytes == record and spec.tokens_per_state == ratio
    split = record_split(record)
    write = writer(spec.num_states, ratio, record, split)
    pages, case, caches = check(spec, layout, write, path, zeroer, ratio)
    if split is None:
        assert all(isinstance(c, torch.Tensor) for c in caches)
    else:
        assert all(isinstance(c, RegionCache) for c in caches)
        assert_rows_would_be_wrong(pages, case, ratio)


# V4 compressor state ----------------------------------------------------------


@ZEROERS
@LAYOUTS
@pytest.mark.parametrize("ratio", [4, 128], ids=["c4", "c128"])
def test_compressor_state_tails_are_exact(monkeypatch, zeroer, layout, ratio):
    # save_partial_states.py 66-78 (all releases): token n's [kv | score] row at
    # block * stride0 + n * stride1. A c4 block holds 4 tokens: valid counts
    # past it (5, 8) are no tail of it.
    spec = state_spec(ratio)
    n = spec.block_size
    if n < 9:
        monkeypatch.setattr(mh, "valid_counts", lambda tokens: (1, 2, tokens - 1, 0))
    write = writer(n, 1, spec.head_size, None, torch.float32)
    _, _, caches = check(spec, layout, write, deepseek.COMPRESSOR_BACKEND, zeroer, 1)
    assert all(isinstance(c, torch.Tensor) for c in caches)


# Indexer keys ---------------------------------------------------------------

INDEXER_CASES = [
    # (model, head bytes, ratio, backend)
    ("deepseek_v32", 132, 1, _MLA + "indexer.DeepseekV32IndexerBackend"),
    ("deepseek_v4", 132, 4, _MLA + "indexer.DeepseekV4IndexerBackend"),
    ("deepseek_v4", 68, 4, _MLA + "indexer.DeepseekV4IndexerBackend"),
    ("deepseek_v4", 132, 4, "vllm.models.deepseek_v4.cpu.cpu_mla.DeepseekV4CPUIndexerBackend"),
    ("deepseek_v41", 132, 2, _MLA + "indexer.DeepseekV41IndexerBackend"),
    ("deepseek_v41", 68, 1, _MLA + "sparse_indexer.DeepseekV41SparseIndexerBackend"),
]


def indexer_spec(model: str, head: int, ratio: int) -> Any:
    if model == "deepseek_v32":
        return v32_indexer_spec(head)
    return v4_indexer_spec(model, head, ratio)


@ZEROERS
@LAYOUTS
@pytest.mark.parametrize(
    ("model", "head", "ratio", "path"),
    INDEXER_CASES,
    ids=[f"{m}-{h}B-r{r}-{p.rsplit('.', 1)[1]}" for m, h, r, p in INDEXER_CASES],
)
def test_indexer_key_tails_are_exact(zeroer, layout, model, head, ratio, path):
    spec = indexer_spec(model, head, ratio)
    write = writer(spec.num_states, ratio, head, (head - 4, 4))
    pages, case, caches = check(spec, layout, write, path, zeroer, ratio)
    assert all(isinstance(c, RegionCache) for c in caches)
    assert_rows_would_be_wrong(pages, case, ratio)


@mh.needs((0, 34), "no Kimi K3 DSA indexer (KimiK3IndexerBackend, added in 0.34)")
@ZEROERS
@pytest.mark.parametrize("head", [132, 68], ids=["fp8", "mxfp4"])
def test_kimi_k3_indexer_key_tails_are_exact(zeroer, head):
    # KimiK3IndexerCache is a DeepseekV32IndexerCache: the same spec.
    spec = v32_indexer_spec(head)
    path = "vllm.models.kimi_k3.common.dsa_cache.KimiK3IndexerBackend"
    write = writer(64, 1, head, (head - 4, 4))
    check(spec, KVCacheLayout.BLHNC, write, path, zeroer, 1)


# vLLM's own writers put the bytes where the index math says ---------------
#
# Each writer runs under Triton's interpreter for a few tokens of one layer,
# once over a backing of 0x00 and once over 0xFF: every byte it stores differs
# from one of the two fills, so the union of changed bytes is exactly its
# footprint, which must be the index math's. GPU-only instructions (the e2m1
# packing's ``inline_asm_elementwise``) return zeros: values, not addresses.


WRITER_HELPERS = (
    "vllm.v1.attention.ops.common",  # 0.34's pack_ue8m0_x4
    "vllm.models.deepseek_v4.common.ops.fused_indexer_q",  # _fp32x2_to_fp4x2
    "vllm.models.deepseek_v4.common.ops.cache_utils",  # 0.34 V4.1 imports its kernel
    "vllm.models.deepseek_v41.common.ops",  # re-exports _fp32x2_to_fp4x2
)


def footprint(spec: Any, run: Callable[[torch.Tensor], None]) -> torch.Tensor:
    pages = mh.allocate(spec, KVCacheLayout.BLHNC, 4)
    changed = torch.zeros(pages.raw.shape, dtype=torch.bool)
    for fill in (0, -1):
        pages.raw.fill_(fill)
        run(pages.views[mh.LAYERS[0]])
        changed |= pages.raw != fill
    return changed


def assert_same_footprint(
    spec: Any, run: Callable[[torch.Tensor], None], want: mh.Writer, tokens: list[int]
) -> None:
    expected = footprint(spec, lambda view: want(mh.LAYERS[0], view, tokens))
    got = footprint(spec, run)
    assert got.any() and torch.equal(got, expected), (
        f"vLLM's writer stores {int(got.sum())} bytes, the index math {int(expected.sum())}; "
        f"{int((got ^ expected).sum())} differ"
    )


@pytest.fixture
def vllm_writers(monkeypatch):
    import numpy as np
    import triton.runtime.interpreter as interpreter

    def no_asm(builder, asm, constraints, values, types, is_pure, pack):
        shape = values[0].data.shape
        results = [
            interpreter.TensorHandle(np.zeros(shape, interpreter._get_np_dtype(t)), t.scalar)
            for t in types
        ]
        return NS(get_result=lambda i: results[i])

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", no_asm)

    def load(module: str) -> Any:
        # The @triton.jit helpers the writers call, imported again with the real
        # Triton first (a module the specs imported holds the placeholder's).
        with cpu_build_imports():
            for helper in WRITER_HELPERS:
                import_writer(helper, stubs=True)
            return import_writer(module, stubs=True)

    return load


def _tokens(n: int, ratio: int) -> list[int]:
    """Tokens of blocks 1 and 2: state edges, mid-state tokens, the last."""
    bt = n * ratio
    return [bt + t for t in (0, 1, 2, 5, 9, 10, bt - 1)] + [2 * bt + 4, 2 * bt + 2 * ratio - 1]


def _state_slots(tokens: list[int], n: int, ratio: int) -> torch.Tensor:
    # compressor_utils.CompressedSlotMappingKernel: block * N + pos // ratio
    # (the writers skip tokens that close no state themselves).
    return torch.tensor([t // (n * ratio) * n + t % (n * ratio) // ratio for t in tokens])


def _bf16(*shape: int) -> torch.Tensor:
    return _f32(*shape).to(torch.bfloat16)


def _f32(*shape: int) -> torch.Tensor:
    """Writer inputs, the same on both passes of ``footprint``."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _fused_norm_rope(load, tokens: list[int], cache_dtype: str, indexer: bool):
    kernels = load("vllm.models.deepseek_v32.common.kernels")
    t = len(tokens)
    slots = torch.tensor(tokens)

    def run(view: torch.Tensor) -> None:
        cache = view.squeeze(1)  # bind_kv_cache: [B, N, C]
        kernels.fused_norm_rope(
            slots,
            _bf16(t, 16),
            torch.ones(16, dtype=torch.bfloat16),
            1e-6,
            _bf16(t, 512),
            torch.ones(512, dtype=torch.bfloat16),
            1e-6,
            _bf16(t, 64),
            _bf16(4096, 64),
            _bf16(t, 128) if indexer else None,
            torch.ones(128) if indexer else None,
            torch.zeros(128) if indexer else None,
            1e-6,
            _bf16(4096, 64) if indexer else None,
            torch.empty(t, 8, dtype=torch.int32),
            slot_mapping=slots,
            indexer_k_cache=cache if indexer else None,
            mla_kv_cache=None if indexer else cache,
            mla_kv_cache_dtype=cache_dtype,
            has_indexer=indexer,
        )

    return run


@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "nvfp4_ds_mla", "auto"])
def test_v32_writer_puts_bytes_where_the_index_math_says(vllm_writers, cache_dtype):
    spec, tokens = v32_spec(cache_dtype), _tokens(64, 1)
    bf16 = cache_dtype == "auto"
    width = 576 if bf16 else spec.state_content_bytes
    want = writer(64, 1, width, None, torch.bfloat16 if bf16 else torch.uint8)
    run = _fused_norm_rope(vllm_writers, tokens, cache_dtype, indexer=False)
    assert_same_footprint(spec, run, want, tokens)


def test_v32_indexer_writer_puts_bytes_where_the_index_math_says(vllm_writers):
    spec, tokens = v32_indexer_spec(), _tokens(64, 1)
    run = _fused_norm_rope(vllm_writers, tokens, "auto", indexer=True)
    assert_same_footprint(spec, run, writer(64, 1, 132, (128, 4)), tokens)


@pytest.mark.parametrize(
    ("model", "record", "ratio", "cache_dtype"),
    [
        ("deepseek_v4", 584, 1, "fp8_ds_mla"),
        ("deepseek_v41", 528, 1, "fp8_ds_mla"),
        ("deepseek_v41", 584, 2, "fp8_ds_mla"),
        ("deepseek_v41", 528, 2, "fp8_ds_mla"),
        ("deepseek_v41", 288, 2, "nvfp4_ds_mla"),
    ],
    ids=["v4-584-swa", "v41-528-swa", "v41-584-r2", "v41-528-r2", "v41-288-r2"],
)
def test_record_writer_puts_bytes_where_the_index_math_says(
    vllm_writers, model, record, ratio, cache_dtype
):
    spec = record_spec(model, record, ratio, cache_dtype)
    n = spec.num_states
    tokens = _tokens(n, ratio)
    if ratio == 1:  # the SWA insert (cache_utils.quantize_and_insert_k_cache)
        ops = vllm_writers(f"vllm.models.{model}.common.ops.cache_utils")
        extra = {} if model == "deepseek_v4" else {"bytes_per_token": record}

        def run(view: torch.Tensor) -> None:
            cache = view.squeeze(1).view(view.shape[0], -1)  # as the inserts view it
            ops.quantize_and_insert_k_cache(
                _bf16(len(tokens), 512), cache, torch.tensor(tokens), block_size=n, **extra
            )
    else:  # the compressed insert (fused_compress_quant_cache.rope_quant_insert)
        ops = vllm_writers(f"vllm.models.{model}.common.ops.fused_compress_quant_cache")

        def run(view: torch.Tensor) -> None:
            ops.rope_quant_insert(
                _bf16(len(tokens), 512).contiguous(),
                torch.tensor(tokens),
                _f32(4096, 64),
                view.squeeze(1),
                _state_slots(tokens, n, ratio),
                ratio,
            )

    assert_same_footprint(spec, run, writer(n, ratio, record, record_split(record)), tokens)


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("head", [132, 68], ids=["fp8", "mxfp4"])
def test_v41_indexer_writer_puts_bytes_where_the_index_math_says(vllm_writers, head, ratio):
    ops = vllm_writers("vllm.models.deepseek_v41.common.ops.indexer_k_store")
    spec = v4_indexer_spec("deepseek_v41", head, ratio)
    n = spec.num_states
    tokens = _tokens(n, ratio)

    def run(view: torch.Tensor) -> None:
        ops.indexer_k_norm_rope_store(
            _bf16(len(tokens), 128),
            torch.tensor(tokens),
            _f32(4096, 64),
            torch.ones(128),
            1e-6,
            view.squeeze(1),
            _state_slots(tokens, n, ratio),
            ratio,
            head == 68,
        )

    assert_same_footprint(spec, run, writer(n, ratio, head, (head - 4, 4)), tokens)


@mh.needs((0, 34), "no Kimi K3 DSA indexer (KimiK3IndexerBackend, added in 0.34)")
@pytest.mark.parametrize("head", [132, 68], ids=["fp8", "mxfp4"])
def test_kimi_k3_indexer_writer_puts_bytes_where_the_index_math_says(vllm_writers, head):
    ops = vllm_writers("vllm.models.kimi_k3.nvidia.ops.dsa_indexer")
    if head == 68:
        ops = vllm_writers("vllm.models.kimi_k3.nvidia.ops.dsa_indexer_mxfp4")
    insert = ops.mxfp4_k_norm_quant_insert if head == 68 else ops.indexer_k_norm_quant_insert
    spec, tokens = v32_indexer_spec(head), _tokens(64, 1)
    t = len(tokens)

    def run(view: torch.Tensor) -> None:
        topk = torch.empty(t, 8, dtype=torch.int32)
        cache = view.squeeze(1)
        insert(
            _bf16(t, 128),
            torch.ones(128),
            torch.zeros(128),
            1e-6,
            torch.tensor(tokens),
            cache,
            topk,
            t,
        )

    assert_same_footprint(spec, run, writer(64, 1, head, (head - 4, 4)), tokens)


@pytest.mark.parametrize("ratio", [4, 128], ids=["c4", "c128"])
def test_compressor_state_writer_puts_bytes_where_the_index_math_says(vllm_writers, ratio):
    ops = vllm_writers("vllm.models.deepseek_v4.common.ops.save_partial_states")
    spec = state_spec(ratio)
    n, width = spec.block_size, spec.head_size
    half, tokens = width // 2, _tokens(n, 1)
    t = len(tokens)

    def run(view: torch.Tensor) -> None:
        cache, slots = view.squeeze(1), torch.tensor(tokens)
        kv, score, ape = _f32(t, half), _f32(t, half), _f32(ratio, half)
        ops.SavePartialStatesKernel.kernel[(t,)](
            kv,
            half,
            score,
            half,
            ape,
            half,
            slots,
            cache,
            cache.stride(0),
            cache.stride(1),
            slots,
            n,
            HEAD_SIZE=half,
            TRITON_BLOCK_SIZE=half,
            STATE_WIDTH=half,
            COMPRESS_RATIO=ratio,
        )

    assert_same_footprint(spec, run, writer(n, 1, width, None, torch.float32), tokens)


# Refusals -------------------------------------------------------------------


def _refusal(spec: Any, path: str, view: torch.Tensor | None = None) -> str:
    view = mh.allocate(spec, KVCacheLayout.LBHNC, 4).views[mh.LAYERS[0]] if view is None else view
    with pytest.raises(UnmappedPage) as err:
        layer_cache(mh.LAYERS[0], view, spec, layer(path))
    text = str(err.value)
    cls = backend(path)
    for part in (repr(mh.LAYERS[0]), cls.get_name(), path):
        assert part in text, text
    return text


def test_rocm_tiled_indexer_keys_are_refused(monkeypatch):
    monkeypatch.setattr(deepseek, "on_rocm", lambda: True)
    for spec, path in (
        (v32_indexer_spec(), _MLA + "indexer.DeepseekV32IndexerBackend"),
        (v4_indexer_spec("deepseek_v4", 132, 4), _MLA + "indexer.DeepseekV4IndexerBackend"),
    ):
        assert "tiled 16 x 16" in _refusal(spec, path)


def test_rocm_paged_mxfp4_indexer_is_refused():
    spec = v4_indexer_spec("deepseek_v41", 68, 2)
    assert "AITER's paged MXFP4" in _refusal(spec, deepseek.ROCM_MXFP4_INDEXER)


def test_split_records_on_kernel_split_pages_are_refused():
    spec = swa_spec(584, "fp8_ds_mla")
    half = spec.copy_with_new_block_size(32)  # kernel pages of 32 in blocks of 64
    view = mh.allocate(half, KVCacheLayout.LBHNC, 8).views[mh.LAYERS[0]]
    assert "kernel-block splitting" in _refusal(spec, deepseek.SWA_BACKEND, view)


@pytest.mark.parametrize(
    ("make", "path"),
    [
        # GLM5Next's 512-wide NoPE-only latent: not the DeepSeek row.
        (lambda: _replace(v32_spec("fp8_ds_mla"), head_size=512), deepseek.V32_BACKEND),
        # A record width no DeepSeek writer stores.
        (
            lambda: _replace(swa_spec(584, "fp8_ds_mla"), state_content_bytes=600),
            deepseek.SWA_BACKEND,
        ),
        # The V4 record under a cache dtype that does not write it.
        (
            lambda: _replace(swa_spec(584, "fp8_ds_mla"), cache_dtype_str="fp8"),
            deepseek.SWA_BACKEND,
        ),
        # An indexer key of another width.
        (
            lambda: _replace(v32_indexer_spec(), head_size=136),
            _MLA + "indexer.DeepseekV32IndexerBackend",
        ),
    ],
    ids=["glm5next-latent", "record-width", "record-dtype", "indexer-width"],
)
def test_specs_no_writer_makes_are_refused(make: Callable[[], Any], path: str):
    assert "no page map covers" in _refusal(make(), path)


def _replace(spec: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(spec, **changes)
