"""The worker side on CPU views laid out as vLLM allocates them."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtail_connector.core.metadata import NULL_BLOCK, GroupLoad, KVTailMetadata, LoadRecord
from kvtail_connector.ops import reference_zero_kv_blocks
from tests.helpers.layouts import rebase
from tests.helpers.vllm_factories import make_kv_cache_config
from tests.helpers.worker_caches import (
    ErrorSource,
    allocate,
    make_tail_worker,
    tail_policy,
)


@pytest.fixture(params=["torch", "triton"])
def zeroer_path(request, monkeypatch):
    """The worker's zeroer on either path: CPU caches take torch, CUDA ones
    Triton (its packed completion path; here through the interpreter)."""
    if request.param == "triton":
        import kvtail_connector.core.parts.zeroing as zeroing

        triton_zeroer = functools.partial(zeroing.KVZeroer, implementation="triton")
        monkeypatch.setattr(zeroing, "KVZeroer", triton_zeroer)
    return request.param


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_tails_byte_exact_in_every_layout(layout, dtype, zeroer_path):
    kv = make_kv_cache_config(block_size=16, num_blocks=8, dtype=dtype)
    caches = allocate(kv, layout)
    gen = torch.Generator().manual_seed(0)
    for raw in caches.raw.values():
        raw.copy_(torch.randint(-100, 100, raw.shape, dtype=torch.int8, generator=gen))
    expected = {g: raw.clone() for g, raw in caches.raw.items()}
    worker = make_tail_worker(kv)
    worker.register_kv_caches(caches.views, kv, caches.layers)
    assert worker._rank.zeroer.launches_packed == (zeroer_path == "triton")
    loads = (
        LoadRecord("a", 0, 37, (GroupLoad(0, 0, (5, 2, 7)),)),  # tail: block 7, 5 tokens
        LoadRecord("b", 16, 49, (GroupLoad(0, 1, (1, 4, 6)),)),  # tail: block 6, 1 token
        LoadRecord("c", 0, 32, (GroupLoad(0, 0, (3, 0)),)),  # block-aligned: nothing
    )
    worker.bind(KVTailMetadata(inner=None, loads=loads))  # type: ignore[arg-type]
    worker.on_transfer_results({"a", "b", "c"}, set(), inner=ErrorSource())
    views = rebase(list(caches.views.values()), expected[0])
    reference_zero_kv_blocks(views, (), [(7, 5), (6, 1)])
    assert torch.equal(caches.raw[0], expected[0])
    assert worker.num_tracked == 0


def test_null_tail_block_is_skipped():
    kv = make_kv_cache_config(block_size=16, num_blocks=8)
    caches = allocate(kv)
    before = caches.raw[0].clone()
    worker = make_tail_worker(kv)
    worker.register_kv_caches(caches.views, kv, caches.layers)
    record = LoadRecord("a", 0, 37, (GroupLoad(0, 0, (5, 2, NULL_BLOCK)),))
    worker.bind(KVTailMetadata(inner=None, loads=(record,)))  # type: ignore[arg-type]
    worker.on_transfer_results({"a"}, set(), inner=ErrorSource())
    assert torch.equal(caches.raw[0], before)


class _Event:
    """Stands in for torch.cuda.Event: records how the fence used it."""

    def __init__(self, done: bool) -> None:
        self.done, self.calls = done, []

    def query(self) -> bool:
        self.calls.append("query")
        return self.done

    def synchronize(self) -> None:
        self.calls.append("synchronize")
        self.done = True


@pytest.mark.parametrize(("done", "calls"), [(True, ["query"]), (False, ["query", "synchronize"])])
def test_fence_waits_for_earlier_zeroing_only_when_pending(done, calls):
    worker = make_tail_worker(make_kv_cache_config(block_size=16, num_blocks=8))
    worker.fence()  # nothing zeroed yet (and always so on CPU): no wait
    event = _Event(done)
    worker._rank.last_zeroing = event  # what a CUDA zeroing launch records
    worker.fence()
    assert event.calls == calls


def test_start_load_kv_fences_before_the_inner_load():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tests.scheduler.test_forwarding import build

    wrapper, inner, _ = build(KVConnectorRole.WORKER)
    order = []
    event = _Event(False)
    event.synchronize = lambda: order.append("fence")  # type: ignore[method-assign]
    wrapper._worker._rank.last_zeroing = event
    original = inner.start_load_kv
    inner.start_load_kv = lambda *a, **k: (order.append("inner"), original(*a, **k))
    wrapper.start_load_kv(None)
    assert order == ["fence", "inner"]


def test_package_imports_with_torch_only():
    # A CPU box with none of the optional backends (and no vLLM, no Triton).
    code = (
        "import sys; sys.modules['vllm'] = None; sys.modules['triton'] = None\n"
        "import torch, kvtail_connector as k\n"
        "t = torch.ones(4, 1, 4, 2)\n"
        "k.zero_kv_blocks([t], [1], [(2, 3)])\n"
        "assert t[1].sum() == 0 and t[2, :, 3].sum() == 0 and t[2, :, :3].sum() == 6\n"
        "print(k.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip()


def test_load_bound_while_caches_were_unregistered_is_still_zeroed():
    # Sleep mode (0.33) releases the KV memory: a record arriving then is
    # turned into work lines at completion, once the caches are back.
    kv = make_kv_cache_config(block_size=16, num_blocks=8)
    caches = allocate(kv)
    worker = make_tail_worker(kv)
    worker.register_kv_caches(caches.views, kv, caches.layers)
    worker.unregister_kv_caches()
    record = LoadRecord("a", 0, 37, (GroupLoad(0, 0, (5, 2, 7)),))
    worker.bind(KVTailMetadata(inner=None, loads=(record,)))  # type: ignore[arg-type]
    worker.restore_kv_caches()
    expected = caches.raw[0].clone()
    reference_zero_kv_blocks(rebase(list(caches.views.values()), expected), (), [(7, 5)])
    worker.on_transfer_results({"a"}, set(), inner=ErrorSource())
    assert torch.equal(caches.raw[0], expected)


def test_an_error_reported_for_a_finished_load_never_marks_the_blocks_next_owner():
    # vLLM re-zeroes failed loads here (zero_failed_loads off). A block id
    # reported for load "a", collected by the runner while "c" is in flight,
    # used to survive "a" and make "d" (given a's freed blocks) count as
    # failed: d's tail was then left stale.
    kv = make_kv_cache_config(block_size=16, num_blocks=8)
    caches = allocate(kv)
    worker = make_tail_worker(kv)
    worker.register_kv_caches(caches.views, kv, caches.layers)
    inner = ErrorSource()
    a = LoadRecord("a", 0, 37, (GroupLoad(0, 0, (5, 2, 6)),))
    c = LoadRecord("c", 0, 20, (GroupLoad(0, 0, (1, 3)),))
    worker.bind(KVTailMetadata(inner=None, loads=(a, c)))  # type: ignore[arg-type]
    inner.report(2)
    worker.on_transfer_results({"a"}, set(), inner)
    assert worker.take_load_errors(inner) == {2}  # what the runner hands vLLM
    expected = caches.raw[0].clone()
    d = LoadRecord("d", 0, 37, (GroupLoad(0, 0, (2, 5, 7)),))
    worker.bind(KVTailMetadata(inner=None, loads=(d,)))  # type: ignore[arg-type]
    worker.on_transfer_results({"d"}, set(), inner)
    assert worker.take_load_errors(inner) == set()
    reference_zero_kv_blocks(rebase(list(caches.views.values()), expected), (), [(7, 5)])
    assert torch.equal(caches.raw[0], expected)  # d's tail zeroed, its loaded KV kept
    worker.on_transfer_results({"c"}, set(), inner)
    assert worker.num_tracked == 0


@pytest.mark.parametrize("counting_rank", [0, 1])
def test_a_dcp_tail_counts_once_even_where_the_counting_rank_has_nothing_to_zero(counting_rank):
    # DCP 2, interleave 16 (what NIXL needs), 16-slot pages: 24 valid tokens of
    # a 32-token block fill rank 0's page and 8 slots of rank 1's. Only the
    # counting rank counts requests, whatever its own share of the work is.
    from kvtail_connector.core.kvgroups import group_infos
    from kvtail_connector.core.parts.zeroing import RankPlacement
    from kvtail_connector.core.stats import KVTailStats
    from kvtail_connector.facade.assembly import build_worker

    kv = make_kv_cache_config(block_size=16, num_blocks=8)
    groups = group_infos(kv, 2)
    assert groups[0].effective_block == 32
    record = LoadRecord("a", 0, 24, (GroupLoad(0, 0, (3,)),))
    counted, zeroed = [], []
    for rank in (0, 1):
        caches = allocate(kv)
        stats = KVTailStats()
        worker = build_worker(
            groups,
            RankPlacement(rank, 2, 16),
            tail_policy(probes=True),
            counts_requests=rank == counting_rank,
            stats=stats,
        )
        worker.register_kv_caches(caches.views, kv, caches.layers)
        worker.bind(KVTailMetadata(inner=None, loads=(record,)))  # type: ignore[arg-type]
        worker.on_transfer_results({"a"}, set(), ErrorSource())
        counted.append((stats["tails_zeroed"], stats["probed_tails"]))
        zeroed.append(stats["tail_bytes_zeroed"])
    assert zeroed[0] == 0 and zeroed[1] > 0  # rank 0's share of the block is full
    assert sum(t for t, _ in counted) == 1 and sum(p for _, p in counted) == 1
