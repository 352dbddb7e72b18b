"""The packed completion path (Triton, through the interpreter: each load's
tail encoded where it arrives, RankCaches.stale_tail, and one launch under
the widest shapes) zeroes byte for byte what the torch path does (the same
loads' items), on two groups of different precision and row counts, DCP ranks
(including ones whose share of a tail block is empty or whole) and page
splits, with a null tail block among the loads."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from kvtail_connector.core.kvgroups import group_infos
from kvtail_connector.core.metadata import NULL_BLOCK, GroupLoad, KVTailMetadata, LoadRecord
from kvtail_connector.core.parts.zeroing import RankPlacement
from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.facade.assembly import build_worker
from tests.helpers.vllm_factories import (
    make_kv_cache_config,
    make_mixed_precision_kv_cache_config,
)
from tests.helpers.worker_caches import ErrorSource, allocate, tail_policy


@pytest.mark.parametrize("config", ["full", "mixed"])
@pytest.mark.parametrize("dcp", [(1, 0, 1), (2, 0, 1), (2, 1, 1), (4, 3, 2), (2, 1, 16)])
@pytest.mark.parametrize("kbs", [None, 8])
def test_packed_path_zeroes_what_the_per_load_path_does(config, dcp, kbs, monkeypatch):
    import kvtail_connector.core.parts.zeroing as zeroing

    world, rank, interleave = dcp
    num_blocks = 12
    if config == "full":
        kv = make_kv_cache_config(block_size=16, num_blocks=num_blocks, dtype=torch.bfloat16)
    else:
        kv = make_mixed_precision_kv_cache_config(block_size=16, num_blocks=num_blocks)
    ngroups = len(kv.kv_cache_groups)
    infos = group_infos(kv, world)
    kernel_sizes = {g: kbs for g in range(ngroups)} if kbs else None
    results = {}
    orig = zeroing.KVZeroer
    for impl in ("torch", "triton"):
        monkeypatch.setattr(zeroing, "KVZeroer", functools.partial(orig, implementation=impl))
        caches = allocate(kv, kernel_block_sizes=kernel_sizes)
        gen = torch.Generator().manual_seed(1)
        for raw in caches.raw.values():
            raw.copy_(torch.randint(-100, 100, raw.shape, dtype=torch.int8, generator=gen))
        worker = build_worker(
            infos, RankPlacement(rank, world, interleave), tail_policy(), stats=KVTailStats()
        )
        worker.register_kv_caches(caches.views, kv, caches.layers)
        zeroer = worker._rank.zeroer
        assert zeroer.launches_packed == (impl == "triton")
        rng = random.Random(7)
        pools = []
        for _ in range(ngroups):
            pool = list(range(1, num_blocks))
            rng.shuffle(pool)
            pools.append(pool)
        loads = []
        for i in range(4):
            groups = []
            loaded = rng.randrange(1, 2 * min(i.effective_block for i in infos) + 1)
            for g in range(ngroups):
                eb = infos[g].effective_block
                n = -(-loaded // eb)
                ids = tuple(pools[g].pop() for _ in range(n))
                if i == 3 and n > 1:
                    ids = ids[:-1] + (NULL_BLOCK,)
                groups.append(GroupLoad(g, 0, ids))
            loads.append(LoadRecord(f"r{i}", 0, loaded, tuple(groups)))
        worker.bind(KVTailMetadata(inner=None, loads=tuple(loads)))  # type: ignore[arg-type]
        bulk = []
        real = zeroer.zero_packed
        monkeypatch.setattr(
            zeroer,
            "zero_packed",
            lambda w, t, bulk=bulk, real=real: (bulk.append(len(w) + len(t)), real(w, t)),
        )
        worker.on_transfer_results({r.req_id for r in loads}, set(), inner=ErrorSource())
        if impl == "triton" and (world, rank) in ((1, 0), (2, 0)):
            assert bulk and bulk[0] > 0  # the packed path ran, with lines
        results[impl] = {g: r.clone() for g, r in caches.raw.items()}
        assert worker.num_tracked == 0
    for g in results["torch"]:
        assert torch.equal(results["torch"][g], results["triton"][g]), g
