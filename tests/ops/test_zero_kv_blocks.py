"""zero_kv_blocks against the reference, byte for byte over the whole backing.

Each case poisons an int8 backing buffer (guards, padding and neighbouring
layers included), zeroes through one path and through the reference on a
clone, and compares every byte. Paths: the torch path (CPU runtime), the
Triton kernel (interpreter on CPU, compiled on CUDA).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtail_connector import zero_kv_blocks
from kvtail_connector.ops import (
    KVZeroer,
    PageRegion,
    RegionCache,
    indexer_cache,
    reference_zero_kv_blocks,
)
from kvtail_connector.ops.zero import torch_path
from tests.helpers.layouts import DTYPES, LAYOUTS, make_backing, rebase, to_device

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HAS_CUDA = torch.cuda.is_available()

# (backend, device) pairs that can run here.
PATHS = [("torch", "cpu")]
if INTERPRET:
    PATHS.append(("triton", "cpu"))
if HAS_CUDA:
    PATHS.append(("triton", "cuda"))
PATH_IDS = [f"{b}-{d}" for b, d in PATHS]


def run_case(backing, backend, device, block_ids, tails, pages_per_block):
    """Zero through ``backend`` and through the reference; compare every byte."""
    expected = backing.raw.clone()
    reference_zero_kv_blocks(
        rebase(backing.views, expected), block_ids, tails, pages_per_block=pages_per_block
    )

    on_dev = to_device(backing, device)
    zeroer = KVZeroer([(on_dev.views, pages_per_block)], implementation=backend)
    items = [(0, b, 0) for b in block_ids] + [(0, b, v) for b, v in tails]
    zeroer.zero(np.array(items, dtype=np.int64).reshape(-1, 3))
    got = on_dev.raw.cpu()
    assert torch.equal(got, expected), _diff(got, expected)


def _diff(got, expected):
    bad = (got != expected).nonzero().flatten()
    return f"{bad.numel()} bytes differ, first at {bad[:8].tolist()}"


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("pages_per_block", [1, 2])
def test_every_layout(backend, device, layout, pages_per_block):
    backing = make_backing(
        layout,
        num_layers=3,
        num_pages=4 * pages_per_block,
        heads=2,
        slots=4,
        content=8,
        dtype=torch.bfloat16,
    )
    tails = [(1, 3), (3, 1), (2, 4 * pages_per_block - 1)]
    run_case(backing, backend, device, [0], tails, pages_per_block)


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype(backend, device, dtype):
    backing = make_backing(
        "LBNHC", num_layers=2, num_pages=12, heads=2, slots=8, content=16, dtype=dtype
    )
    run_case(backing, backend, device, [5], [(0, 1), (2, 7), (4, 0)], 2)


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("layout", ["LBHNC", "BLNHC"])
def test_padding_between_slots_pages_and_layers(backend, device, layout):
    # Padding bytes sit inside the spans a page covers; they must survive.
    backing = make_backing(
        layout,
        num_layers=2,
        num_pages=4,
        heads=2,
        slots=4,
        content=8,
        dtype=torch.float16,
        pad=(8, 16, 4, 4, 0),
    )
    run_case(backing, backend, device, [2], [(0, 1), (3, 3)], 1)


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
def test_two_byte_slots_use_byte_stores(backend, device):
    # H=1, C=1 bf16: 2-byte slots, not word-aligned.
    backing = make_backing(
        "LBHNC",
        num_layers=2,
        num_pages=4,
        heads=1,
        slots=5,
        content=1,
        dtype=torch.bfloat16,
    )
    run_case(backing, backend, device, [3], [(0, 1), (1, 4), (2, 3)], 1)


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
def test_tail_at_slot_zero_and_at_block_end(backend, device):
    backing = make_backing(
        "LBHNC",
        num_layers=2,
        num_pages=8,
        heads=2,
        slots=4,
        content=8,
        dtype=torch.float32,
    )
    # v = 0 zeroes the block whole; v = P*N zeroes nothing.
    run_case(backing, backend, device, [], [(0, 0), (1, 8), (2, 4)], 2)


@pytest.mark.parametrize("max_index", [1, 40])
@pytest.mark.parametrize("layout", ["LBHNC", "BLNHC"])
def test_torch_path_in_chunks_zeroes_the_same_bytes(monkeypatch, max_index, layout):
    # An index is capped (whole blocks by the thousand): a cap below one item
    # still zeroes one item per chunk, a cap of a few items splits the call.
    monkeypatch.setattr(torch_path, "_MAX_INDEX", max_index)
    backing = make_backing(
        layout, num_layers=2, num_pages=12, heads=2, slots=4, content=8, dtype=torch.float16
    )
    run_case(backing, "torch", "cpu", [0, 5], [(1, 3), (2, 1), (3, 7), (4, 2), (3, 2)], 2)


@pytest.mark.parametrize("few", [0, 8], ids=["vectorized", "item-by-item"])
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])  # dense pages, and not
def test_torch_path_item_by_item_and_vectorized_zero_the_same_bytes(monkeypatch, few, layout):
    # A few one-page items take a suffix of the slot-ordered units each;
    # more take the vectorized index. Whole blocks, tails, a duplicate, a no-op.
    monkeypatch.setattr(torch_path, "_FEW", few)
    backing = make_backing(
        layout, num_layers=2, num_pages=8, heads=2, slots=4, content=8, dtype=torch.bfloat16
    )
    run_case(backing, "torch", "cpu", [2], [(1, 3), (5, 1), (5, 1), (6, 4), (7, 2)], 1)


@pytest.mark.parametrize(
    ("dtype", "content", "pad", "unit"),
    [
        (torch.float32, 8, (0, 0, 0, 0, 0), 32),  # a head's row of one slot
        (torch.bfloat16, 2, (0, 0, 0, 0, 0), 4),
        (torch.bfloat16, 8, (0, 0, 0, 4, 0), 4),  # 16-byte rows 20 bytes apart
        (torch.bfloat16, 8, (0, 0, 2, 0, 0), 2),  # heads 66 bytes apart
        (torch.float8_e4m3fn, 3, (0, 0, 0, 0, 0), 1),  # 3-byte rows, layers 64 bytes in
    ],
)
def test_torch_path_zeroes_in_the_largest_unit_no_run_splits(dtype, content, pad, unit):
    backing = make_backing(
        "LBHNC", num_layers=2, num_pages=4, heads=2, slots=4, content=content, dtype=dtype, pad=pad
    )
    zeroer = KVZeroer([(backing.views, 1)], implementation="torch")
    units = {u.unit for group in zeroer._torch for u, _ in group.by_units}
    assert units == {unit}
    run_case(backing, "torch", "cpu", [1], [(2, 1), (3, 3)], 1)


# Caches the torch path's unit must respect: each term of its gcd decides one.
_UNIT_EDGES = {
    # uint8 pages starting at an odd byte of their storage (the first byte).
    "odd_first_byte": lambda raw: torch.as_strided(
        raw.view(torch.uint8), (6, 2, 4, 8), (64, 32, 8, 1), storage_offset=65
    ),
    # 8-byte slot runs in pages 4 bytes off an 8-byte grid (the page stride).
    "page_stride_4_mod_8": lambda raw: torch.as_strided(
        raw.view(torch.float32), (6, 1, 4, 2), (9, 9, 2, 1), storage_offset=16
    ),
    # 8-byte runs 12 bytes apart in 48-byte pages (the run starts).
    "run_start": lambda raw: torch.as_strided(
        raw.view(torch.float32), (6, 1, 4, 2), (12, 12, 3, 1), storage_offset=16
    ),
    # Runs of 6 bytes 8 apart: 2-byte units (the run lengths).
    "run_length": lambda raw: torch.as_strided(
        raw.view(torch.int16), (6, 1, 4, 3), (16, 16, 4, 1), storage_offset=32
    ),
    # Slot 0's bytes claimed by two regions: 5 units listed for a 5-unit page
    # that is not dense (its last unit is no slot's), so no whole-page rows.
    "same_slot_twice": lambda raw: RegionCache(
        torch.as_strided(raw.view(torch.uint8), (6, 10), (10, 1), storage_offset=64),
        4,
        (PageRegion(offset=0, slot_bytes=2), PageRegion(offset=0, slot_bytes=2, n_slots=1)),
    ),
    # Regions over every other slot, from slot 1, a counted run among them.
    "slot_steps": lambda raw: RegionCache(
        torch.as_strided(raw.view(torch.uint8), (6, 96), (96, 1), storage_offset=64),
        8,
        (
            PageRegion(offset=0, slot_bytes=6, slot_stride=8, slot_step=2),
            PageRegion(
                offset=64, slot_bytes=6, slot_stride=10, first_slot=1, slot_step=2, n_slots=3
            ),
            PageRegion(offset=40, slot_bytes=4, first_slot=7, n_slots=1),
        ),
    ),
}


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("edge", list(_UNIT_EDGES))
def test_unit_edges_against_the_reference(backend, device, edge):
    gen = torch.Generator().manual_seed(5)
    raw = torch.randint(1, 127, (1024,), dtype=torch.int8, generator=gen)
    expected = raw.clone()
    on_dev = raw.clone().to(device)
    make = _UNIT_EDGES[edge]
    zeroer = KVZeroer([([make(on_dev)], 1)], implementation=backend)
    tails = [(1, 1), (2, 3), (4, 2), (4, 1)]
    zeroer.zero(np.array([(0, b, v) for b, v in tails] + [(0, 3, 0)]))
    reference_zero_kv_blocks([make(expected)], [3], tails)
    got = on_dev.cpu()
    assert torch.equal(got, expected), _diff(got, expected)
    assert not torch.equal(got, raw)  # the case zeroes something


@pytest.mark.parametrize(("pad", "dense"), [((0, 0, 0, 0, 0), True), ((0, 0, 0, 4, 0), False)])
def test_whole_pages_are_rows_where_every_unit_is_a_slots(pad, dense):
    backing = make_backing(
        "LBHNC",
        num_layers=2,
        num_pages=4,
        heads=2,
        slots=4,
        content=8,
        dtype=torch.bfloat16,
        pad=pad,
    )
    zeroer = KVZeroer([(backing.views, 1)], implementation="torch")
    caches = [c for group in zeroer._torch for _, found in group.by_units for c in found]
    assert [c.pages is not None for c in caches] == [dense, dense]
    run_case(backing, "torch", "cpu", [1, 3], [(2, 1)], 1)


def test_regions_where_two_slots_share_a_byte_are_refused():
    page = torch.zeros(4, 16, dtype=torch.uint8)
    shared = (PageRegion(offset=0, slot_bytes=4), PageRegion(offset=6, slot_bytes=4, n_slots=1))
    with pytest.raises(ValueError, match=r"caches\[0\]: slots 1 and 0 share byte 6"):
        KVZeroer([([RegionCache(page, 2, shared)], 1)], implementation="torch")


def test_a_torch_zeroer_built_in_inference_mode_zeroes_outside_it():
    # vLLM runs its steps under inference mode; a zeroer built there (a cache
    # registered inside it) must still write when called outside, and back.
    cache = torch.ones(4, 2, 4, 8)
    with torch.inference_mode():
        zeroer = KVZeroer([([cache], 1)], implementation="torch")
    zeroer.zero(np.array([[0, 2, 1]]))
    with torch.inference_mode():
        zeroer.zero(np.array([[0, 1, 3]]))
    expected = torch.ones(4, 2, 4, 8)
    reference_zero_kv_blocks([expected], [], [(2, 1), (1, 3)])
    assert torch.equal(cache, expected)


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
def test_nothing_to_zero_touches_nothing(backend, device):
    backing = make_backing(
        "LBHNC",
        num_layers=2,
        num_pages=4,
        heads=2,
        slots=4,
        content=8,
        dtype=torch.float32,
    )
    before = backing.raw.clone()
    on_dev = to_device(backing, device)
    zeroer = KVZeroer([(on_dev.views, 1)], implementation=backend)
    assert zeroer.zero(np.zeros((0, 3), dtype=np.int64)) == 0
    assert zeroer.zero(np.array([[0, 1, 4]])) == 0  # a tail at P*N: no launch
    assert torch.equal(on_dev.raw.cpu(), before)


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
def test_aliased_layers_and_groups_sharing_a_tensor(backend, device):
    backing = make_backing(
        "LBNHC",
        num_layers=2,
        num_pages=4,
        heads=2,
        slots=4,
        content=8,
        dtype=torch.bfloat16,
    )
    on_dev = to_device(backing, device)
    a, b = on_dev.views
    # Group 0 lists layer a twice (KV sharing); group 1 shares layer b with group 0.
    zeroer = KVZeroer([([a, a, b], 1), ([b], 1)], implementation=backend)
    assert zeroer.num_rows == 3  # a once and b in group 0, b again for group 1
    zeroer.zero(np.array([[0, 1, 2], [1, 3, 1]]))

    expected = backing.raw.clone()
    ea, eb = rebase(backing.views, expected)
    reference_zero_kv_blocks([ea, eb], (), [(1, 2)])
    reference_zero_kv_blocks([eb], (), [(3, 1)])
    assert torch.equal(on_dev.raw.cpu(), expected)


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("pages_per_block", [1, 2])
def test_indexer_values_then_scales(backend, device, pages_per_block):
    # DeepSeek indexer pages: N x 128 fp8 values, then N x 4 scale bytes.
    n, pages = 8, 3 * pages_per_block
    gen = torch.Generator().manual_seed(3)
    raw = torch.randint(1, 255, (pages * n * 132 + 128,), dtype=torch.uint8, generator=gen)
    expected = raw.clone()
    view = torch.as_strided(raw.to(device), (pages, 1, n, 132), (n * 132, n * 132, 132, 1), 64)
    zeroer = KVZeroer([([indexer_cache(view, 128, 4)], pages_per_block)], implementation=backend)
    tails = [(0, 3), (2, pages_per_block * n - 1)]
    zeroer.zero(np.array([(0, b, v) for b, v in tails] + [(0, 1, 0)]))

    ref_view = torch.as_strided(expected, (pages, 1, n, 132), (n * 132, n * 132, 132, 1), 64)
    reference_zero_kv_blocks(
        [indexer_cache(ref_view, 128, 4)], [1], tails, pages_per_block=pages_per_block
    )
    got = view.untyped_storage()
    got = torch.empty(0, dtype=torch.uint8, device=view.device).set_(got).cpu()
    assert torch.equal(got, expected), _diff(got, expected)
    # The indexer tail must not equal what a naive [N, C] slot view would zero.
    naive = raw.clone()
    reference_zero_kv_blocks(
        [torch.as_strided(naive, (pages, 1, n, 132), (n * 132, n * 132, 132, 1), 64)],
        [1],
        tails,
        pages_per_block=pages_per_block,
    )
    assert not torch.equal(naive, expected)


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
def test_several_groups_in_one_call(backend, device):
    # Different page geometries (P, N, dtype) per group, one launch.
    g0 = make_backing(
        "LBHNC",
        num_layers=2,
        num_pages=8,
        heads=2,
        slots=4,
        content=8,
        dtype=torch.bfloat16,
        seed=1,
    )
    g1 = make_backing(
        "LBNHC",
        num_layers=1,
        num_pages=4,
        heads=1,
        slots=16,
        content=36,
        dtype=torch.float8_e4m3fn,
        seed=2,
    )
    e0, e1 = g0.raw.clone(), g1.raw.clone()
    d0, d1 = to_device(g0, device), to_device(g1, device)
    zeroer = KVZeroer([(d0.views, 2), (d1.views, 1)], implementation=backend)
    zeroer.zero(np.array([[0, 3, 5], [1, 2, 9], [0, 0, 0], [1, 0, 15]]))

    reference_zero_kv_blocks(rebase(g0.views, e0), [0], [(3, 5)], pages_per_block=2)
    reference_zero_kv_blocks(rebase(g1.views, e1), [], [(2, 9), (0, 15)], pages_per_block=1)
    assert torch.equal(d0.raw.cpu(), e0)
    assert torch.equal(d1.raw.cpu(), e1)


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("same_geometry", [True, False], ids=["one shape", "two shapes"])
def test_staged_groups_zero_the_same_items_in_each_group(backend, device, same_geometry):
    # The same (block, first) items staged for several one-layer groups; each
    # launch zeroes its own layer. Identical layers share one work buffer.
    backing = make_backing(
        "LBHNC", num_layers=3, num_pages=8, heads=2, slots=8, content=16, dtype=torch.bfloat16
    )
    on_dev = to_device(backing, device)
    views = list(on_dev.views)
    ref_views = rebase(backing.views, expected := backing.raw.clone())
    if not same_geometry:  # one layer seen with half its heads: other row counts
        views[1], ref_views[1] = views[1][:, :1], ref_views[1][:, :1]
    zeroer = KVZeroer([([v], 1) for v in views], implementation=backend)
    items = [(3, 5), (1, 0), (6, 8), (2, 7)]  # first 8: nothing left in that block
    launches = zeroer.stage([2, 0, 1], items)
    for k, layer in ((0, 2), (2, 1), (1, 0)):  # launched in another order than staged
        reference_zero_kv_blocks([ref_views[layer]], [1], [(3, 5), (2, 7)])
        launch = launches[k]
        assert launch is not None
        launch()
        assert torch.equal(on_dev.raw.cpu(), expected), _diff(on_dev.raw.cpu(), expected)
    zeroer.record_done()
    assert zeroer.stage([0, 1], []) == [None, None]
    # First slot past the block: nothing.
    assert zeroer.stage([0, 1], [(4, 8)]) == [None, None]


def test_public_function_matches_reference():
    backing = make_backing(
        "BHLNC",
        num_layers=3,
        num_pages=6,
        heads=2,
        slots=4,
        content=8,
        dtype=torch.bfloat16,
    )
    expected = backing.raw.clone()
    ref = rebase(backing.views, expected)
    zero_kv_blocks(backing.views, [2], [(0, 3), (1, 6)], pages_per_block=2)
    reference_zero_kv_blocks(ref, [2], [(0, 3), (1, 6)], pages_per_block=2)
    assert torch.equal(backing.raw, expected)


# ----------------------------------------------------------------- fuzzing


@st.composite
def cases(draw):
    layout = draw(st.sampled_from(list(LAYOUTS)))
    dtype = draw(st.sampled_from(DTYPES))
    el = torch.empty((), dtype=dtype).element_size()
    p = draw(st.integers(1, 3))
    n = draw(st.integers(1, 6))
    num_blocks = draw(st.integers(1, 4))
    pad = tuple(draw(st.integers(0, 2)) * el for _ in range(4)) + (0,)
    backing = dict(
        num_layers=draw(st.integers(1, 3)),
        num_pages=num_blocks * p,
        heads=draw(st.integers(1, 3)),
        slots=n,
        content=draw(st.integers(1, 6)),
        dtype=dtype,
        pad=pad,
        seed=draw(st.integers(0, 1000)),
    )
    blocks = draw(st.lists(st.integers(0, num_blocks - 1), max_size=2))
    tails = draw(
        st.lists(st.tuples(st.integers(0, num_blocks - 1), st.integers(0, p * n)), max_size=3)
    )
    alias = draw(st.booleans())
    return layout, backing, p, blocks, tails, alias


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_fuzz_against_reference(backend, device, case):
    layout, kw, p, blocks, tails, alias = case
    backing = make_backing(layout, **kw)
    if alias:
        backing.views.append(backing.views[0])  # an aliased (KV-shared) layer
    run_case(backing, backend, device, blocks, tails, p)


# ------------------------------------------------------------------- errors


def _small():
    return make_backing(
        "LBHNC", num_layers=1, num_pages=4, heads=1, slots=4, content=4, dtype=torch.float32
    ).views


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(caches=[torch.zeros(4, 4)]), r"caches\[0\]: expected a 4-D"),
        (dict(caches=["x"]), r"caches\[0\]: expected a torch.Tensor"),
        (dict(caches=torch.zeros(4, 1, 4, 4)), "caches: expected a sequence"),
        (dict(block_ids=[4]), r"block_ids: block id 4 out of range \[0, 4\)"),
        (dict(block_ids=[-1]), "block_ids: block id -1"),
        (dict(block_ids=[[1, 2]]), r"block_ids\[0\]: expected an integer, got \[1, 2\]"),
        (dict(block_ids=["a"]), r"block_ids\[0\]: expected an integer, got 'a'"),
        (dict(tails=[(0, 5)]), r"tails: first slot 5 out of range \[0, 4\]"),
        (dict(tails=[(0, -1)]), "tails: first slot -1"),
        (dict(tails=[(9, 1)]), "tails: block id 9"),
        (dict(tails=[1, 2]), r"tails\[0\]: expected 2 integers, got 1"),
        (dict(pages_per_block=0), "pages_per_block: must be >= 1"),
        (dict(pages_per_block=3), "pages_per_block: caches\\[0\\] has 4 pages"),
        (dict(pages_per_block=1.5), "pages_per_block: expected an integer, got 1.5"),
    ],
)
def test_invalid_input_names_the_argument(kwargs, match):
    args = dict(caches=_small(), block_ids=(), tails=(), pages_per_block=1)
    args.update(kwargs)
    caches = args.pop("caches")
    with pytest.raises(ValueError, match=match):
        zero_kv_blocks(caches, **args)


def test_caches_on_different_devices_are_refused():
    meta = torch.empty((4, 1, 4, 4), device="meta")
    with pytest.raises(ValueError, match="caches: all caches must be on one device"):
        zero_kv_blocks([_small()[0], meta], [0])


def test_region_cache_outside_its_page_is_refused():
    t = torch.zeros(4, 1, 4, 8, dtype=torch.uint8)
    bad = RegionCache(t, 4, (PageRegion(0, 8), PageRegion(30, 4)))
    with pytest.raises(ValueError, match=r"caches\[0\]: region .* does not fit"):
        zero_kv_blocks([bad], [0])
    with pytest.raises(ValueError, match="value_bytes \\+ scale_bytes must equal"):
        indexer_cache(t, 6, 1)


def test_triton_implementation_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="implementation: 'triton' needs CUDA caches"):
        KVZeroer([(_small(), 1)], implementation="triton")
