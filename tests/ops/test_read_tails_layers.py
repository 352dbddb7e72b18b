"""Per-layer READ tails (``ReadTailsByLayer``) on every zeroing path, CUDA included.

Needs no vLLM: the cache sets are built by hand. Layers "land" one at a time
(their bytes rewritten, as a READ does) and each layer's launch must zero its
own tails only, byte for byte against the reference.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvtail_connector.core.cache_sets import CacheSet
from kvtail_connector.core.parts.read_tails.by_layer import ReadTailsByLayer
from kvtail_connector.ops import reference_zero_kv_blocks
from tests.helpers.layouts import make_backing, rebase, to_device

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TAILS = [(5, 3), (2, 9), (7, 1)]  # (block, first slot) of three READ loads


# (device, zeroer implementation): CPU caches take torch unless told Triton
# (the interpreter: the shared-work launches CUDA takes).
PATHS = (
    [("cpu", "auto")]
    + ([("cpu", "triton")] if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else [])
    + ([("cuda", "auto")] if torch.cuda.is_available() else [])
)


@pytest.mark.parametrize(("device", "implementation"), PATHS)
@pytest.mark.parametrize("layout", ["LBHNC", "BLNHC"])
@pytest.mark.parametrize("whole", [False, True], ids=["tails", "with a whole block"])
def test_each_layer_zeroes_its_own_tails_as_it_lands(device, implementation, layout, whole):
    backing = make_backing(
        layout, num_layers=4, num_pages=16, heads=2, slots=16, content=32, dtype=torch.bfloat16
    )
    on_dev = to_device(backing, device)
    names = [f"layer.{i}" for i in range(4)]
    # Two sets (as two groups would be): layers 0-2, and layer 3 with 2 pages per block.
    sets = [
        CacheSet(0, 1, 1, on_dev.views[:3], names[:3]),
        CacheSet(1, 2, 1, on_dev.views[3:], names[3:]),
    ]
    by_layer = ReadTailsByLayer(sets, implementation=implementation)
    by_layer.zeroer.warmup()
    by_layer.arm("a", [(0, 5, 3), (0, 2, 9), (1, 3, 20)])
    by_layer.arm("b", [(0, 7, 1)])
    if whole:  # a load whose READ started block-aligned on a DCP rank: first slot 0
        by_layer.arm("c", [(0, 9, 0)])
    by_layer.stage()
    assert by_layer.num_pending == 4
    assert all(w is not None and w.armed.launches[w.k] for w in map(by_layer.peek, names))
    expected = backing.raw.clone()
    ref = rebase(backing.views, expected)
    gen = torch.Generator().manual_seed(0)
    for i in (2, 0, 3, 1):  # landing order is the runtime's
        as_bytes = ref[i].view(torch.int8)
        noise = torch.randint(-128, 127, as_bytes.shape, dtype=torch.int8, generator=gen)
        on_dev.views[i].view(torch.int8)[...] = noise.to(device)
        as_bytes[...] = noise
        if i < 3:
            reference_zero_kv_blocks([ref[i]], (9,) if whole else (), TAILS)
        else:
            reference_zero_kv_blocks([ref[i]], (), [(3, 20)], pages_per_block=2)
        work = by_layer.take(names[i])
        assert work is not None
        by_layer.zero(work)
        got = on_dev.raw.cpu()
        assert torch.equal(got, expected), f"layer {i}: {(got != expected).sum()} bytes differ"
    assert not by_layer.pending
    by_layer.record_done()
    if device == "cuda":
        assert by_layer.last_launch_done is not None
        by_layer.last_launch_done.synchronize()
