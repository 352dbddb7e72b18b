"""False vouches are counted once per request, whichever TP rank finds them
(issue 18, item 5), on the real Scheduler with several consumer workers
folded through vLLM's ``KVOutputAggregator``.

Each rank holds its own share of the KV heads, so a producer's stale tail can
show on one rank only. vLLM sums every worker's stats: ranks report the ids in
their worker metadata and the scheduler side counts each request once.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

from kvtail_connector import _compat
from tests.helpers.lifecycle import LOADED, Harness, routed, slot_state
from tests.helpers.vllm_factories import (
    make_model_runner_output,
    make_worker_connector,
    run_worker_step,
)
from tests.helpers.worker_caches import allocate
from tests.scheduler.test_producer_tails import prefill_leg, producer

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
PROMPT = 37


@pytest.fixture(scope="module")
def vouched() -> dict[str, Any]:
    """A real producer's params for a 37-token prompt, as a router hands them
    to D (its bound entry and the transfer's identity)."""
    return routed(prefill_leg(producer(), "p1", PROMPT))


class TPConsumer:
    """A real Scheduler and ``ranks`` consumer workers through vLLM's aggregator;
    only rank 0 counts per-request counters, as with model-parallel groups."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, ranks: int) -> None:
        monkeypatch.setattr(_compat, "worker_count", lambda _p: ranks)
        self.h = Harness("always", probe_stale_tails=True, vouch_tails="trust")
        self.workers = [self.h.worker]
        self.caches = [self.h.caches]
        for rank in range(1, ranks):
            with monkeypatch.context() as patch:
                patch.setattr(_compat, "worker_rank", lambda r=rank: r)
                patch.setattr(_compat, "counts_requests_on_this_rank", lambda: False)
                w = make_worker_connector(self.h.vllm_config, self.h.kv_cache_config)
            caches = allocate(self.h.kv_cache_config)
            w.register_kv_caches(caches.publish(self.h.vllm_config))
            self.h._capture(f"worker{rank}", w)
            self.workers.append(w)
            self.caches.append(caches)
        self.aggregator = KVOutputAggregator(ranks)

    def step(self) -> None:
        s = self.h.scheduler
        out = s.schedule()
        outputs = [
            make_model_runner_output(out, scheduler=s, kv_connector_output=run_worker_step(w, out))
            for w in self.workers
        ]
        metas = [o.kv_connector_output.kv_connector_worker_meta for o in outputs]
        folded = self.aggregator.aggregate(outputs)
        agg = metas[0]
        for m in metas[1:]:
            agg = agg.aggregate(m)
        folded.kv_connector_output.kv_connector_worker_meta = agg
        s.update_from_output(out, folded)

    def land(self, req_id: str, stale_on: set[int]) -> list[int]:
        """Every rank receives tokens [0, 37); ranks not in ``stale_on`` get the
        tail zeroed as a vouching producer's block arrives."""
        ids = self.h.inner_scheduler.blocks_by_req[req_id][0]
        for rank, caches in enumerate(self.caches):
            for layer in LAYERS:
                view = caches.views[layer]
                for t in range(PROMPT):
                    view[ids[t // 16], :, t % 16, :] = LOADED
                if rank not in stale_on:
                    view[ids[2], :, 5:, :] = 0
        return list(ids)

    def finish(self) -> None:
        for _ in range(50):
            if not self.h.scheduler.has_requests():
                break
            self.step()
        self.h.scheduler.schedule()
        assert self.h.scheduler.connector.scheduler_state_is_empty()
        assert all(w.scheduler_state_is_empty() for w in self.workers)


@pytest.mark.parametrize(
    "stale_on", [{1}, {0}, {0, 1, 2, 3}, set()], ids=["rank1", "rank0", "all", "none"]
)
def test_a_false_vouch_counts_once_whichever_ranks_find_it(monkeypatch, vouched, stale_on):
    tp = TPConsumer(monkeypatch, ranks=4)
    tp.h.add("c1", PROMPT, double_load_tokens=PROMPT, double_finish_after_steps=2, **vouched)
    tp.step()
    ids = tp.land("c1", stale_on)
    tp.step()
    for caches in tp.caches:  # every rank's tail ends zero (found ones zeroed)
        for layer in LAYERS:
            assert slot_state(caches.views[layer], ids[2]) == ["loaded"] * 5 + ["zero"] * 11
    tp.finish()
    assert tp.h.stats["false_vouches"] == (1 if stale_on else 0)


def test_two_requests_found_by_different_ranks_count_twice(monkeypatch, vouched):
    tp = TPConsumer(monkeypatch, ranks=2)
    for req in ("c1", "c2"):
        tp.h.add(req, PROMPT, double_load_tokens=PROMPT, double_finish_after_steps=2, **vouched)
    tp.step()
    tp.land("c1", {1})
    tp.land("c2", {0})
    tp.step()
    tp.finish()
    assert tp.h.stats["false_vouches"] == 2
