"""The wrapper around an async-loading connector, on a real vLLM Scheduler.

The inner connector is a transport double (tests/helpers/async_double.py),
registered through vLLM's KVConnectorFactory; the wrapper, the scheduler and
the worker-side zeroing are real. The "transport" is simulated by writing the
loaded tokens into the worker's KV views (made with vLLM's own view helpers,
poisoned with NaN) before the load completes; after completion the tail must
be zero, the loaded tokens intact, and every other byte untouched.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.request import RequestStatus

from kvtail_connector import dcp_local_valid_slots
from kvtail_connector.core.kvgroups import group_infos
from kvtail_connector.core.parts.zeroing import RankPlacement
from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.facade.assembly import build_worker
from kvtail_connector.facade.inner import wrapper_fields
from tests.helpers import async_double
from tests.helpers.lifecycle import BLOCK, Harness, slot_state
from tests.helpers.vllm_factories import (
    make_hybrid_mamba_kv_cache_config,
    make_kv_cache_config,
    make_mixed_precision_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
)
from tests.helpers.worker_caches import ErrorSource, allocate, tail_policy

# The worker gets its metadata both ways: pickled (TP > 1) and as built (TP 1).
pytestmark = pytest.mark.usefixtures("both_deliveries")


def test_tail_shipped_once_and_zeroed_at_completion():
    h = Harness()
    h.add("r1", 100, double_load_tokens=70, double_finish_after_steps=2)
    h.step()  # allocates, ships the record; the load is in flight
    (record,) = h.records()
    assert (record.req_id, record.num_local, record.num_loaded) == ("r1", 0, 70)
    (load,) = record.groups
    ids = h.inner_scheduler.blocks_by_req["r1"][0]
    assert load.first_block == 0 and list(load.block_ids) == ids[:5]

    h.land("r1", 0, 0, 70)
    view = h.caches.views["model.layers.0.self_attn.attn"]
    assert slot_state(view, ids[4]) == ["loaded"] * 6 + ["stale"] * 10
    h.step()  # the double reports finished_recving: zeroed before returning
    for layer in ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"):
        v = h.caches.views[layer]
        assert slot_state(v, ids[4]) == ["loaded"] * 6 + ["zero"] * 10
        for b in ids[:4]:
            assert slot_state(v, b) == ["loaded"] * BLOCK
    # Nothing outside the tail moved: every other block is still all NaN.
    others = sorted(set(range(h.kv_cache_config.num_blocks)) - set(ids[:5]))
    assert torch.isnan(view[others]).all()
    h.finish()
    assert len(h.records()) == 1  # shipped exactly once
    slot_bytes = view.shape[1] * view.shape[3] * view.element_size()  # H x C
    assert h.stats["tails_zeroed"] == 1
    assert h.stats["tail_bytes_zeroed"] == 10 * 2 * slot_bytes  # 10 slots x 2 layers


def test_the_record_covers_the_groups_vllm_kept_from_zeroing(monkeypatch):
    # vLLM asks get_loaded_kv_cache_group_ids right before it allocates an async
    # load's blocks (the groups it exempts from zeroing); the record uses that
    # answer, and the inner connector is not asked again.
    h = Harness()
    inner = h.inner_scheduler
    original = inner.get_loaded_kv_cache_group_ids
    asked: list[str] = []

    def answer(request):
        asked.append(request.request_id)
        return original(request) if len(asked) == 1 else ()  # a second answer would differ

    monkeypatch.setattr(inner, "get_loaded_kv_cache_group_ids", answer)
    h.add("r1", 100, double_load_tokens=70, double_finish_after_steps=2)
    h.step()
    (record,) = h.records()
    assert [g.group for g in record.groups] == [0]
    assert asked == ["r1"]
    h.finish()
    assert h.stats["tails_zeroed"] == 1


def test_an_answer_kept_for_an_allocation_that_never_came_goes_with_the_request():
    h = Harness()
    request = h.add("r1", 100, double_load_tokens=70)
    connector = h.scheduler.connector
    # vLLM asked before an allocation that failed (no blocks); then the
    # request is aborted: nothing keeps it alive.
    connector.get_loaded_kv_cache_group_ids(request)
    assert connector._scheduler._asked[0] is request
    h.scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert connector._scheduler._asked is None


def test_block_aligned_load_zeroes_nothing():
    h = Harness()
    h.add("r1", 100, double_load_tokens=64)
    h.step()
    h.land("r1", 0, 0, 64)
    before = h.caches.raw[0].clone()
    h.step()
    assert torch.equal(h.caches.raw[0], before)
    h.finish()


def test_block_aligned_load_is_not_even_recorded_when_vllm_handles_failures():
    # Mixed precision: vLLM zeroes new blocks and re-zeroes failed loads itself,
    # so an aligned load leaves the wrapper nothing to do.
    h = Harness("auto", make_mixed_precision_kv_cache_config(block_size=BLOCK, num_blocks=64))
    assert h.kv_cache_config.needs_kv_cache_zeroing
    h.add("r1", 100, double_load_tokens=64)
    h.step()
    assert h.records() == []
    h.finish()


def test_full_prompt_hit_uses_the_count_before_the_rewind():
    h = Harness()
    request = h.add("r1", 70, double_load_tokens=70)
    h.step()
    (record,) = h.records()
    assert record.num_loaded == 70  # not 69: the forward rewrites slot 69 anyway
    ids = h.inner_scheduler.blocks_by_req["r1"][0]
    h.land("r1", 0, 0, 70)
    h.step()
    assert request.status == RequestStatus.RUNNING
    view = h.caches.views["model.layers.0.self_attn.attn"]
    assert slot_state(view, ids[4]) == ["loaded"] * 6 + ["zero"] * 10
    h.finish()


def test_hybrid_attention_group_only_with_its_coarser_block():
    kv = make_hybrid_mamba_kv_cache_config(block_size=64, num_blocks=64)
    h = Harness(
        "auto",
        kv,
        block_size=64,
        enable_prefix_caching=True,
        mamba_cache_mode="align",
        prefix_match_unit=16,
    )
    assert h.kv_cache_config.needs_kv_cache_zeroing
    assert h.scheduler.hash_block_size == 16 and h.scheduler.block_size == 64
    h.add("r1", 120, double_load_tokens=100)
    h.step()
    (record,) = h.records()
    assert [g.group for g in record.groups] == [0]  # the Mamba group has no tail
    ids = h.inner_scheduler.blocks_by_req["r1"][0]
    h.land("r1", 0, 0, 100)
    h.step()
    view = h.caches.views["model.layers.0.self_attn.attn"]
    assert slot_state(view, ids[1]) == ["loaded"] * 36 + ["zero"] * 28
    assert slot_state(view, ids[0]) == ["loaded"] * 64
    h.finish()


def test_dcp8_tail_in_a_12288_token_block_on_every_rank():
    kv = make_kv_cache_config(block_size=1536, num_blocks=8)
    vllm_config = make_vllm_config(
        **wrapper_fields(
            {
                "backend": "AsyncLoadDouble",
                "backend_module_path": async_double.MODULE_PATH,
                "zero_tails": "always",
            }
        ),
        block_size=1536,
        dcp_size=8,
        max_model_len=40_000,
        max_num_batched_tokens=40_000,
    )
    scheduler = make_scheduler(vllm_config, kv)
    assert scheduler.block_size == 12_288
    scheduler.add_request(
        make_request(
            "r1",
            20_000,
            block_size=scheduler.hash_block_size,
            kv_transfer_params={"double_load_tokens": 15_000, "double_finish_after_steps": 99},
        )
    )
    meta = scheduler.schedule().kv_connector_metadata
    (record,) = meta.loads
    (load,) = record.groups
    assert record.num_loaded == 15_000 and len(load.block_ids) == 2  # 15,000 / 12,288
    tail_block = load.block_ids[1]

    # Every DCP rank zeroes its own share: 15,000 - 12,288 = 2,712 valid tokens.
    groups = group_infos(scheduler.kv_cache_config, 8)
    assert groups[0].effective_block == 12_288
    caches = allocate(scheduler.kv_cache_config)
    for rank in range(8):
        for view in caches.views.values():
            view.fill_(float("nan"))
        worker = build_worker(
            groups,
            RankPlacement(rank, 8, 1),
            tail_policy(),
            stats=KVTailStats(),
        )
        worker.register_kv_caches(caches.views, scheduler.kv_cache_config, caches.layers)
        worker.bind(meta)
        worker.on_transfer_results({"r1"}, set(), inner=ErrorSource())
        valid = dcp_local_valid_slots(2712, rank, 8, 1)
        assert valid == 339  # 2,712 tokens dealt one by one to 8 ranks
        view = next(iter(caches.views.values()))
        page = view[tail_block]
        assert torch.isnan(page[:, :valid]).all() and not page[:, valid:].any()
        assert worker.num_tracked == 0
    scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)


@pytest.mark.parametrize("fail", [False, True], ids=["completes", "fails"])
def test_a_load_aborted_in_flight_is_not_zeroed_and_leaks_nothing(fail):
    # Nobody reads an aborted request's blocks again, and their next owner is
    # zeroed or written on its own; zeroing them at the completion could land
    # after a new owner's transfer that bypasses the worker's fence.
    h = Harness()  # "always": failed loads would be zeroed whole too
    h.add("r1", 80, double_load_tokens=75, double_finish_after_steps=3, double_fail=fail)
    h.step()
    h.land("r1", 0, 0, 75)
    ids = h.inner_scheduler.blocks_by_req["r1"][0]
    h.scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    before = {g: raw.clone() for g, raw in h.caches.raw.items()}
    h.step()
    assert h.worker.inner.finished_req_ids_seen == {"r1"}
    h.step()  # finished_recving: vLLM frees the blocks
    assert "r1" in h.inner_scheduler.finished_recving_seen
    for g, raw in h.caches.raw.items():
        assert torch.equal(raw, before[g])  # not a byte written for the dead request
    view = h.caches.views["model.layers.0.self_attn.attn"]
    assert slot_state(view, ids[4]) == ["loaded"] * 11 + ["stale"] * 5
    assert h.stats["tails_zeroed"] == 0 and h.stats["tail_bytes_zeroed"] == 0
    h.finish()


def test_failed_load_zeroes_every_destination_block():
    h = Harness()  # "always" on a uniform model: vLLM would not re-zero them
    h.add("r1", 100, double_load_tokens=70, double_fail=True)
    h.step()
    ids = h.inner_scheduler.blocks_by_req["r1"][0]
    view = h.caches.views["model.layers.0.self_attn.attn"]
    for b in ids[:5]:
        assert slot_state(view, b) == ["zero"] * BLOCK
    assert h.stats["failed_loads"] == 1 and h.stats["tails_zeroed"] == 0
    h.finish()


def test_invalid_blocks_zero_from_the_first_invalid_block_on():
    h = Harness()
    h.add(
        "r1",
        100,
        double_load_tokens=70,
        double_invalid_block_indices=[2],
        double_finish_after_steps=2,
    )
    h.step()
    h.land("r1", 0, 0, 70)
    h.step()
    ids = h.inner_scheduler.blocks_by_req["r1"][0]
    view = h.caches.views["model.layers.0.self_attn.attn"]
    assert slot_state(view, ids[0]) == ["loaded"] * BLOCK  # before it: untouched
    assert slot_state(view, ids[1]) == ["loaded"] * BLOCK
    for b in ids[2:5]:
        assert slot_state(view, b) == ["zero"] * BLOCK
    h.finish()


def test_failed_load_steps_aside_when_vllm_rezeroes():
    h = Harness("auto", make_mixed_precision_kv_cache_config(block_size=BLOCK, num_blocks=64))
    h.add("r1", 100, double_load_tokens=70, double_fail=True)
    before = {g: raw.clone() for g, raw in h.caches.raw.items()}
    h.step()
    for g, raw in h.caches.raw.items():
        assert torch.equal(raw, before[g])  # vLLM's record_blocks_for_zeroing does it
    assert h.stats["failed_loads"] == 1 and h.stats["tail_bytes_zeroed"] == 0
    h.finish()


def test_preemption_after_the_load_ships_nothing_new_and_leaks_nothing():
    h = Harness()
    request = h.add("r1", 100, double_load_tokens=70, max_tokens=8)
    h.step()
    h.step()
    assert request.status == RequestStatus.RUNNING
    assert h.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert request.status == RequestStatus.PREEMPTED
    h.finish()
    assert len(h.records()) == 1  # the recompute is local: no new load, no new record
    assert h.scheduler.connector.scheduler_state_is_empty()


def test_tails_zeroed_in_one_call_for_several_requests():
    h = Harness()
    for i, n in enumerate((70, 45, 33)):
        h.add(f"r{i}", 100, double_load_tokens=n, double_finish_after_steps=2)
    h.step()
    for i, n in enumerate((70, 45, 33)):
        h.land(f"r{i}", 0, 0, n)
    calls = []
    zeroer = h.worker._worker._rank.zeroer
    original = zeroer.zero  # CPU caches: the torch path, items as (set, block, first) rows
    zeroer.zero = lambda items, **kw: calls.append(items.tolist()) or original(items, **kw)
    h.step()
    # One launch for the three requests (both layers are in one cache set).
    assert len(calls) == 1 and len(calls[0]) == 3
    view = h.caches.views["model.layers.1.self_attn.attn"]
    for i, n in enumerate((70, 45, 33)):
        b = h.inner_scheduler.blocks_by_req[f"r{i}"][0][n // BLOCK]
        assert slot_state(view, b) == ["loaded"] * (n % BLOCK) + ["zero"] * (BLOCK - n % BLOCK)
    h.finish()


def test_vllm_null_block_is_block_zero():
    # The scheduler side recognises null (skipped) blocks by this id.
    from kvtail_connector import _compat

    h = Harness()
    pool = h.scheduler.kv_cache_manager.block_pool
    assert pool.null_block.is_null and pool.null_block.block_id == _compat.NULL_BLOCK_ID
