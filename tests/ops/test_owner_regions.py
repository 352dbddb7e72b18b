"""Pages described by an element -> slot map: regions over slot ranges, exact.

``regions_from_owner`` must rebuild any map in which each element has one
owner (slots interleaved at any granularity, sub-word included), and every
zeroing path must zero exactly what the plain reference zeroes for those
regions: byte for byte over a poisoned backing, guards and neighbours
included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtail_connector.ops import KVZeroer, PageRegion, RegionCache, reference_zero_kv_blocks
from kvtail_connector.ops.ownership import owner_of_bytes, regions_from_owner
from tests.helpers.cpu_attn_writers import amx_positions, vec_positions
from tests.ops.test_zero_kv_blocks import PATH_IDS, PATHS

GUARD = 64


def amx_owner(heads: int, n: int, d: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The owner map of one CPU_ATTN AMX page (``[H, 2N, D]``) and its per-head
    K/V segments, from the synthetic writer's positions."""
    k_pos, v_pos = amx_positions(n, d)
    half = n * d
    owner = np.full(heads * 2 * half, -1, dtype=np.int64)
    segments = []
    for h in range(heads):
        for part, pos in enumerate((k_pos, v_pos)):
            start = (2 * h + part) * half
            owner[start + pos.numpy()] = np.arange(n)[:, None]
            segments.append((start, start + half))
    return owner, segments


def test_amx_pages_need_few_regions_and_rebuild_exactly():
    heads, n, d = 2, 128, 128
    owner, segments = amx_owner(heads, n, d)
    regions = regions_from_owner(owner, n, 2, segments)
    # K: one region per VNNI pair and 16-token tile; V: one per head element
    # and token parity (slot step 2): not one per slot pair.
    k_regions = (n // 16) * (d // 2)
    v_regions = 2 * d
    assert len(regions) == heads * (k_regions + v_regions)
    assert {r.slot_step for r in regions} == {1, 2}
    rebuilt = owner_of_bytes(regions, n, owner.size * 2)
    assert np.array_equal(rebuilt[::2], owner) and np.array_equal(rebuilt[1::2], owner)


def test_sub_word_ownership_two_slots_in_one_word():
    # V of AMX bf16: slots 2m and 2m+1 share every 32-bit word, one bf16 each.
    n, d = 32, 32
    _, v_pos = amx_positions(n, d)
    owner = np.full(n * d, -1, dtype=np.int64)
    owner[v_pos.numpy()] = np.arange(n)[:, None]
    regions = regions_from_owner(owner, n, 2)
    assert all(r.slot_bytes == 2 for r in regions)
    words = owner.reshape(-1, 2)
    assert (words[:, 0] != words[:, 1]).all()  # every word holds two slots
    rebuilt = owner_of_bytes(regions, n, owner.size * 2)
    assert np.array_equal(rebuilt[::2], owner)


def test_transposed_pages_keep_one_region_per_row():
    n, d = 32, 16
    k_pos, _ = vec_positions(n, d)
    owner = np.empty(n * d, dtype=np.int64)
    owner[k_pos.numpy()] = np.arange(n)[:, None]
    regions = regions_from_owner(owner, n, 4)
    assert len(regions) == d
    assert all(r.n_slots == n and r.slot_stride == 4 for r in regions)


def test_maps_naming_slots_outside_the_page_are_refused():
    with pytest.raises(ValueError, match="slots outside the page"):
        regions_from_owner([0, 1, 4], 4, 1)
    with pytest.raises(ValueError, match="leave written elements out"):
        regions_from_owner([0, 1, 2, 3], 4, 1, segments=[(0, 2)])


def test_regions_that_claim_one_byte_twice_are_refused():
    with pytest.raises(ValueError, match="two regions claim the same byte"):
        owner_of_bytes([PageRegion(0, 4), PageRegion(2, 4, first_slot=1, n_slots=1)], 2, 8)


# ------------------------------------------------------- zeroing, every path


@st.composite
def owner_maps(draw):
    """A page's element map: slots interleaved at random granularity (runs of
    1..3 elements dealt round-robin or at random), with unowned padding."""
    n = draw(st.integers(1, 9))
    runs = draw(st.integers(1, 4))
    run_len = draw(st.integers(1, 3))
    order = draw(st.sampled_from(["round-robin", "random", "transposed"]))
    seed = draw(st.integers(0, 1000))
    rng = np.random.default_rng(seed)
    cells = [(s, k) for k in range(runs) for s in range(n)]
    if order == "random":
        rng.shuffle(cells)
    elif order == "transposed":
        cells.sort()
    owner: list[int] = []
    for s, _ in cells:
        owner.extend([s] * run_len)
        if rng.random() < 0.2:
            owner.append(-1)
    return n, np.array(owner, dtype=np.int64)


def _region_backing(n, owner, elem, pages, device, seed):
    page_bytes = owner.size * elem
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(1, 127, (pages * page_bytes + 2 * GUARD,), dtype=torch.int8, generator=gen)
    regions = regions_from_owner(owner, n, elem)
    view = torch.as_strided(raw.to(device), (pages, 1, 1, page_bytes), (page_bytes, 0, 0, 1), GUARD)
    ref = torch.as_strided(raw, (pages, 1, 1, page_bytes), (page_bytes, 0, 0, 1), GUARD)
    return raw, RegionCache(view, n, regions), RegionCache(ref, n, regions)


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    case=owner_maps(), p=st.sampled_from([1, 2]), elem=st.sampled_from([1, 2, 4]), data=st.data()
)
def test_fuzz_owner_map_regions_against_reference(backend, device, case, p, elem, data):
    n, owner = case
    num_blocks = 3
    raw, cache, ref = _region_backing(n, owner, elem, num_blocks * p, device, seed=n)
    tails = data.draw(
        st.lists(st.tuples(st.integers(0, num_blocks - 1), st.integers(0, p * n)), max_size=3)
    )
    blocks = data.draw(st.lists(st.integers(0, num_blocks - 1), max_size=1))
    expected = raw.clone()
    ref = RegionCache(
        torch.as_strided(expected, ref.tensor.shape, ref.tensor.stride(), GUARD), n, ref.regions
    )
    reference_zero_kv_blocks([ref], blocks, tails, pages_per_block=p)
    zeroer = KVZeroer([([cache], p)], implementation=backend)
    items = [(0, b, 0) for b in blocks] + [(0, b, v) for b, v in tails]
    zeroer.zero(np.array(items, dtype=np.int64).reshape(-1, 3))
    got = torch.empty(0, dtype=torch.int8, device=cache.tensor.device)
    got = got.set_(cache.tensor.untyped_storage()).cpu()
    assert torch.equal(got, expected)
    # Each stale slot's bytes are zero, each valid slot's bytes untouched.
    page_owner = owner_of_bytes(cache.regions, n, owner.size * elem)
    for b, v in tails:
        for j in range(p):
            page = got[GUARD + (b * p + j) * owner.size * elem :][: owner.size * elem]
            stale = page_owner >= max(v - j * n, 0)
            assert not page[torch.from_numpy(stale)].any()


@pytest.mark.parametrize(("backend", "device"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("p", [1, 2])
def test_amx_page_tails_against_reference(backend, device, p):
    heads, n, d = 2, 32, 32
    owner, segments = amx_owner(heads, n, d)
    raw, cache, _ = _region_backing(n, owner, 2, 3 * p, device, seed=5)
    cache = RegionCache(cache.tensor, n, regions_from_owner(owner, n, 2, segments))
    expected = raw.clone()
    ref_view = torch.as_strided(expected, cache.tensor.shape, cache.tensor.stride(), GUARD)
    # Mid-tile, tile edge, odd (the second slot of a V word), whole block.
    tails = [(0, 17), (1, 16), (2, 2 * n - 1 if p == 2 else 5)]
    reference_zero_kv_blocks(
        [RegionCache(ref_view, n, cache.regions)], [], tails, pages_per_block=p
    )
    KVZeroer([([cache], p)], implementation=backend).zero(np.array([(0, b, v) for b, v in tails]))
    got = torch.empty(0, dtype=torch.int8, device=cache.tensor.device)
    got = got.set_(cache.tensor.untyped_storage()).cpu()
    assert torch.equal(got, expected)


def test_region_serving_slots_past_the_page_is_refused():
    t = torch.zeros(4, 1, 4, 8, dtype=torch.uint8)
    bad = RegionCache(t, 4, (PageRegion(0, 2, 4, first_slot=1, n_slots=3, slot_step=2),))  # 1, 3, 5
    with pytest.raises(ValueError, match=r"caches\[0\]: region .* serves slots outside"):
        KVZeroer([([bad], 1)])
