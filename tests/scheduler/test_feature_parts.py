"""The shape of the two sides: coordinators route, parts hold the state.

TailScheduler and TailWorker keep no per-request state of their own (every
container lives in a feature part), and a feature the policy turns off has no
part, so none of its code runs on any hook.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvtail_connector.connectors import adapter_for
from kvtail_connector.core.kvgroups import group_infos
from kvtail_connector.core.parts.records import LoadRecords
from kvtail_connector.core.parts.zeroing import RankPlacement
from kvtail_connector.core.policy import TailPolicy
from kvtail_connector.core.scheduler import TailScheduler
from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.core.worker import TailWorker
from kvtail_connector.extras import entry_values
from kvtail_connector.extras.scheduler import EntryFeatures
from kvtail_connector.facade.assembly import build_worker
from tests.helpers.recording import RecordingConnector
from tests.helpers.vllm_factories import make_kv_cache_config
from tests.helpers.worker_caches import allocate

ALL_ON = dict.fromkeys(
    (f.name for f in dataclasses.fields(TailPolicy) if f.type in ("bool", bool)), True
)
# A policy that is only consistent as a test subject: every part built at once.
EVERY_PART = TailPolicy(**{**ALL_ON, "producer_hook": "wait_for_save"})
NO_PART = TailPolicy(**dict.fromkeys(ALL_ON, False))

CONTAINERS = (dict, list, set, frozenset, tuple)


def _worker(policy: TailPolicy) -> TailWorker:
    kv = make_kv_cache_config(block_size=16, num_blocks=8)
    worker = build_worker(group_infos(kv, 1), RankPlacement(), policy, stats=KVTailStats())
    caches = allocate(kv)
    worker.register_kv_caches(caches.views, kv, caches.layers)
    return worker


def _scheduler(policy: TailPolicy) -> TailScheduler:
    kv = make_kv_cache_config(block_size=16, num_blocks=8)
    groups = group_infos(kv, 1)
    stats = KVTailStats()
    records = LoadRecords(object(), groups, records_every_load=policy.records_every_load)
    extra = (
        EntryFeatures(
            records,
            policy,
            stats,
            geometry=entry_values.geometry([g.kv_cache_spec for g in kv.kv_cache_groups], 1, 1),
        )
        if policy.runs_extras
        else None
    )
    return TailScheduler(
        object(),  # the inner connector: no hook runs here
        groups,
        policy,
        adapter=adapter_for(RecordingConnector, {}, []),
        stats=stats,
        records=records,
        extra=extra,
    )


def _own_containers(obj: Any) -> list[str]:
    """Containers held by ``obj`` that are not a part's: the per-load hooks
    may keep a part's dict or list at hand (the very object), and a tuple of
    parts or of their containers, never state of their own."""
    parts = [v for v in vars(obj).values() if hasattr(v, "__dict__")]
    theirs = {id(part) for part in parts} | {id(v) for part in parts for v in vars(part).values()}

    def wiring(value: Any) -> bool:
        if isinstance(value, tuple):
            return all(id(item) in theirs for item in value)
        return id(value) in theirs

    return [
        name
        for name, value in vars(obj).items()
        if isinstance(value, CONTAINERS) and not wiring(value)
    ]


@pytest.mark.parametrize("build", [_worker, _scheduler], ids=["worker", "scheduler"])
def test_the_coordinators_hold_no_state_of_their_own(build):
    side = build(EVERY_PART)
    assert _own_containers(side) == []
    assert side.num_tracked == 0


def test_every_part_exists_when_every_feature_is_on():
    worker, scheduler = _worker(EVERY_PART), _scheduler(EVERY_PART)
    for side, parts in (
        (worker, ("_tails", "_errors", "_reads", "_extra")),
        (worker._extra, ("_claims", "_verify")),
        (scheduler, ("_tails", "_errors", "_reads", "_extra")),
        (scheduler._extra, ("_claims", "_verify", "_reader", "_writer")),
    ):
        assert all(getattr(side, p) is not None for p in parts), parts


def test_a_feature_that_is_off_has_no_part():
    worker, scheduler = _worker(NO_PART), _scheduler(NO_PART)
    assert (worker._reads, worker._extra) == (None, None)
    assert (scheduler._reads, scheduler._extra) == (None, None)
