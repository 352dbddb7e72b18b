"""Launch geometry and CUDA-only behaviour of the zeroing kernel."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from kvtail_connector import zero_kv_blocks
from kvtail_connector.ops import KVZeroer, reference_zero_kv_blocks, warmup
from kvtail_connector.ops.zero.plan import same_items_work
from kvtail_connector.ops.zero.work_schema import MAX_UNITS
from tests.helpers.layouts import make_backing, rebase, to_device
from tests.ops.test_zero_kv_blocks import INTERPRET


def _many_layer_views(device, layers=181, blocks=10_000):
    # Tiny fp8 pages: 181 layers x 10,000 blocks like DeepSeek-V4's segment count.
    raw = torch.randint(1, 127, (layers * blocks * 16,), dtype=torch.uint8, device=device)
    views = [
        torch.as_strided(raw, (blocks, 1, 4, 4), (16, 16, 4, 1), layer * blocks * 16)
        for layer in range(layers)
    ]
    return raw, views


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs Triton")
def test_launch_is_bounded_for_181_segments_and_10000_blocks():
    # vLLM's zeroer overflowed its grid here (#52058): 181 segments x 10,000
    # blocks x chunks. The persistent kernel's grid never exceeds a fixed
    # program count; the work only sets how often programs loop.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, views = _many_layer_views(device)
    zeroer = KVZeroer([(views, 1)], implementation="triton")
    tails, whole = zeroer.rows_for(0, 1), zeroer.rows_for(0, 0)
    assert tails is not None and whole is not None
    for first in (0, 1):  # whole blocks, then tails
        _, units = same_items_work([(b, first) for b in range(10_000)], tails, whole, 4)
        # One unit per (block, layer page): each page fits one BLOCK chunk.
        assert units == 10_000 * 181
        assert units < MAX_UNITS


@pytest.mark.gpu
def test_181_segments_10000_blocks_on_cuda():
    raw, views = _many_layer_views("cuda")
    expected = raw.cpu().clone()
    zeroer = KVZeroer([(views, 1)])
    blocks = np.arange(0, 10_000, 3)
    zeroer.zero(np.stack([np.zeros_like(blocks), blocks, np.zeros_like(blocks)], 1))
    reference_zero_kv_blocks(rebase(views, expected), blocks.tolist())
    assert torch.equal(raw.cpu(), expected)


@pytest.mark.gpu
def test_staged_launch_replays_from_a_cuda_graph():
    backing = make_backing(
        "LBHNC", num_layers=4, num_pages=16, heads=2, slots=16, content=64, dtype=torch.bfloat16
    )
    expected = backing.raw.clone()
    reference_zero_kv_blocks(rebase(backing.views, expected), [3], [(5, 7), (9, 1)])
    dev = to_device(backing, "cuda")
    zeroer = KVZeroer([(dev.views, 1)])
    zeroer.warmup()
    (launch,) = zeroer.stage([0], [(3, 0), (5, 7), (9, 1)])
    assert launch is not None
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dev.raw.cpu(), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "staged"])
def test_staging_buffers_are_not_reused_while_in_flight(use_graphs):
    backing = make_backing(
        "LBNHC", num_layers=2, num_pages=64, heads=2, slots=16, content=64, dtype=torch.float16
    )
    expected = backing.raw.clone()
    dev = to_device(backing, "cuda")
    zeroer = KVZeroer([(dev.views, 1)], use_graphs=use_graphs)
    # Keep the GPU busy so the copies queue behind it, then stage many calls.
    spin = torch.empty(1 << 28, device="cuda")
    for _ in range(4):
        spin.mul_(1.0)
    calls = [(b, (b * 7) % 16) for b in range(64)]
    for b, v in calls:
        zeroer.zero(np.array([[0, b, v]]))
    reference_zero_kv_blocks(rebase(backing.views, expected), (), calls)
    torch.cuda.synchronize()
    assert torch.equal(dev.raw.cpu(), expected)


@pytest.mark.gpu
def test_warmup_compiles_without_touching_memory():
    warmup("cuda")
    backing = to_device(
        make_backing(
            "LBHNC", num_layers=1, num_pages=2, heads=1, slots=4, content=8, dtype=torch.float32
        ),
        "cuda",
    )
    before = backing.raw.clone()
    KVZeroer([(backing.views, 1)]).warmup()
    torch.cuda.synchronize()
    assert torch.equal(backing.raw, before)


@pytest.mark.gpu
@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "staged"])
def test_last_launch_done_is_recorded_behind_the_launch(use_graphs):
    # The worker's start_load_kv fence waits on this event.
    backing = make_backing(
        "LBHNC", num_layers=2, num_pages=8, heads=2, slots=16, content=64, dtype=torch.float16
    )
    expected = backing.raw.clone()
    reference_zero_kv_blocks(rebase(backing.views, expected), (), [(3, 5)])
    dev = to_device(backing, "cuda")
    zeroer = KVZeroer([(dev.views, 1)], use_graphs=use_graphs)
    assert zeroer.last_launch_done is None
    spin = torch.empty(1 << 28, device="cuda")
    for _ in range(4):
        spin.mul_(1.0)  # keep the stream busy so the event is still pending
    zeroer.zero(np.array([[0, 3, 5]]))
    event = zeroer.last_launch_done
    assert event is not None
    event.synchronize()  # no device-wide sync: the event alone orders the bytes
    assert torch.equal(dev.raw.cpu(), expected)


@pytest.mark.gpu
def test_record_done_covers_zeroing_enqueued_outside_a_launch():
    # RankCaches.mark_zeroed: after READ tails zeroed on the reference path,
    # start_load_kv's fence waits on this event; the launch's own is too early.
    backing = make_backing(
        "LBHNC", num_layers=2, num_pages=8, heads=2, slots=16, content=64, dtype=torch.float16
    )
    expected = backing.raw.clone()
    reference_zero_kv_blocks(rebase(backing.views, expected), (), [(1, 2), (3, 5)])
    dev = to_device(backing, "cuda")
    zeroer = KVZeroer([(dev.views, 1)])
    zeroer.zero(np.array([[0, 1, 2]]))
    launched = zeroer.last_launch_done
    torch.cuda._sleep(200_000_000)  # the stream stays busy past the checks below
    reference_zero_kv_blocks(dev.views, (), [(3, 5)])
    zeroer.record_done()
    event = zeroer.last_launch_done
    assert launched is not None and event is not None
    assert not event.query()
    event.synchronize()  # what the fence does
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # a reader the compute stream does not order (an RDMA)
        got = dev.raw.to("cpu")
    assert torch.equal(got, expected)


@pytest.mark.gpu
def test_zero_kv_blocks_releases_a_freed_cuda_cache():
    # Its cached plan keeps addresses, not tensors.
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    caches = [torch.ones(256, 8, 16, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    zero_kv_blocks(caches, [1], [(2, 3)])
    zero_kv_blocks(caches, [2], [(3, 1)])  # the cached plan
    assert not caches[3][2].any() and not caches[0][3, :, 1:].any() and caches[0][3, :, 0].all()
    torch.cuda.synchronize()
    del caches
    gc.collect()
    # 32 MiB of caches gone; what stays is the plan's row table (a few KiB).
    assert torch.cuda.memory_allocated() - before < 1 << 20


@pytest.mark.gpu
def test_empty_cuda_views_launch_nothing():
    backing = to_device(
        make_backing(
            "LBHNC", num_layers=1, num_pages=4, heads=2, slots=4, content=8, dtype=torch.float16
        ),
        "cuda",
    )
    before = backing.raw.clone()
    view = backing.views[0]
    for empty in (torch.zeros(4, 0, 4, 8, device="cuda"), view[:, :0], view[:, :, :, :0]):
        zero_kv_blocks([empty], [1], [(2, 3)])
    torch.cuda.synchronize()  # an illegal address would surface here
    assert torch.equal(backing.raw, before)
