"""The kernel API as a library: what it keeps, empty work, and one integer rule.

- ``zero_kv_blocks`` keeps no cache alive after the call (torch path, and the
  Triton plan cache, exercised here under the interpreter);
- a view with a zero-sized dimension has no byte to zero: nothing is
  launched for it on any path, and its neighbours' bytes stay as they were;
- every integer argument takes any integral scalar and refuses the rest
  with a ValueError naming it, with or without caches.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from kvtail_connector import dcp_local_valid_slots, zero_kv_blocks
from kvtail_connector.ops import (
    KVZeroer,
    PageRegion,
    RegionCache,
    indexer_cache,
    reference_zero_kv_blocks,
)
from kvtail_connector.ops.zero import functional, launcher, torch_path
from tests.helpers.layouts import make_backing, rebase
from tests.ops.test_zero_kv_blocks import INTERPRET

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")


def _backing(**kw):
    args = dict(num_layers=2, num_pages=4, heads=2, slots=4, content=8, dtype=torch.float16)
    args.update(kw)
    return make_backing("LBHNC", **args)


def _expected(backing, block_ids=(), tails=()):
    expected = backing.raw.clone()
    reference_zero_kv_blocks(rebase(backing.views, expected), list(block_ids), list(tails))
    return expected


@pytest.fixture
def triton_plans(monkeypatch):
    """zero_kv_blocks on its CUDA path (cached Triton plans) for CPU caches."""
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setattr(functional, "_implementation_for", lambda caches: "triton")
    monkeypatch.setattr(functional, "_PLANS", type(functional._PLANS)())
    return functional._PLANS


# ------------------------------------------------------ what the API keeps


def test_a_freed_cache_is_released_after_a_torch_path_call():
    cache = torch.zeros(4, 2, 4, 8)
    alive = weakref.ref(cache)
    zero_kv_blocks([cache], [1], [(2, 3)])
    del cache
    gc.collect()
    assert alive() is None


def test_a_freed_cache_is_released_after_a_triton_plan_call(triton_plans):
    backing = _backing()
    expected = _expected(backing, [1], [(2, 3)])
    alive = [weakref.ref(v) for v in backing.views]
    zero_kv_blocks(backing.views, [1], [(2, 3)])
    assert torch.equal(backing.raw, expected)
    (plan,) = triton_plans.values()
    # The same caches again: the plan is reused, and still right.
    backing.raw.copy_(torch.randint(1, 127, backing.raw.shape, dtype=torch.int8))
    expected = _expected(backing, [0], [(3, 1)])
    zero_kv_blocks(backing.views, [0], [(3, 1)])
    assert torch.equal(backing.raw, expected)
    assert list(triton_plans.values()) == [plan]
    del backing
    gc.collect()
    assert all(ref() is None for ref in alive)  # the plan kept none of them


def test_a_plan_that_holds_no_caches_needs_the_triton_implementation():
    with pytest.raises(ValueError, match="hold_caches: False needs implementation='triton'"):
        KVZeroer([([torch.zeros(4, 1, 4, 4)], 1)], implementation="torch", hold_caches=False)


# ------------------------------------------------------------- empty work


def _empty_views():
    backing = _backing()
    full = backing.views[0]
    return (
        backing,
        [
            torch.zeros(4, 0, 4, 8, dtype=torch.float16),  # H = 0, nothing allocated
            torch.zeros(4, 2, 4, 0, dtype=torch.float16),  # C = 0
            full[:, :0],  # H = 0 inside a live backing: a real address, no bytes
            full[:, :, :, :0],  # C = 0 inside it
        ],
    )


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch and torch-path group zeroing, recorded, not run."""
    calls: list[str] = []
    monkeypatch.setattr(launcher, "launch_jit", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(torch_path.GroupZeroing, "zero", lambda *a, **k: calls.append("torch"))
    return calls


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_empty_views_launch_nothing(backend, launches):
    backing, views = _empty_views()
    before = backing.raw.clone()
    for view in views:
        zeroer = KVZeroer([([view], 1)], implementation=backend)
        assert zeroer.num_rows == 0
        assert zeroer.zero(np.array([[0, 1, 0], [0, 2, 3]], dtype=np.int64)) == 0
    assert launches == []
    assert torch.equal(backing.raw, before)


def test_empty_views_launch_nothing_through_zero_kv_blocks(launches):
    _, views = _empty_views()
    for view in views:
        zero_kv_blocks([view], [1], [(2, 3)])
    assert launches == []


def test_empty_views_launch_nothing_through_a_triton_plan(triton_plans, launches):
    _, views = _empty_views()
    for view in views:
        zero_kv_blocks([view], [1], [(2, 3)])
    assert launches == []


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_an_empty_view_beside_live_ones_changes_nothing_of_its_own(backend):
    backing = _backing()
    expected = _expected(backing, [1], [(2, 3)])
    empty = backing.views[0][:, :0]
    KVZeroer([([empty, *backing.views], 1)], implementation=backend).zero(
        np.array([[0, 1, 0], [0, 2, 3]], dtype=np.int64)
    )
    assert torch.equal(backing.raw, expected)


# ------------------------------------------------------- the integer rule

INTEGRAL = [
    pytest.param(lambda v: v, id="int"),
    pytest.param(np.int64, id="np.int64"),
    pytest.param(np.int32, id="np.int32"),
    pytest.param(np.uint8, id="np.uint8"),
    pytest.param(lambda v: np.array(v), id="0-d ndarray"),
    pytest.param(lambda v: torch.tensor(v), id="0-d tensor"),
    pytest.param(lambda v: torch.tensor(v, dtype=torch.int32), id="0-d int32 tensor"),
]
NOT_INTEGRAL = [
    pytest.param(1.7, "1.7 (float)", id="float"),
    pytest.param(2.0, "2.0 (float)", id="integral float"),
    pytest.param("2", "'2' (str)", id="str"),
    pytest.param(True, "True (bool)", id="bool"),
    pytest.param(np.bool_(True), "(bool", id="np.bool_"),
    pytest.param(np.float64(1.0), "(float64)", id="np.float64"),
    pytest.param(torch.tensor(1.0), "torch.float32 tensor", id="float tensor"),
    pytest.param(torch.tensor(True), "torch.bool tensor", id="bool tensor"),
    pytest.param(torch.tensor([1]), "of shape (1,)", id="1-d tensor"),
    pytest.param(None, "None (NoneType)", id="None"),
]


@pytest.mark.parametrize("make", INTEGRAL)
def test_any_integral_scalar_is_an_id_a_slot_and_a_page_count(make):
    backing = _backing(num_pages=8)
    expected = backing.raw.clone()
    reference_zero_kv_blocks(
        rebase(backing.views, expected), [1], [(2, 3), (0, 7)], pages_per_block=2
    )
    zero_kv_blocks(
        backing.views,
        [make(1)],
        [(make(2), make(3)), (make(0), make(7))],
        pages_per_block=make(2),
    )
    assert torch.equal(backing.raw, expected)
    assert dcp_local_valid_slots(make(9), make(1), make(2), make(4)) == dcp_local_valid_slots(
        9, 1, 2, 4
    )


def test_integer_arrays_and_tensors_are_taken_whole():
    backing = _backing()
    expected = _expected(backing, [1, 3], [(2, 3), (0, 1)])
    zero_kv_blocks(
        backing.views,
        torch.tensor([1, 3], dtype=torch.int32),
        np.array([[2, 3], [0, 1]], dtype=np.uint16),
    )
    assert torch.equal(backing.raw, expected)


@pytest.mark.parametrize("caches", [pytest.param("live", id="caches"), pytest.param([], id="none")])
@pytest.mark.parametrize(("value", "shown"), NOT_INTEGRAL)
def test_anything_else_is_refused_naming_the_argument(caches, value, shown):
    caches = _backing().views if caches == "live" else caches
    cases = [
        (dict(block_ids=[0, value]), r"block_ids\[1\]: expected an integer, got "),
        (dict(tails=[(0, 1), (value, 1)]), r"tails\[1\]\[0\]: expected an integer, got "),
        (dict(tails=[(1, value)]), r"tails\[0\]\[1\]: expected an integer, got "),
        (dict(pages_per_block=value), "pages_per_block: expected an integer, got "),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            zero_kv_blocks(caches, **kwargs)
        assert shown in str(info.value)
    for i, name in enumerate(("num_tokens", "dcp_rank", "dcp_world_size", "interleave")):
        args = [9, 1, 2, 4]
        args[i] = value
        with pytest.raises(ValueError, match=f"{name}: expected an integer, got "):
            dcp_local_valid_slots(*args)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(block_ids=[3]), r"block_ids: block id 3 out of range \[0, 0\)"),
        (dict(tails=[(0, 1)]), r"tails: block id 0 out of range \[0, 0\)"),
        (dict(block_ids=[-1]), "block_ids: block id -1"),
        (dict(pages_per_block=0), "pages_per_block: must be >= 1"),
        (dict(block_ids="12"), "block_ids: expected a sequence of block ids, got '12'"),
        (dict(tails=np.array([1.5, 2.0])), "tails: expected .* got an array of dtype float64"),
    ],
)
def test_no_caches_have_no_blocks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        zero_kv_blocks([], **kwargs)
    zero_kv_blocks([])  # nothing asked, nothing to do


def test_sparse_tensors_are_refused_naming_the_argument():
    sparse_ids = torch.tensor([1, 0, 2]).to_sparse()
    for caches in (_backing().views, []):
        with pytest.raises(ValueError, match="block_ids: expected block ids, got a torch.sparse"):
            zero_kv_blocks(caches, sparse_ids)
        with pytest.raises(ValueError, match=r"tails\[0\]\[0\]: expected an integer"):
            zero_kv_blocks(caches, tails=[(torch.tensor(1).to_sparse(), 0)])
    sparse_cache = torch.zeros(4, 1, 4, 4).to_sparse()
    with pytest.raises(ValueError, match=r"caches\[0\]: expected a dense tensor, got layout"):
        zero_kv_blocks([sparse_cache], [0])
    region = RegionCache(sparse_cache, 4, (PageRegion(0, 4),))
    with pytest.raises(ValueError, match=r"caches\[0\]\.tensor: expected a dense tensor"):
        zero_kv_blocks([region], [0])


def test_region_and_indexer_sizes_follow_the_rule():
    page = torch.zeros(4, 1, 4, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"caches\[0\]\.slots_per_page: expected an integer"):
        zero_kv_blocks([RegionCache(page, 4.0, (PageRegion(0, 4),))], [0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"caches\[0\]\.regions\[0\]\.slot_bytes: expected"):
        zero_kv_blocks([RegionCache(page, 4, (PageRegion(0, 4.5),))], [0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="value_bytes: expected an integer, got 6.0"):
        indexer_cache(page, 6.0, 2)  # type: ignore[arg-type]
    assert indexer_cache(page, np.int64(6), torch.tensor(2)).regions == (
        PageRegion(0, 6),
        PageRegion(4 * 6, 2),
    )
