"""Quantized pages of the generic backends (``pages/flashinfer_nvfp4.py``,
``pages/quantized.py``): tails zeroed byte for byte as vLLM's writers leave a
page written with only the valid tokens, on 0.32, 0.33 and 0.34.

Views are vLLM's (the backend's own ``customize_spec``,
``compute_layout_strides`` + ``create_kv_cache_views``). The reference pages
are written (line numbers: 0.32 / 0.33 / 0.34, under ``vllm/v1/attention/``):

- by vLLM's own Triton writers, interpreted: per-token-head through
  ``backends/triton_attn.py`` ``_pth_key_value_caches`` (l.706/738/741) into
  ``ops/triton_reshape_and_cache_flash.py`` ``_reshape_cache_per_token_head``
  (l.155/169/169) and ``ops/int4_per_token_head.py``
  ``_reshape_cache_int4_kernel`` (l.65); ``ops/triton_turboquant_store.py``
  (AoS ``slot_base``, l.180/268) and ``ops/turboquant_soa/
  triton_turboquant_store.py`` (``data_base`` l.172/288,
  ``head_meta_u16_base`` l.180/295); ``ops/ultraquant/triton_store.py``
  (``slot_base`` l.151/151/132 from ``_kv_cache_flat``, l.40);
- through vLLM's own views where the writer is compiled: FlashInfer NVFP4
  through ``backends/flashinfer.py`` ``_nvfp4_kv_views`` (l.116/126/128; the
  FA2 path's FlashInfer append writes exactly these views), with the SM100 V
  scales at csrc/libtorch_stable/nvfp4_kv_cache_kernels.cu
  ``swizzle_scale_offset`` (its ``kv == 1`` branch); B12X through
  ``backends/b12x.py`` ``_kv_cache_views`` (l.882/886/883: what
  ``reshape_and_cache_flash`` gets); ROCm Octave as ``ops/rocm_octave.py``
  ``reference_quantize`` slots (l.287) at block/head/token
  (``rocm_octave_attn.py`` ``supported_kv_cache_layouts``, l.137).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtail_connector.ops import RegionCache
from kvtail_connector.pages import UnmappedPage, layer_cache
from tests.helpers.stub_imports import import_with_stubs
from tests.helpers.vllm_triton import import_writer
from tests.ops.test_zero_kv_blocks import PATHS
from tests.scheduler.pages import model_harness as mh

BLOCK, HEADS = 16, 2
# Every zeroing path that runs here (torch; Triton under the interpreter), on
# the same written pages: writing them runs vLLM's writers interpreted.
ZEROERS = tuple(backend for backend, _ in PATHS)
HND, NHD = KVCacheLayout.LBHNC, KVCacheLayout.LBNHC
_B = "vllm.v1.attention.backends."


def _layer(backend: type, **impl: Any) -> SimpleNamespace:
    return SimpleNamespace(attn_backend=backend, impl=SimpleNamespace(**impl) if impl else None)


def _spec(backend: type, head_size: int, dtype: torch.dtype, mode: KVQuantMode) -> Any:
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=head_size, dtype=dtype, kv_quant_mode=mode
    )
    return backend.customize_spec(spec)


def _check(spec, layout, write, layer, cache_type=torch.Tensor):
    """Write two layers' pages, then zero their tails through the wrapper on
    every zeroing path and compare with the pages written with only the valid
    tokens (valid counts ``model_harness.valid_counts``: 1, 5, 8, N-1, all)."""
    pages = mh.allocate(spec, layout, mh.num_blocks(BLOCK))
    case = mh.expect(pages, write, BLOCK)
    for zeroer in ZEROERS:
        caches = mh.assert_tails_exact(pages, case, layer, zeroer)
        assert all(isinstance(c, cache_type) for c in caches), (zeroer, caches)
    return pages, case


def _total() -> int:
    return mh.num_blocks(BLOCK) * BLOCK


def _per_layer(make):
    """Token data per layer name (seeded by its index), so layers differ."""
    return {name: make(seed) for seed, name in enumerate(mh.LAYERS)}


# FlashInfer NVFP4 ---------------------------------------------------------


def _nvfp4_write(fi, head_size: int, v_swizzled: bool):
    dd, s = head_size // 2, head_size // 16
    data = _per_layer(lambda k: mh.random_tokens((_total(), 2, HEADS, dd), torch.uint8, k))
    scales = _per_layer(lambda k: mh.random_tokens((_total(), 2, HEADS, s), torch.uint8, 9 + k))
    g = torch.arange(s)

    def write(name, view, slots):
        (k_data, v_data), (k_sf, v_sf), layout = fi._nvfp4_kv_views(view, HEADS)
        for slot in slots:
            b, n = divmod(slot, BLOCK)
            for side, (d, sf) in enumerate(((k_data, k_sf), (v_data, v_sf))):
                sf = sf.view(torch.uint8)
                row, col = torch.full_like(g, n), g
                if side == 1 and v_swizzled:  # swizzle_scale_offset(n, g, S)
                    row = (n // 4) * 4 + g // (s // 4)
                    col = (g % (s // 4)) * 4 + n % 4
                for h in range(HEADS):
                    if layout == "HND":
                        d[b, h, n] = data[name][slot, side, h]
                        sf[b, h, row, col] = scales[name][slot, side, h]
                    else:
                        d[b, n, h] = data[name][slot, side, h]
                        sf[b, row, h, col] = scales[name][slot, side, h]

    return write


@pytest.fixture(scope="module")
def flashinfer():
    return import_with_stubs(_B + "flashinfer")


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize(
    ("path", "layout"),
    [
        ("nvfp4_fa2", HND),
        ("nvfp4_fa2", NHD),
        ("nvfp4_fa2", KVCacheLayout.BLNHC),
        ("nvfp4_trtllm", HND),
        ("nvfp4_trtllm", KVCacheLayout.BLHNC),
    ],
    ids=["fa2-LBHNC", "fa2-LBNHC", "fa2-BLNHC", "trtllm-LBHNC", "trtllm-BLHNC"],
)
def test_flashinfer_nvfp4_tails_are_exact(flashinfer, head_size, path, layout):
    backend = flashinfer.FlashInferBackend
    spec = _spec(backend, head_size, torch.uint8, KVQuantMode.NVFP4)
    assert spec.num_head_slots == 2 * HEADS  # the layout under test is vLLM's
    write = _nvfp4_write(flashinfer, head_size, v_swizzled=path == "nvfp4_trtllm")
    flags = {"nvfp4_fa2": path == "nvfp4_fa2", "nvfp4_trtllm": path == "nvfp4_trtllm"}
    pages, case = _check(spec, layout, write, _layer(backend, **flags), RegionCache)
    # Zeroing view rows from the first stale one would wipe valid tokens' bytes.
    naive = case.written.clone()
    for view in mh.rebase(pages.views, naive).values():
        for block, valid in case.items:
            view[block, :, valid:, :] = 0
    assert not torch.equal(naive, case.expected)
    if path == "nvfp4_trtllm":  # linear V scales would wipe valid quad-mates' scales
        linear = _layer(backend, nvfp4_fa2=True, nvfp4_trtllm=False)
        with pytest.raises(AssertionError, match="bytes differ"):
            mh.assert_tails_exact(pages, case, linear, "torch")


def test_flashinfer_nvfp4_refusals(flashinfer):
    backend = flashinfer.FlashInferBackend
    spec = _spec(backend, 128, torch.uint8, KVQuantMode.NVFP4)
    nhd = mh.allocate(spec, NHD, 4).views[mh.LAYERS[0]]
    with pytest.raises(UnmappedPage, match="token-major page's V side"):
        layer_cache("l0", nhd, spec, _layer(backend, nvfp4_fa2=False, nvfp4_trtllm=True))
    with pytest.raises(UnmappedPage, match=r"impl\.nvfp4_fa2 / impl\.nvfp4_trtllm"):
        layer_cache("l0", nhd, spec, _layer(backend))
    # Head-outermost pages: _nvfp4_kv_views itself rejects them.
    lhbnc = mh.allocate(spec, KVCacheLayout.LHBNC, 4).views[mh.LAYERS[0]]
    with pytest.raises(UnmappedPage, match="dense HND or NHD"):
        layer_cache("l0", lhbnc, spec, _layer(backend, nvfp4_fa2=True, nvfp4_trtllm=False))


# TRITON_ATTN per-token-head ----------------------------------------------


@pytest.mark.parametrize("layout", [HND, NHD], ids=["HND", "NHD"])
@pytest.mark.parametrize(
    ("cache_dtype", "dtype"),
    [
        ("int8_per_token_head", torch.int8),
        ("fp8_per_token_head", torch.uint8),
        ("int4_per_token_head", torch.uint8),
    ],
    ids=["int8", "fp8", "int4"],
)
def test_triton_per_token_head_tails_are_exact(layout, cache_dtype, dtype):
    ta = import_with_stubs(_B + "triton_attn")
    ops = import_writer("vllm.v1.attention.ops.triton_reshape_and_cache_flash")
    import_writer("vllm.v1.attention.ops.int4_per_token_head")  # its lazy import, real Triton
    mode = KVQuantMode[cache_dtype.upper()]
    spec = _spec(ta.TritonAttentionBackend, 32, dtype, mode)
    kv = _per_layer(lambda k: mh.random_tokens((2, _total(), HEADS, 32), torch.bfloat16, k))

    def write(name, view, slots):
        impl = ta.TritonAttentionImpl.__new__(ta.TritonAttentionImpl)
        impl._kv_quant_mode, impl.fp8_dtype = mode, current_platform.fp8_dtype()
        impl._set_kv_ptr_range = False  # 0.34's XPU pointer-range hint
        storage = torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage())
        before = storage.clone()
        key_cache, value_cache = impl._pth_key_value_caches(view)  # vLLM's own views
        storage.copy_(before)  # undo 0.32/0.33's one-time scale fill (no token's bytes)
        index = torch.tensor(list(slots), dtype=torch.int64)
        ops.triton_reshape_and_cache_flash_per_token_head_quant(
            kv[name][0][index],
            kv[name][1][index],
            key_cache,
            value_cache,
            impl._k_scale_cache,
            impl._v_scale_cache,
            index,
            kv_quant_mode=mode,
        )

    _check(spec, layout, write, _layer(ta.TritonAttentionBackend))


# B12X K|V planes ----------------------------------------------------------


@pytest.mark.parametrize("layout", [HND, KVCacheLayout.BLHNC], ids=str)
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "fp8"])
def test_b12x_planes_tails_are_exact(layout, cache_dtype):
    b12x = import_with_stubs(_B + "b12x")
    fp8 = cache_dtype == "fp8"
    dtype = torch.uint8 if fp8 else torch.bfloat16
    mode = KVQuantMode.FP8_PER_TENSOR if fp8 else KVQuantMode.NONE
    spec = _spec(b12x.B12xPagedAttentionBackend, 64, dtype, mode)
    kv = _per_layer(lambda k: mh.random_tokens((2, _total(), HEADS, 64), dtype, k))

    def write(name, view, slots):
        impl = b12x.B12xPagedAttentionImpl.__new__(b12x.B12xPagedAttentionImpl)
        impl.num_kv_heads, impl.head_size, impl.kv_cache_dtype = HEADS, 64, cache_dtype
        impl.kv_torch_dtype = current_platform.fp8_dtype() if fp8 else torch.bfloat16
        planes = impl._kv_cache_views(view)  # [B, N, Hkv, D] each
        for slot in slots:
            for side, plane in enumerate(planes):
                target = plane.view(torch.uint8) if fp8 else plane
                target[slot // BLOCK, slot % BLOCK] = kv[name][side][slot]

    _check(spec, layout, write, _layer(b12x.B12xPagedAttentionBackend))


# TurboQuant (AoS and SoA) and UltraQuant ---------------------------------

TQ_PRESETS = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]


@pytest.mark.parametrize("soa", [False, True], ids=["AoS", "SoA"])
@pytest.mark.parametrize("preset", TQ_PRESETS)
def test_turboquant_tails_are_exact(soa, preset):
    tq = import_with_stubs(_B + "turboquant_attn")
    store = "turboquant_soa.triton_turboquant_store" if soa else "triton_turboquant_store"
    ops = import_writer("vllm.v1.attention.ops." + store, stubs=True)
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    d, mode = 64, KVQuantMode[preset.upper()]
    spec = _spec(tq.TurboQuantAttentionBackend, d, torch.uint8, mode)
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    kv = _per_layer(
        lambda k: torch.randn(2, _total(), HEADS, d, generator=torch.Generator().manual_seed(k))
    )
    centroids = torch.linspace(-0.2, 0.2, cfg.n_centroids)
    midpoints = (centroids[1:] + centroids[:-1]) / 2
    extra = {"centroids": centroids, "norm_correction": cfg.norm_correction} if soa else {}

    def write(name, view, slots):
        index = torch.tensor(list(slots), dtype=torch.int64)
        ops.triton_turboquant_store(
            kv[name][0][index],
            kv[name][1][index],
            view.transpose(1, 2),
            index,
            torch.eye(d),
            midpoints,
            mse_bits=cfg.key_mse_bits,
            key_packed_size=cfg.key_packed_size,
            value_quant_bits=cfg.effective_value_quant_bits,
            key_fp8=cfg.key_fp8,
            **extra,
        )

    layer = _layer(tq.TurboQuantAttentionBackend, _soa_store=soa)
    _check(spec, NHD, write, layer, RegionCache if soa else torch.Tensor)


def test_ultraquant_tails_are_exact():
    uq = import_with_stubs(_B + "ultraquant_attn")
    ops = import_writer("vllm.v1.attention.ops.ultraquant.triton_store", stubs=True)
    spec = _spec(uq.UltraQuantAttentionBackend, 64, torch.uint8, KVQuantMode.ULTRAQUANT_4BIT)
    kv = _per_layer(lambda k: mh.random_tokens((2, _total(), HEADS, 64), torch.bfloat16, k))

    def write(name, view, slots):
        index = torch.tensor(list(slots), dtype=torch.int64)
        ops.ultraquant_store(kv[name][0][index], kv[name][1][index], view.transpose(1, 2), index)

    _check(spec, NHD, write, _layer(uq.UltraQuantAttentionBackend))


def test_turboquant_and_ultraquant_refusals():
    tq = import_with_stubs(_B + "turboquant_attn")
    uq = import_with_stubs(_B + "ultraquant_attn")
    spec = _spec(tq.TurboQuantAttentionBackend, 128, torch.uint8, KVQuantMode.TURBOQUANT_K8V4)
    c = spec.state_content_bytes
    # Pages padded past the content: token-major but not dense.
    padded = torch.zeros(4, BLOCK * HEADS * c + 64, dtype=torch.uint8)[:, : BLOCK * HEADS * c]
    padded = padded.view(4, BLOCK, HEADS, c).transpose(1, 2)
    with pytest.raises(UnmappedPage, match="_soa_store"):
        layer_cache("l0", padded, spec, _layer(tq.TurboQuantAttentionBackend))
    with pytest.raises(UnmappedPage, match=r"flattens the page with view\(-1\)"):
        layer_cache("l0", padded, spec, _layer(tq.TurboQuantAttentionBackend, _soa_store=True))
    uq_spec = _spec(uq.UltraQuantAttentionBackend, 128, torch.uint8, KVQuantMode.ULTRAQUANT_4BIT)
    c = uq_spec.state_content_bytes
    backing = torch.zeros(5, BLOCK * HEADS * c + 64, dtype=torch.uint8)[1:, : BLOCK * HEADS * c]
    strided = backing.view(4, BLOCK, HEADS, c).transpose(1, 2)  # storage offset != 0
    with pytest.raises(UnmappedPage, match="_kv_cache_flat"):
        layer_cache("l0", strided, uq_spec, _layer(uq.UltraQuantAttentionBackend))


# ROCm Octave ---------------------------------------------------------------


@mh.needs((0, 33), "no ROCM_OCTAVE backend (added in 0.33)")
@pytest.mark.parametrize("layout", [HND, NHD], ids=["HND", "NHD"])
@pytest.mark.parametrize("cache_dtype", ["octave_k3v4", "octave_k3v3", "octave_k3v3_compact"])
def test_rocm_octave_tails_are_exact(layout, cache_dtype):
    octave = import_with_stubs(_B + "rocm_octave_attn")
    sq = octave.sq  # vllm.v1.attention.ops.rocm_octave
    sq.register_rope_dim(256, 64)
    backend = octave.RocmOctaveAttentionBackend
    spec = _spec(backend, 256, torch.uint8, KVQuantMode[cache_dtype.upper()])
    fmt = sq.OctaveFormat.from_cache_dtype(cache_dtype, 256, 64)
    assert spec.state_content_bytes == fmt.slot_bytes
    gen = torch.Generator().manual_seed(3)
    slot_bytes = {
        name: sq.reference_quantize(
            torch.randn(_total(), HEADS, 256, generator=gen),
            torch.randn(_total(), HEADS, 256, generator=gen),
            fmt,
        )
        for name in mh.LAYERS
    }

    def write(name, view, slots):
        for slot in slots:
            view[slot // BLOCK, :, slot % BLOCK] = slot_bytes[name][slot]

    _check(spec, layout, write, _layer(backend))
