"""CPU_ATTN pages: tails zeroed exactly as vLLM's cache writers lay them out.

The reference is independent of the package: a page written with only the
valid slots, next to the same page written with every slot and then
tail-zeroed through the wrapper's path (``layout.cache_sets`` -> the
zeroer). Every ISA runs here through the synthetic writers of
``tests/helpers/cpu_attn_writers.py`` (AMX included, on any CPU); the real
writer runs on the ISAs this CPU has, and the synthetic writers are checked
against it there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtail_connector import RegionCache
from kvtail_connector.core.cache_sets import cache_sets
from kvtail_connector.core.kvgroups import group_infos
from kvtail_connector.ops import KVZeroer
from kvtail_connector.pages import cpu as cpu_pages
from kvtail_connector.pages import layer_cache
from tests.helpers import cpu_attn_writers as synthetic
from tests.ops.test_zero_kv_blocks import PATH_IDS, PATHS

HAS_AMX = torch.cpu._is_amx_tile_supported()
AMX_SKIP = "this CPU has no AMX tiles: vLLM's amx writer cannot run (the synthetic one does)"
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
FP8 = "fp8"  # kv_cache_dtype of uint8 pages written from bf16 keys

# (ISA, cache dtype, kv_cache_dtype, head size): what vLLM's _get_attn_isa
# picks them for: vec (block % 32 == 0), vec16 (head size % 32 != 0), amx
# (bf16 or fp8 on an AMX CPU).
CASES = [
    ("vec", torch.float32, "auto", 32),
    ("vec", torch.bfloat16, "auto", 64),
    ("vec", torch.uint8, FP8, 64),
    ("vec16", torch.float32, "auto", 80),
    ("vec16", torch.bfloat16, "auto", 80),
    ("amx", torch.bfloat16, "auto", 64),
    ("amx", torch.uint8, FP8, 64),
]
CASE_IDS = [f"{isa}-{str(dt).split('.')[-1]}-d{d}" for isa, dt, _, d in CASES]


class _Layer:
    """The attributes vLLM's CPU attention sets on an Attention layer."""

    def __init__(
        self,
        backend: type = CPUAttentionBackend,
        isa: str | None = "vec",
        kv_cache_dtype: str = "auto",
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.attn_backend = backend
        self.isa = isa
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype = dtype


def _as_cache(name, view, layer):
    """The layer's cache as the page maps give it, for a view vLLM allocated
    from a plain spec (``[B, H, N, 2*D]``)."""
    _, heads, block, content = view.shape
    spec = FullAttentionSpec(
        block_size=block, num_kv_heads=heads, head_size=content // 2, dtype=view.dtype
    )
    return layer_cache(name, view, spec, layer)


def cpu_caches(dtype, head_size, *, heads=2, block=32, num_blocks=6):
    """Two layers' ``[B, H, N, 2*D]`` views as vLLM allocates them for CPU
    attention (LBHNC), over one int8 backing; and their config."""
    spec = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, num_blocks, len(LAYERS), KVCacheLayout.LBHNC
    )
    tensor = KVCacheTensor(
        size=0, layers=list(LAYERS), layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.zeros(len(LAYERS) * num_blocks * spec.page_size_bytes, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, num_blocks, KVCacheLayout.LBHNC, tensor)
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )
    return raw, dict(zip(LAYERS, views, strict=True)), config


# Values fp8 e4m3 represents exactly: vLLM's fp8 quantizer truncates, torch
# rounds; on these both give the same code.
_FP8_EXACT = torch.tensor([0.5, 1.0, 1.5, 2.0, -1.0, -3.0, 0.75, 4.0])


def kv_data(tokens, heads, d, dtype, seed, *, codes=False):
    """Keys and values to store. fp8 pages (``dtype`` uint8): bf16 values fp8
    represents exactly, or (``codes``) their fp8 codes, which the synthetic
    writer stores as they are."""
    gen = torch.Generator().manual_seed(seed)
    if dtype != torch.uint8:
        return tuple(torch.randn(tokens, heads, d, generator=gen).to(dtype) for _ in range(2))
    out = []
    for _ in range(2):
        picked = _FP8_EXACT[torch.randint(0, 8, (tokens, heads, d), generator=gen)]
        out.append(picked.to(torch.float8_e4m3fn).view(torch.uint8) if codes else picked.bfloat16())
    return tuple(out)


def real_write(isa, kv_cache_dtype, cache, slots, keys, values):
    b, h, n, c = cache.shape
    k_cache, v_cache = cache.view(b, h, 2 * n, c // 2).chunk(2, dim=2)
    mapping = torch.tensor(list(slots), dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(
        keys[mapping], values[mapping], k_cache, v_cache, mapping, isa,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip


def synthetic_write(isa, kv_cache_dtype, cache, slots, keys, values):
    index = list(slots)
    synthetic.write(isa, cache, index, keys[index], values[index])


def runs_here(isa, dtype, kv_cache_dtype):
    """Whether vLLM's real writer supports the case on this CPU."""
    if isa == "amx":
        return HAS_AMX
    if kv_cache_dtype != "auto":  # fp8 pages need AVX-512 or AMX
        return torch.cpu._is_avx512_supported() or HAS_AMX
    return True


def check_tails(isa, dtype, kv_cache_dtype, d, write, backend):
    """Write every slot, zero tails through cache_sets + KVZeroer, compare with
    pages written with only the valid slots (every byte of the backing)."""
    n, blocks = 32, 6
    # Mid K tile, K tile edge, the odd slot sharing V words with its pair,
    # the last slot, and a whole block. The interpreter runs a Python loop
    # per row and item: fewer of both there.
    items = [(1, 17), (2, 16), (3, 1), (4, n - 1), (5, 0)]
    heads = 2
    if backend == "triton":
        items, heads = [(1, 17), (3, 1), (5, 0)], 1
        d = 32 if isa == "amx" else d
    raw, views, config = cpu_caches(dtype, d, heads=heads, num_blocks=blocks)
    keys, values = kv_data(blocks * n, heads, d, dtype, seed=1, codes=write is synthetic_write)
    for view in views.values():
        write(isa, kv_cache_dtype, view, range(blocks * n), keys, values)
    expected = raw.clone()
    for view in views.values():
        expected_view = torch.as_strided(
            expected.view(view.dtype), view.shape, view.stride(), view.storage_offset()
        )
        for block, valid in items:
            expected_view[block].zero_()
            write(
                isa,
                kv_cache_dtype,
                expected_view,
                range(block * n, block * n + valid),
                keys,
                values,
            )
    layer = _Layer(isa=isa, kv_cache_dtype=kv_cache_dtype, dtype=torch.bfloat16)
    sets = cache_sets(views, config, group_infos(config, 1), {name: layer for name in views})
    assert len(sets) == 1 and all(isinstance(c, RegionCache) for c in sets[0].caches)
    zeroer = KVZeroer([(sets[0].caches, sets[0].pages_per_block)], implementation=backend)
    zeroer.zero(np.array([(0, b, v) for b, v in items], dtype=np.int64))
    assert torch.equal(raw, expected), f"{int((raw != expected).sum())} bytes differ"


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize(("isa", "dtype", "kv_cache_dtype", "d"), CASES, ids=CASE_IDS)
def test_synthetic_writers_tails_match_pages_written_with_only_the_valid_slots(
    monkeypatch, backend, device, isa, dtype, kv_cache_dtype, d
):
    # The wrapper learns the layout from the writer it is given: here the
    # synthetic one, as if vLLM's own ran on a CPU with this ISA.
    monkeypatch.setattr(cpu_pages, "vllm_writer", lambda: synthetic.page_writer(isa))
    check_tails(isa, dtype, kv_cache_dtype, d, synthetic_write, backend)


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize(("isa", "dtype", "kv_cache_dtype", "d"), CASES, ids=CASE_IDS)
def test_real_writer_tails_match_pages_written_with_only_the_valid_slots(
    backend, device, isa, dtype, kv_cache_dtype, d
):
    if not runs_here(isa, dtype, kv_cache_dtype):
        pytest.skip(AMX_SKIP if isa == "amx" else "fp8 CPU pages need AVX-512 or AMX")
    check_tails(isa, dtype, kv_cache_dtype, d, real_write, backend)


@pytest.mark.parametrize(("isa", "dtype", "kv_cache_dtype", "d"), CASES, ids=CASE_IDS)
def test_synthetic_writer_is_vllms_writer(isa, dtype, kv_cache_dtype, d):
    if not runs_here(isa, dtype, kv_cache_dtype):
        pytest.skip(AMX_SKIP if isa == "amx" else "fp8 CPU pages need AVX-512 or AMX")
    n, blocks = 32, 3
    keys, values = kv_data(blocks * n, 2, d, dtype, 2)
    real = torch.zeros(blocks, 2, n, 2 * d, dtype=dtype)
    slots = torch.randperm(blocks * n, generator=torch.Generator().manual_seed(3)).tolist()
    real_write(isa, kv_cache_dtype, real, slots, keys, values)
    codes = kv_data(blocks * n, 2, d, dtype, 2, codes=True)
    mine = torch.zeros_like(real)
    synthetic_write(isa, kv_cache_dtype, mine, slots, *codes)
    assert torch.equal(mine.view(torch.uint8), real.view(torch.uint8))


def test_view_is_not_the_slot_layout_for_any_isa():
    # Zeroing through [B, H, N, C] would wipe valid tokens on every ISA.
    for isa in ("vec", "amx"):
        n, d = 32, 64
        full = torch.zeros(2, 2, n, 2 * d, dtype=torch.bfloat16)
        keys, values = kv_data(2 * n, 2, d, torch.bfloat16, 4)
        synthetic_write(isa, "auto", full, range(2 * n), keys, values)
        naive = full.clone()
        naive[1, :, 13:, :] = 0
        expected = full.clone()
        expected[1].zero_()
        synthetic_write(isa, "auto", expected, range(n, n + 13), keys, values)
        assert not torch.equal(naive, expected), isa


def test_overlapping_writer_is_refused_naming_layer_isa_and_setting(monkeypatch):
    def shared_word(key, value, key_cache, value_cache, slot_mapping, isa, **kw):
        synthetic.page_writer("vec")(key, value, key_cache, value_cache, slot_mapping, "vec", **kw)
        key_cache[0, 0, 0, 0] = 1  # every slot also writes the first K element

    monkeypatch.setattr(cpu_pages, "vllm_writer", lambda: shared_word)
    view = torch.zeros(4, 2, 32, 64)
    with pytest.raises(ValueError) as err:
        _as_cache("model.layers.3.attn", view, _Layer(isa="vec", dtype=torch.float32))
    text = str(err.value)
    for part in ("'model.layers.3.attn'", "ISA 'vec'", "slots 0 and 1 both write", "--dtype"):
        assert part in text, text
    assert "kv_connector_extra_config.zero_tails" in text


def test_layout_recognises_cpu_attn_and_passes_other_backends_through():
    view = torch.zeros(4, 2, 32, 64)
    assert isinstance(_as_cache("l0", view, _Layer()), RegionCache)
    assert _as_cache("l0", view, _Layer(FlashAttentionBackend)) is view
    with pytest.raises(ValueError, match="set no ISA"):
        _as_cache("l0", view, _Layer(isa=None))


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_probe_counts_nonfinite_values_in_cpu_attn_pages(monkeypatch, isa):
    from kvtail_connector.core.cache_sets import CacheSet
    from kvtail_connector.core.probe import probe_items

    monkeypatch.setattr(cpu_pages, "vllm_writer", lambda: synthetic.page_writer(isa))
    view = torch.full((4, 2, 32, 64), float("nan"), dtype=torch.bfloat16)
    cache = _as_cache("l0", view, _Layer(isa=isa))
    found = probe_items([CacheSet(0, 1, 1, [cache])], np.array([[0, 1, 13]]), ["req"])
    # 19 stale slots x 2 heads x 64 values, each NaN with 2 non-zero bytes.
    assert found == {"req": (19 * 2 * 64 * 2, 19 * 2 * 64)}


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_slot_bytes_count_each_slot_once_over_its_regions(monkeypatch, isa):
    # The zeroed-bytes counters multiply this by the stale slots.
    from kvtail_connector.core.cache_sets import cache_slot_bytes

    monkeypatch.setattr(cpu_pages, "vllm_writer", lambda: synthetic.page_writer(isa))
    view = torch.zeros(4, 2, 32, 128, dtype=torch.bfloat16)
    cache = _as_cache("l0", view, _Layer(isa=isa))
    assert cache_slot_bytes(cache) == 2 * 128 * 2  # heads x (K + V) x bf16
