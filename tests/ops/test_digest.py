"""The KV digest (mix64-1): the kernel and the torch path against the reference.

The reference (``ops/digest/reference.py``) is the contract. Each case digests
poisoned caches (random bytes everywhere: guards, padding, other blocks)
through every path that can run here and compares the sums exactly; flips of
single bytes inside the valid slots must change exactly their cell, and
bytes outside them must not matter. Paths: the torch path (CPU runtime), the
Triton kernel (interpreter on CPU, compiled on CUDA).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from kvtail_connector.extras.ops.digest import launcher as digest_mod
from kvtail_connector.extras.ops.digest.launcher import (
    ALGORITHM,
    DigestGroup,
    GroupSpan,
    KVDigester,
)
from kvtail_connector.extras.ops.digest.reference import POS_MUL, WORD_MUL, reference_digest
from kvtail_connector.ops import PageRegion, RegionCache, indexer_cache
from tests.helpers.kv_content import byte_views
from tests.helpers.layouts import LAYOUTS, make_backing, to_device

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HAS_CUDA = torch.cuda.is_available()

# (implementation, device) pairs that can run here.
PATHS = [("torch", "cpu")]
if INTERPRET:
    PATHS.append(("triton", "cpu"))
if HAS_CUDA:
    PATHS.append(("torch", "cuda"))
    PATHS.append(("triton", "cuda"))
PATH_IDS = [f"{b}-{d}" for b, d in PATHS]
SEG = 256


def as_spec(group: DigestGroup) -> dict:
    return {k: v for k, v in dataclasses.asdict(group).items() if v is not None} | {
        "caches": list(group.caches)
    }


def as_tuples(requests):
    return [
        [None if s is None else (list(s.block_ids), s.start, s.end) for s in r] for r in requests
    ]


def same_view(v: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """``v``'s geometry (every stride) over the storage of ``raw``."""
    out = torch.empty(0, dtype=v.dtype, device=raw.device)
    return out.set_(raw.untyped_storage(), v.storage_offset(), v.shape, v.stride())


def on_device(group: DigestGroup, raw: torch.Tensor, device: str) -> tuple[DigestGroup, object]:
    """``group`` with its caches over a copy of ``raw`` (their backing) on ``device``."""
    dev_raw = raw.to(device)
    caches = [
        RegionCache(same_view(c.tensor, dev_raw), c.slots_per_page, c.regions)
        if isinstance(c, RegionCache)
        else same_view(c, dev_raw)
        for c in group.caches
    ]
    return dataclasses.replace(group, caches=caches), dev_raw


def digest(groups, requests, implementation, segment=SEG):
    return (
        KVDigester(groups, segment=segment, implementation=implementation).digest(requests).result()
    )


def as_dicts(result):
    return [[None if g is None else g.by_head() for g in r] for r in result]


def check_paths(groups, raws, requests, segment=SEG):
    """Every path's sums equal the reference's (``raws[i]`` backs ``groups[i]``)."""
    expected = reference_digest([as_spec(g) for g in groups], as_tuples(requests), segment)
    for implementation, device in PATHS:
        moved = [on_device(g, raw, device)[0] for g, raw in zip(groups, raws, strict=True)]
        got = as_dicts(digest(moved, requests, implementation, segment))
        assert got == expected, f"{implementation}-{device}"
    return expected


def blocks(n, seed):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------------ contract


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_matches_the_reference(layout):
    b = make_backing(
        layout, num_layers=2, num_pages=12, heads=2, slots=32, content=8, dtype=torch.bfloat16
    )
    table = blocks(12, 1)
    requests = [
        [GroupSpan(table[:10], 37, 300)],  # starts and ends mid-block, two segments
        [GroupSpan(table[10:], 0, 64)],  # block-aligned
    ]
    check_paths([DigestGroup(b.views)], [b.raw], requests)


@pytest.mark.parametrize(
    ("dtype", "content"),
    [
        (torch.float32, 4),
        (torch.float16, 8),
        (torch.float8_e4m3fn, 16),
        (torch.uint8, 12),
        (torch.float8_e4m3fn, 5),  # one word and a 1-byte tail
        (torch.float16, 3),  # one word and a 2-byte tail
        (torch.uint8, 3),  # a sub-word slot
        (torch.uint8, 1),
    ],
    ids=str,
)
def test_every_dtype_and_sub_word_slots(dtype, content):
    b = make_backing(
        "LBNHC", num_layers=2, num_pages=8, heads=2, slots=16, content=content, dtype=dtype
    )
    check_paths([DigestGroup(b.views)], [b.raw], [[GroupSpan(blocks(8, 2), 5, 120)]])


def test_unaligned_and_strided_slots_use_byte_loads():
    # Padding of 2 bytes between slots: no word alignment; C strided by 2.
    b = make_backing(
        "LBHNC",
        num_layers=1,
        num_pages=6,
        heads=2,
        slots=16,
        content=8,
        dtype=torch.bfloat16,
        pad=(0, 0, 0, 2, 0),
    )
    strided = [v[..., ::2] for v in b.views]
    for views in (b.views, strided):
        check_paths([DigestGroup(views)], [b.raw], [[GroupSpan(blocks(6, 3), 3, 90)]])


@pytest.mark.parametrize("pages_per_block", [1, 2, 4])
def test_kernel_pages_per_block(pages_per_block):
    b = make_backing(
        "LBHNC", num_layers=2, num_pages=16, heads=1, slots=8, content=16, dtype=torch.bfloat16
    )
    n_blocks = 16 // pages_per_block
    span = GroupSpan(blocks(n_blocks, 4), 3, n_blocks * 8 * pages_per_block - 5)
    check_paths([DigestGroup(b.views, pages_per_block)], [b.raw], [[span]])


def test_region_caches_and_several_groups_in_one_launch():
    full = make_backing(
        "LBHNC", num_layers=2, num_pages=6, heads=2, slots=16, content=8, dtype=torch.bfloat16
    )
    # DeepSeek indexer page: 64-byte fp8 values of all slots, then 4-byte scales.
    idx = make_backing(
        "LBHNC", num_layers=1, num_pages=6, heads=1, slots=32, content=68, dtype=torch.uint8
    )
    indexer = [indexer_cache(v, 64, 4) for v in idx.views]
    groups = [
        DigestGroup(full.views, group_id=0),
        DigestGroup(indexer, group_id=3, head_offset=0),
    ]
    requests = [
        [GroupSpan(blocks(6, 5), 10, 90), GroupSpan(blocks(6, 6), 10, 190)],
        [None, GroupSpan([5, 4, 3], 0, 77)],
        [GroupSpan([2, 1], 20, 20), None],  # nothing to digest: a zero cell
    ]
    expected = check_paths(groups, [full.raw, idx.raw], requests)
    assert expected[2][0] == {0: [0], 1: [0]}


def test_regions_over_slot_ranges():
    # 20-byte slots: all even slots' 12-byte runs, then all odd slots'; then
    # 8 more bytes of every slot (a writer interleaving slots, like AMX tiles).
    b = make_backing(
        "LBHNC", num_layers=2, num_pages=6, heads=1, slots=16, content=20, dtype=torch.uint8
    )
    regions = (
        PageRegion(0, 12, first_slot=0, n_slots=8, slot_step=2),
        PageRegion(96, 12, first_slot=1, slot_step=2),
        PageRegion(192, 8),
    )
    caches = [RegionCache(v, 16, regions) for v in b.views]
    check_paths([DigestGroup(caches)], [b.raw], [[GroupSpan(blocks(6, 7), 3, 93)]])


def test_counted_heads_and_head_offset():
    b = make_backing(
        "LBHNC", num_layers=2, num_pages=6, heads=4, slots=16, content=8, dtype=torch.bfloat16
    )
    group = DigestGroup(b.views, head_offset=8, counted_heads=[3, 1])
    expected = check_paths([group], [b.raw], [[GroupSpan(blocks(6, 8), 0, 96)]])
    assert list(expected[0][0]) == [9, 11]


def test_dcp_ranks_match_the_reference():
    b = make_backing(
        "LBHNC", num_layers=1, num_pages=8, heads=2, slots=16, content=8, dtype=torch.bfloat16
    )
    for rank, world, ilv in [(1, 2, 1), (0, 2, 4), (3, 4, 2), (2, 4, 16)]:
        group = DigestGroup(b.views, dcp_rank=rank, dcp_world_size=world, interleave=ilv)
        span = GroupSpan(blocks(8, 9), 29, 16 * world * 8 - 7)
        check_paths([group], [b.raw], [[span]])


# ------------------------------------------------------------ launch knobs

# Each changes a code path of the kernel (benchmarks/digest_variants.py sweeps
# their values on a GPU): the next block prefetched or not, a tile narrower
# than a slot's words (the word loop, partial tiles), chunks smaller than a
# block and as large as a segment, evict-first loads, software pipelining,
# one warp.
LAUNCH_KNOBS = [
    dict(tile=(16, 16)),  # a block a tile, vector rows: the next tile prefetched
    dict(tile=(16, 4)),  # a block in 1 or 3 word tiles, prefetched
    dict(tile=(16, 16), prefetch=False),
    dict(tile=(2, 4)),
    dict(tile=(4, 8), chunk_tokens=16),  # 12-word slots: a full and a partial word tile
    dict(chunk_tokens=SEG, stream=True, num_stages=2),
    dict(tile=(8, 2), chunk_tokens=32, num_warps=1),
]
TRITON_PATHS = [p for p in PATHS if p[0] == "triton"]


@pytest.mark.skipif(not TRITON_PATHS, reason="needs Triton (TRITON_INTERPRET=1 or CUDA)")
@pytest.mark.parametrize("knobs", LAUNCH_KNOBS, ids=str)
def test_launch_knobs_keep_the_reference_sums(knobs):
    full = make_backing(
        "LBHNC", num_layers=2, num_pages=8, heads=2, slots=16, content=8, dtype=torch.bfloat16
    )
    paged = make_backing(
        "LBNHC", num_layers=1, num_pages=8, heads=1, slots=8, content=12, dtype=torch.float32
    )
    idx = make_backing(
        "LBHNC", num_layers=1, num_pages=6, heads=1, slots=16, content=20, dtype=torch.uint8
    )
    regions = (PageRegion(0, 12, first_slot=0, n_slots=8, slot_step=2), PageRegion(192, 5))
    groups = [
        DigestGroup(full.views, group_id=0),  # 4 words a slot
        DigestGroup(paged.views, 2, group_id=1, dcp_rank=1, dcp_world_size=2, interleave=2),
        DigestGroup([RegionCache(v, 16, regions) for v in idx.views], group_id=2),
    ]
    requests = [
        [GroupSpan(blocks(8, 20), 5, 117), GroupSpan(blocks(4, 21), 3, 120), None],
        [None, GroupSpan(blocks(4, 22), 0, 64), GroupSpan(blocks(6, 23), 17, 90)],
        [GroupSpan(blocks(8, 24)[:4], 40, 40), None, GroupSpan([4, 1], 0, 32)],
    ]
    raws = [full.raw, paged.raw, idx.raw]
    # The first two groups' rows are all 16-byte aligned (vector loads); the
    # region cache's byte rows make a launch compile the general loads.
    for n_groups in (2, 3):
        spec = [as_spec(g) for g in groups[:n_groups]]
        reqs = [r[:n_groups] for r in requests]
        expected = reference_digest(spec, as_tuples(reqs), SEG)
        for implementation, device in TRITON_PATHS:
            moved = [
                on_device(g, raw, device)[0]
                for g, raw in zip(groups[:n_groups], raws, strict=False)
            ]
            digester = KVDigester(moved, segment=SEG, implementation=implementation, **knobs)
            assert digester._any_mode == (n_groups == 3)
            if knobs in ({"tile": (16, 16)}, {"tile": (16, 4)}):
                assert digester.prefetch == (n_groups == 2)
            assert as_dicts(digester.digest(reqs).result()) == expected, (n_groups, device)


@pytest.mark.parametrize(("implementation", "device"), PATHS, ids=PATH_IDS)
def test_many_requests_of_mixed_lengths_in_one_launch(implementation, device):
    # Units find their request by a binary search over the requests' chunks:
    # empty, one-chunk and many-chunk requests, interleaved.
    b = make_backing(
        "LBHNC", num_layers=2, num_pages=64, heads=1, slots=16, content=8, dtype=torch.bfloat16
    )
    table = blocks(64, 26)
    spans, used = [], 0
    for start, end in [(0, 40), (7, 7), (3, 5), (16, 300), (0, 16), (250, 251), (31, 33), (0, 90)]:
        need = -(-end // 16)
        spans.append([GroupSpan(table[used : used + need], start, end)])
        used += need
    expected = reference_digest([as_spec(DigestGroup(b.views))], as_tuples(spans), SEG)
    moved, _ = on_device(DigestGroup(b.views), b.raw, device)
    for chunk in (16, 64):
        digester = KVDigester(
            [moved], segment=SEG, implementation=implementation, chunk_tokens=chunk
        )
        assert as_dicts(digester.digest(spans).result()) == expected, chunk


def test_a_launch_unit_is_a_power_of_two_within_its_segment_that_fills_the_programs():
    from kvtail_connector.extras.ops.digest.plan import MAX_CHUNK, MIN_CHUNK, choose_chunk

    programs = 132 * 8
    for segment in (256, 1024, 4096):
        for row_tokens in (0, 1, 640 * 1024, 61 * 1024, 640 * 32768, 10**12):
            chunk = choose_chunk(row_tokens, programs, segment)
            assert chunk & (chunk - 1) == 0 and MIN_CHUNK <= chunk <= min(MAX_CHUNK, segment)
            if MIN_CHUNK < chunk < min(MAX_CHUNK, segment):
                # Every program gets at least 4 units, and not 8 at twice the size.
                assert row_tokens // chunk >= 4 * programs > row_tokens // (2 * chunk)


class _NoPythonIteration(np.ndarray):
    """A block table the planner may slice and reduce, never walk in Python."""

    def __iter__(self):
        raise AssertionError("iterated a block table in Python")

    def tolist(self):
        raise AssertionError("converted a block table to Python ints")


@pytest.mark.parametrize(("implementation", "device"), PATHS, ids=PATH_IDS)
def test_numpy_block_tables_from_a_first_block_are_planned_without_python_loops(
    implementation, device
):
    b = make_backing(
        "LBHNC", num_layers=2, num_pages=12, heads=2, slots=16, content=8, dtype=torch.bfloat16
    )
    table = blocks(12, 25)
    expected = reference_digest([{"caches": list(b.views)}], [[(table, 3 * 16 + 5, 170)]], SEG)
    moved, _ = on_device(DigestGroup(b.views), b.raw, device)
    ids = np.array(table[3:], dtype=np.int64).view(_NoPythonIteration)
    span = GroupSpan(ids, 3 * 16 + 5, 170, first_block=3)
    got = KVDigester([moved], segment=SEG, implementation=implementation).digest([[span]])
    assert as_dicts(got.result()) == expected
    with pytest.raises(ValueError, match="lies before first_block"):
        KVDigester([moved], segment=SEG).digest([[GroupSpan(ids, 40, 170, first_block=3)]])


# -------------------------------------------------------------- sensitivity


FLIP_CASES = [
    ("LBHNC", torch.bfloat16, 8),
    ("LBNHC", torch.float8_e4m3fn, 16),
    ("BLNHC", torch.uint8, 5),
    ("LHBNC", torch.float32, 4),
]


def slow(path) -> bool:
    """The interpreter: kernel == reference is shown above, so properties
    run there in one case only (every case on the torch path and CUDA)."""
    return path == ("triton", "cpu")


@pytest.mark.parametrize(
    ("implementation", "device", "layout", "dtype", "content"),
    [
        (*path, *case)
        for path in PATHS
        for case in FLIP_CASES
        if not slow(path) or case is FLIP_CASES[0]
    ],
    ids=str,
)
def test_any_flipped_byte_changes_exactly_its_cell(implementation, device, layout, dtype, content):
    b = to_device(
        make_backing(
            layout, num_layers=2, num_pages=24, heads=2, slots=32, content=content, dtype=dtype
        ),
        device,
    )
    table = blocks(24, 10)
    start, end = 21, 3 * SEG - 40  # three segments
    digester = KVDigester([DigestGroup(b.views)], segment=SEG, implementation=implementation)
    requests = [[GroupSpan(table, start, end)]]
    base = digester.digest(requests).result()[0][0].sums.copy()
    as_bytes = byte_views(b.views, b.raw)
    gen = np.random.default_rng(11)
    rounds = 1 if slow((implementation, device)) else 24
    cells = [(h, s) for h in range(2) for s in range(3)]
    for i in range(rounds):
        # One flip in each of some (head, segment) cells, in a random layer,
        # token and byte; round 0 flips every cell, at the first and last tokens.
        chosen = cells if i == 0 else [c for c in cells if gen.random() < 0.5] or cells[:1]
        flips = []
        for h, s in chosen:
            lo, hi = max(start, s * SEG), min(end, (s + 1) * SEG)
            t = {0: start, 2: end - 1}.get(s, lo) if i == 0 else int(gen.integers(lo, hi))
            layer = int(gen.integers(2))
            byte = int(gen.integers(as_bytes[layer].shape[-1]))
            flips.append((as_bytes[layer], table[t // 32], h, t % 32, byte))
        saved = [view[page, h, slot, byte].clone() for view, page, h, slot, byte in flips]
        for view, page, h, slot, byte in flips:
            view[page, h, slot, byte] ^= int(gen.integers(1, 256))
        changed = digester.digest(requests).result()[0][0].sums != base
        assert {tuple(c) for c in np.argwhere(changed).tolist()} == set(chosen)
        for (view, page, h, slot, byte), value in zip(flips, saved, strict=True):
            view[page, h, slot, byte] = value
        assert (digester.digest(requests).result()[0][0].sums == base).all()


@pytest.mark.parametrize(
    ("implementation", "device", "layout"),
    [
        (*path, layout)
        for path in PATHS
        for layout in ("LBHNC", "BHLNC")
        if not slow(path) or layout == "LBHNC"
    ],
    ids=str,
)
def test_bytes_outside_the_valid_slots_do_not_count(implementation, device, layout):
    kw = dict(num_layers=3, num_pages=10, heads=3, slots=16, content=6, dtype=torch.float16)
    b = make_backing(layout, pad=(16, 32, 8, 2, 0), **kw)
    # Layers 0 and 2 of the group; head 1 not counted; another request's blocks between.
    views = [b.views[0], b.views[2]]
    group = DigestGroup(views, counted_heads=[0, 2])
    requests = [[GroupSpan([7, 2, 9, 4], 5, 58)], [GroupSpan([0, 5], 16, 20)]]
    valid = torch.zeros_like(b.raw, dtype=torch.uint8)
    for ((table, start, end),) in as_tuples(requests):
        for t in range(start, end):
            for v in byte_views(views, valid):
                for h in (0, 2):
                    v[table[t // 16], h, t % 16, :] = 1
    moved, raw = on_device(group, b.raw, device)
    before = as_dicts(digest([moved], requests, implementation))
    noise = torch.randint(-128, 128, b.raw.shape, dtype=torch.int8)
    raw.copy_(torch.where(valid.bool(), b.raw, noise).to(device))
    assert as_dicts(digest([moved], requests, implementation)) == before
    # ... while the same noise inside them does count.
    raw.copy_(torch.where(valid.bool(), noise, b.raw).to(device))
    after = as_dicts(digest([moved], requests, implementation))
    assert all(
        x != y
        for r0, r1 in zip(before, after, strict=True)
        for x, y in zip(r0[0].values(), r1[0].values(), strict=True)
    )


# ---------------------------------------------------------------- launching


def test_empty_work_launches_nothing(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("launched a kernel for empty work")

    import kvtail_connector.extras.ops.digest.kernel as kernels

    monkeypatch.setattr(kernels, "kv_digest_kernel", NoLaunch())
    b = make_backing(
        "LBHNC", num_layers=1, num_pages=4, heads=2, slots=16, content=8, dtype=torch.bfloat16
    )
    implementation = "triton" if (INTERPRET or HAS_CUDA) else "torch"
    device = "cuda" if HAS_CUDA else "cpu"
    moved, _ = on_device(DigestGroup(b.views), b.raw, device)
    uncounted, _ = on_device(DigestGroup(b.views, counted_heads=[]), b.raw, device)
    for groups, requests in [
        ([moved], []),
        ([moved], [[None], [None]]),
        ([moved], [[GroupSpan([1, 2], 20, 20)]]),
        ([uncounted], [[GroupSpan([1, 2], 0, 20)]]),
    ]:
        pending = KVDigester(groups, segment=SEG, implementation=implementation).digest(requests)
        assert not pending.launched and pending.event is None and pending.ready()
        for r in pending.result():
            for g in r:
                assert g is None or not g.sums.any()


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("heads", "slots", "content", "dtype"),
    [(8, 16, 256, torch.bfloat16), (1, 64, 576, torch.float8_e4m3fn)],
    ids=["bf16-8x128d-bs16", "fp8-mla576-bs64"],
)
def test_cuda_result_arrives_through_an_event(heads, slots, content, dtype):
    b = to_device(
        make_backing(
            "LBHNC",
            num_layers=6,
            num_pages=256,
            heads=heads,
            slots=slots,
            content=content,
            dtype=dtype,
        ),
        "cuda",
    )
    digester = KVDigester([DigestGroup(b.views)])
    digester.warmup()
    # Launched through the kernel compiled once, not re-bound per call.
    assert digester._compiled is not None and digester._compiled.fast
    table = blocks(256, 12)
    requests = [
        [GroupSpan(table[:128], 0, 128 * slots - 3)],
        [GroupSpan(table[128:], 5, min(2100, 128 * slots))],  # within its 128 blocks
    ]
    pending = digester.digest(requests)
    assert pending.launched and pending.event is not None
    got = pending.result()
    assert pending.ready()
    torch_path = (
        KVDigester([DigestGroup(b.views)], implementation="torch").digest(requests).result()
    )
    for r_got, r_ref in zip(got, torch_path, strict=True):
        assert (r_got[0].sums == r_ref[0].sums).all()


# --------------------------------------------------------------- validation


def test_bad_input_names_the_field():
    b = make_backing(
        "LBHNC", num_layers=1, num_pages=4, heads=2, slots=16, content=8, dtype=torch.bfloat16
    )
    ok = DigestGroup(b.views)
    cases = [
        (lambda: KVDigester([ok], segment=300), "segment"),
        (lambda: KVDigester([ok], segment=128), "segment"),
        (lambda: KVDigester([dataclasses.replace(ok, counted_heads=[2])]), "counted_heads"),
        (lambda: KVDigester([dataclasses.replace(ok, counted_heads=[0, 0])]), "counted_heads"),
        (lambda: KVDigester([dataclasses.replace(ok, dcp_rank=2, dcp_world_size=2)]), "dcp_rank"),
        (lambda: KVDigester([dataclasses.replace(ok, pages_per_block=3)]), "pages_per_block"),
        (lambda: KVDigester([dataclasses.replace(ok, group_id=1)] * 2), "group ids"),
        (lambda: KVDigester([ok]).digest([[GroupSpan([0], 0, 17)]]), "requests[0][0].block_ids"),
        (lambda: KVDigester([ok]).digest([[GroupSpan([0, 4], 0, 17)]]), "block id 4"),
        (lambda: KVDigester([ok]).digest([[GroupSpan([0], 9, 3)]]), "requests[0][0].end"),
        (lambda: KVDigester([ok]).digest([[None, None]]), "requests[0]"),
        # The kernel API's integer rule: no bools, no floats.
        (lambda: KVDigester([ok], segment=1024.0), "segment"),
        (lambda: KVDigester([ok], segment=256, chunk_tokens=512), "chunk_tokens"),
        (lambda: KVDigester([ok], chunk_tokens=48), "chunk_tokens"),
        (lambda: KVDigester([dataclasses.replace(ok, counted_heads=[True])]), "counted_heads"),
        (lambda: KVDigester([ok]).digest([[GroupSpan([1.0], 0, 5)]]), "block_ids[0]"),
        (lambda: KVDigester([ok]).digest([[GroupSpan([1], 0, 5.0)]]), "requests[0][0].end"),
    ]
    for call, field in cases:
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
            call()


def test_numpy_and_tensor_integers_are_accepted():
    b = make_backing(
        "LBHNC", num_layers=1, num_pages=4, heads=2, slots=16, content=8, dtype=torch.bfloat16
    )
    group = DigestGroup(b.views, counted_heads=np.array([1, 0]), head_offset=np.int64(2))
    plain = [[GroupSpan([3, 1], 2, 30)]]
    typed = [[GroupSpan(torch.tensor([3, 1]), np.int64(2), torch.tensor(30))]]
    assert as_dicts(digest([group], typed, "torch")) == as_dicts(digest([group], plain, "torch"))


def test_block_ids_outside_the_span_are_not_read():
    b = make_backing(
        "LBHNC", num_layers=1, num_pages=4, heads=1, slots=16, content=8, dtype=torch.bfloat16
    )
    # Blocks before start // 16 may be anything (e.g. a sliding window's skipped blocks).
    check_paths([DigestGroup(b.views)], [b.raw], [[GroupSpan([-1, 99, 2, 3], 40, 60)]])


def test_key_constants_do_not_collide_for_nearby_coordinates():
    # key(t, w) = plane + t * POS_MUL + w * WORD_MUL: two coordinates within
    # 2**20 tokens and 2**12 words of each other never share a key.
    inverse = pow(POS_MUL, -1, 1 << 64)
    for dw in range(1, 1 << 12):
        for sign in (1, -1):
            dt = (-sign * dw * WORD_MUL * inverse) % (1 << 64)
            assert (1 << 20) <= dt <= (1 << 64) - (1 << 20), dw
    assert ALGORITHM == "mix64-1"
    assert digest_mod.DEFAULT_SEGMENT == 1024
