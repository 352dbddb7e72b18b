"""The digest is keyed by logical coordinates: placements of the same tokens agree.

One logical content ``[layer, global head, token, C]`` is laid out in many
ways (other block ids, block sizes, kernel-page splits, every page layout,
vLLM's own views, heads split over TP ranks, tokens dealt over DCP ranks);
every layout must give the sums of the plain one, and the ranks' per-head
sums must add up to the single-rank sums.
"""

from __future__ import annotations

import pytest
import torch

from kvtail_connector.extras.ops.digest.launcher import DigestGroup, GroupSpan, KVDigester
from kvtail_connector.extras.ops.digest.reference import MASK64
from tests.helpers.kv_content import logical_content, place
from tests.helpers.layouts import LAYOUTS, make_backing, to_device
from tests.ops.test_digest import PATHS, blocks, same_view, slow

LAYERS, HEADS, TOKENS, CONTENT = 2, 4, 300, 16
START, END = 7, TOKENS - 9  # neither end on a block boundary
SEG = 256
DTYPE = torch.bfloat16
LOGICAL = logical_content(LAYERS, HEADS, TOKENS, CONTENT, DTYPE, seed=3)


def laid_out(
    path,
    layout,
    slots,
    *,
    pages_per_block=1,
    heads=HEADS,
    head_offset=0,
    dcp=(0, 1, 1),
    seed=0,
):
    """Caches of ``layout`` on ``path``'s device holding LOGICAL, and the
    request's block table."""
    world = dcp[1]
    tokens_per_block = slots * pages_per_block * world
    n_blocks = -(-TOKENS // tokens_per_block) + 2  # spare blocks stay poisoned
    b = make_backing(
        layout,
        num_layers=LAYERS,
        num_pages=n_blocks * pages_per_block,
        heads=heads,
        slots=slots,
        content=CONTENT,
        dtype=DTYPE,
        seed=seed + 17,
    )
    table = blocks(n_blocks, seed)[: -(-TOKENS // tokens_per_block)]
    place(
        b.views,
        LOGICAL,
        table,
        range(TOKENS),
        pages_per_block=pages_per_block,
        head_offset=head_offset,
        dcp=dcp,
    )
    return to_device(b, path[1]).views, table


def sums(groups, tables, path):
    requests = [[GroupSpan(t, START, END) for t in tables]]
    result = KVDigester(groups, segment=SEG, implementation=path[0]).digest(requests).result()
    return [g.by_head() for g in result[0]]


def add_up(per_rank):
    """Per head and segment, the sum (mod 2**64) over ranks."""
    total: dict[int, list[int]] = {}
    for by_head in per_rank:
        for h, cells in by_head.items():
            acc = total.setdefault(h, [0] * len(cells))
            for s, v in enumerate(cells):
                acc[s] = (acc[s] + v) & MASK64
    return dict(sorted(total.items()))


def plain(path):
    views, table = laid_out(path, "LBHNC", 16)
    return sums([DigestGroup(views)], [table], path)[0]


FAST = [p for p in PATHS if not slow(p)]


@pytest.mark.parametrize("path", PATHS, ids=str)
def test_relocation_block_size_and_kernel_pages_do_not_change_it(path):
    expected = plain(path)
    variants = [
        dict(layout="LBHNC", slots=16, seed=5),  # other block ids
        dict(layout="LBHNC", slots=32),  # 32-token blocks
        dict(layout="LBHNC", slots=4, pages_per_block=8),  # 32-token blocks of 4-slot pages
        dict(layout="LBNHC", slots=8, pages_per_block=2, seed=9),  # other ids, layout, pages
    ]
    # The interpreter is slow: it runs the variant that changes the most at once.
    for v in variants[-1:] if slow(path) else variants:
        p = v.get("pages_per_block", 1)
        views, table = laid_out(path, **v)
        assert sums([DigestGroup(views, p)], [table], path)[0] == expected, v


@pytest.mark.parametrize("path", FAST, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_page_layout_gives_the_same_sums(path, layout):
    views, table = laid_out(path, layout, 16, seed=2)
    assert sums([DigestGroup(views)], [table], path)[0] == plain(path)


@pytest.mark.vllm
@pytest.mark.parametrize("path", PATHS, ids=str)
def test_vllm_views_of_every_layout_give_the_same_sums(path):
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from tests.helpers.worker_caches import allocate

    # head_size 4: vLLM's C holds K then V, 2 * 4 = 8 bf16 per head.
    spec = kvi.FullAttentionSpec(block_size=32, num_kv_heads=HEADS, head_size=4, dtype=DTYPE)
    logical = logical_content(LAYERS, HEADS, TOKENS, 8, DTYPE, seed=4)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    config = kvi.KVCacheConfig(
        num_blocks=12, kv_cache_tensors=[], kv_cache_groups=[kvi.KVCacheGroupSpec(names, spec)]
    )
    layouts = list(KVCacheLayout) if not slow(path) else [KVCacheLayout.BLNHC]
    results = []
    for i, layout in enumerate(layouts):
        # Kernel blocks of 16 tokens (2 pages per block) where vLLM allows them.
        split = {0: 16} if layout in (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC) else None
        caches = allocate(config, layout, kernel_block_sizes=split)
        views = [caches.views[n] for n in names]
        pages_per_block = views[0].shape[0] // config.num_blocks
        table = blocks(config.num_blocks, i)[: -(-TOKENS // 32)]
        place(views, logical, table, range(TOKENS), pages_per_block=pages_per_block)
        raw = caches.raw[0].to(path[1])
        views = [same_view(v, raw) for v in views]
        results.append(sums([DigestGroup(views, pages_per_block)], [table], path)[0])
    # The plain layout of the same content, built without vLLM.
    b = make_backing(
        "LBHNC", num_layers=LAYERS, num_pages=12, heads=HEADS, slots=32, content=8, dtype=DTYPE
    )
    table = list(range(-(-TOKENS // 32)))
    place(b.views, logical, table, range(TOKENS))
    expected = sums([DigestGroup(to_device(b, path[1]).views)], [table], path)[0]
    assert all(r == expected for r in results)


@pytest.mark.parametrize("path", PATHS, ids=str)
def test_heads_split_over_tp_ranks_add_up(path):
    expected = plain(path)
    ranks = []
    for r in range(2):  # TP 2: two KV heads each
        views, table = laid_out(path, "LBNHC", 16, heads=2, head_offset=2 * r, seed=r)
        ranks.append(sums([DigestGroup(views, head_offset=2 * r)], [table], path)[0])
    assert sorted(ranks[0]) == [0, 1] and sorted(ranks[1]) == [2, 3]
    assert add_up(ranks) == expected


@pytest.mark.parametrize("path", FAST, ids=str)
def test_replicated_heads_count_once(path):
    # TP 8 over 4 KV heads: rank r holds head r // 2; only even ranks count it.
    expected = plain(path)
    counted, everyone = [], []
    for r in range(8):
        views, table = laid_out(path, "LBHNC", 16, heads=1, head_offset=r // 2, seed=r)
        group = DigestGroup(views, head_offset=r // 2, counted_heads=[0] if r % 2 == 0 else [])
        counted.append(sums([group], [table], path)[0])
        everyone.append(sums([DigestGroup(views, head_offset=r // 2)], [table], path)[0])
    assert add_up(counted) == expected
    assert add_up(everyone) != expected  # counting every replica double-counts


@pytest.mark.parametrize(
    ("path", "world", "interleave"),
    [
        (path, w, i)
        for path in PATHS
        for w, i in [(4, 2), (2, 1), (2, 16), (4, 16)]
        if not slow(path) or (w, i) == (4, 2)
    ],
    ids=str,
)
def test_tokens_dealt_over_dcp_ranks_add_up(path, world, interleave):
    expected = plain(path)
    ranks = []
    for r in range(world):
        dcp = (r, world, interleave)
        views, table = laid_out(path, "LBHNC", 16, dcp=dcp, seed=r)
        group = DigestGroup(views, dcp_rank=r, dcp_world_size=world, interleave=interleave)
        ranks.append(sums([group], [table], path)[0])
    assert all(rank != expected for rank in ranks)  # each rank holds a share
    assert add_up(ranks) == expected
