"""CPU_ATTN pages: tails zeroed exactly as vLLM's own cache writer laid them out.

The reference is independent of the package: a page written by vLLM's
``cpu_attn_reshape_and_cache`` with only the valid slots, next to the same
page written with every slot and then tail-zeroed by the wrapper.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops as ops  # noqa: E402

from kvtail_connector import RegionCache, zero_kv_blocks  # noqa: E402
from kvtail_connector.cpu_pages import cpu_attn_regions  # noqa: E402
from kvtail_connector.layout import _as_cache  # noqa: E402

pytestmark = [pytest.mark.vllm]


def write(cache: torch.Tensor, slots: range, keys: torch.Tensor, values: torch.Tensor, isa: str):
    b, h, n, c = cache.shape
    k_cache, v_cache = cache.view(b, h, 2 * n, c // 2).chunk(2, dim=2)
    mapping = torch.tensor(list(slots), dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(keys[mapping], values[mapping], k_cache, v_cache, mapping, isa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_tail_zeroing_matches_a_page_written_with_only_the_valid_slots(dtype, isa):
    blocks, heads, n, d = 3, 2, 32, 32
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(blocks * n, heads, d, generator=gen).to(dtype)
    values = torch.randn(blocks * n, heads, d, generator=gen).to(dtype)
    full = torch.zeros(blocks, heads, n, 2 * d, dtype=dtype)
    write(full, range(blocks * n), keys, values, isa)  # every slot of every block
    valid = 13  # block 1 keeps slots 0..12
    expected = full.clone()
    expected[1].zero_()
    write(expected, range(n, n + valid), keys, values, isa)

    cache = RegionCache(full, n, cpu_attn_regions(full, isa))
    zero_kv_blocks([cache], tails=[(1, valid)])
    assert torch.equal(full.view(torch.uint8), expected.view(torch.uint8))

    # The [B, H, N, C] view is not the slot layout here: zeroing through it
    # would have wiped keys of valid tokens.
    naive = full.clone()
    write(naive, range(n, 2 * n), keys, values, isa)
    zero_kv_blocks([naive], tails=[(1, valid)])
    assert not torch.equal(naive.view(torch.uint8), expected.view(torch.uint8))


class _Backend:
    def __init__(self, name: str) -> None:
        self.name = name

    def get_name(self) -> str:
        return self.name


class _Layer:
    def __init__(self, backend: str, isa: str | None = "vec") -> None:
        self.attn_backend = _Backend(backend)
        self.isa = isa
        self.kv_cache_dtype = "auto"


def test_layout_recognises_cpu_attn_and_refuses_what_it_cannot_describe():
    view = torch.zeros(4, 2, 32, 64)
    assert isinstance(_as_cache("l0", view, object(), _Layer("CPU_ATTN")), RegionCache)
    assert _as_cache("l0", view, object(), _Layer("FLASH_ATTN")) is view
    with pytest.raises(ValueError, match="has no ISA"):
        _as_cache("l0", view, object(), _Layer("CPU_ATTN", isa=None))
    with pytest.raises(ValueError, match="ROCM_ATTN.*zero_tails"):
        _as_cache("l0", view, object(), _Layer("ROCM_ATTN"))


def test_probe_counts_nonfinite_values_in_cpu_attn_pages():
    import numpy as np

    from kvtail_connector.layout import CacheSet
    from kvtail_connector.probe import probe_items

    view = torch.full((4, 2, 32, 64), float("nan"))
    cache = RegionCache(view, 32, cpu_attn_regions(view, "vec"))
    found = probe_items([CacheSet(0, 1, 1, [cache])], np.array([[0, 1, 13]]), ["req"])
    # 19 stale slots x 2 heads x 64 values, each NaN with 2 non-zero bytes.
    assert found == {"req": (19 * 2 * 64 * 2, 19 * 2 * 64)}
