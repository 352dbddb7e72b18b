"""Counters as the front end sees them, with several TP workers.

Each rank runs its own wrapper and transport double on its own caches; their
outputs go through vLLM's ``KVOutputAggregator`` and the real Scheduler, and
the test reads the stats payload ``update_from_output`` hands the front end
(``EngineCoreOutputs.scheduler_stats.kv_connector_stats``): per-request
counters must count each request once, byte counters every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

from kvtail_connector import _compat
from kvtail_connector.core.stats import COUNTERS
from tests.helpers.lifecycle import Harness
from tests.helpers.vllm_factories import (
    assert_scheduler_empty,
    make_model_runner_output,
    make_worker_connector,
    run_worker_step,
)
from tests.helpers.worker_caches import allocate


class TPRun:
    """A real Scheduler and ``ranks`` worker connectors; rank 0 counts requests."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, ranks: int, **kw: Any) -> None:
        self.h = Harness(**kw)
        self.workers = [self.h.worker]
        with monkeypatch.context() as patch:
            patch.setattr(_compat, "counts_requests_on_this_rank", lambda: False, raising=False)
            for _ in range(ranks - 1):
                worker = make_worker_connector(self.h.vllm_config, self.h.kv_cache_config)
                worker.register_kv_caches(
                    allocate(self.h.kv_cache_config).publish(self.h.vllm_config)
                )
                self.workers.append(worker)
        self.aggregator = KVOutputAggregator(ranks)
        self.totals = dict.fromkeys(COUNTERS, 0)
        self.held: list[int] = []  # every held_requests level the front end saw

    def step(self) -> None:
        scheduler = self.h.scheduler
        out = scheduler.schedule()
        outputs = [
            make_model_runner_output(
                out, scheduler=scheduler, kv_connector_output=run_worker_step(w, out)
            )
            for w in self.workers
        ]
        engine_outputs = scheduler.update_from_output(out, self.aggregator.aggregate(outputs))
        for eco in engine_outputs.values():
            stats = eco.scheduler_stats.kv_connector_stats if eco.scheduler_stats else None
            for name in COUNTERS:
                self.totals[name] += int((stats or {}).get(name, 0))
            if stats and "held_requests" in stats:
                self.held.append(int(stats["held_requests"]))

    def finish(self) -> None:
        for _ in range(50):
            if not self.h.scheduler.has_requests():
                break
            self.step()
        self.h.scheduler.schedule()
        assert_scheduler_empty(self.h.scheduler)
        assert all(w.scheduler_state_is_empty() for w in self.workers)


def _run(monkeypatch: pytest.MonkeyPatch, ranks: int, **params: Any) -> TPRun:
    zero_tails = params.pop("zero_tails", "always")
    run = TPRun(monkeypatch, ranks, zero_tails=zero_tails, kv_load_failure_policy="recompute")
    run.h.add("r1", 100, double_load_tokens=70, double_finish_after_steps=2, **params)
    run.finish()
    return run


def test_a_zeroed_tail_counts_once_over_four_ranks_and_its_bytes_on_every_rank(monkeypatch):
    one = _run(monkeypatch, 1).totals
    four = _run(monkeypatch, 4).totals
    assert one["tails_zeroed"] == four["tails_zeroed"] == 1
    assert one["tail_bytes_zeroed"] > 0
    assert four["tail_bytes_zeroed"] == 4 * one["tail_bytes_zeroed"]
    assert four["failed_loads"] == 0


@pytest.mark.parametrize(
    "params",
    [
        {"double_fail": True},
        {"double_invalid_block_indices": [1]},
        {"double_fail": True, "double_invalid_block_indices": [0, 1, 2, 3, 4]},
    ],
    ids=["failed", "invalid-block", "failed-and-all-invalid"],
)
def test_a_failed_load_counts_once_over_four_ranks(monkeypatch, params):
    assert _run(monkeypatch, 4, **params).totals["failed_loads"] == 1


@pytest.mark.parametrize("loaded", [70, 64], ids=["mid-block", "block-aligned"])
def test_failed_loads_count_when_the_wrapper_keeps_no_record(monkeypatch, loaded):
    # "auto" on a uniform model zeroes nothing and records no load; a
    # block-aligned load has no tail: both failures still count.
    run = TPRun(monkeypatch, 2, zero_tails="auto", kv_load_failure_policy="recompute")
    run.h.add("r1", 100, double_load_tokens=loaded, double_fail=True)
    run.finish()
    assert run.totals["failed_loads"] == 1 and run.totals["tails_zeroed"] == 0


def test_held_requests_is_reported_while_a_load_is_in_flight_and_returns_to_zero(monkeypatch):
    run = TPRun(monkeypatch, 2, zero_tails="always", kv_load_failure_policy="recompute")
    run.h.add("r1", 100, double_load_tokens=70, double_finish_after_steps=3)
    run.step()
    assert run.held and run.held[-1] == 1
    run.finish()
    assert run.held[-1] == 0
