"""Sleep-mode lifecycle (issue 18, item 3) on the real Scheduler (0.32 and 0.33).

vLLM 0.33's worker unregisters the connector's KV caches in ``sleep()``, in
``discard(("kv_cache",))`` (``release_kv_cache_memory()``) and restores them in
``wake_up()`` (tags None or with "kv_cache"); the base class documents both as
idempotent. Any sequence of them must leave zeroing and verification working
once the caches are back, and counters must count only what was really done.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.request import RequestStatus

from tests.helpers.lifecycle import Harness, routed, slot_state
from tests.helpers.worker_caches import allocate
from tests.scheduler.test_kv_digest import consumer, fill, prefill, producer, transfer

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def _slot_bytes(view: torch.Tensor) -> int:
    return view.shape[1] * view.shape[3] * view.element_size()


def _apply(h: Harness, ops: tuple[str, ...]) -> None:
    for op in ops:
        if op == "unregister":  # sleep(), or discard(("kv_cache",))
            h.worker.unregister_kv_caches()
        elif op == "restore":  # wake_up(None) / wake_up(["kv_cache"])
            h.worker.restore_kv_caches()
        elif op == "reset":  # reset_prefix_cache(reset_connector=True) while asleep
            assert h.scheduler.reset_prefix_cache(reset_connector=True)
        else:
            raise AssertionError(op)


SEQUENCES = {
    "release-sleep-wake": ("unregister", "unregister", "restore"),
    "sleep-wake-wake": ("unregister", "restore", "restore"),
    "wake-without-sleep": ("restore",),
    "two-cycles": ("unregister", "restore", "unregister", "restore"),
    "sleep-reset-wake": ("unregister", "reset", "restore"),
    "release-sleep-reset-wake-wake": ("unregister", "unregister", "reset", "restore", "restore"),
}


@pytest.mark.parametrize("ops", list(SEQUENCES.values()), ids=list(SEQUENCES))
def test_after_any_sleep_sequence_a_completed_load_is_zeroed(ops):
    h = Harness("always")
    _apply(h, ops)
    h.add("r1", 100, double_load_tokens=70, double_finish_after_steps=2)
    h.step()
    h.land("r1", 0, 0, 70)
    ids = h.inner_scheduler.blocks_by_req["r1"][0]
    h.step()
    for layer in LAYERS:
        view = h.caches.views[layer]
        assert slot_state(view, ids[4]) == ["loaded"] * 6 + ["zero"] * 10
        for b in ids[:4]:
            assert slot_state(view, b) == ["loaded"] * 16
    others = sorted(set(range(h.kv_cache_config.num_blocks)) - set(ids[:5]))
    assert torch.isnan(h.caches.views[LAYERS[0]][others]).all()
    h.finish()
    view = h.caches.views[LAYERS[0]]
    assert h.stats["tails_zeroed"] == 1
    assert h.stats["tail_bytes_zeroed"] == 10 * len(LAYERS) * _slot_bytes(view)
    assert h.stats["failed_loads"] == 0


def test_a_load_bound_while_asleep_is_zeroed_after_wake_up():
    h = Harness("always")
    h.worker.unregister_kv_caches()
    h.add("r1", 100, double_load_tokens=70, double_finish_after_steps=3)
    h.step()  # the record arrives while the caches are released
    h.worker.unregister_kv_caches()
    h.worker.restore_kv_caches()
    h.land("r1", 0, 0, 70)
    ids = h.inner_scheduler.blocks_by_req["r1"][0]
    h.step()
    h.step()
    assert slot_state(h.caches.views[LAYERS[0]], ids[4]) == ["loaded"] * 6 + ["zero"] * 10
    h.finish()
    assert h.stats["tails_zeroed"] == 1 and h.stats["failed_loads"] == 0


def test_a_load_completing_while_the_cache_is_released_is_failed_not_counted(caplog):
    h = Harness("always")
    h.add("r1", 100, double_load_tokens=70, double_finish_after_steps=2)
    h.step()
    h.land("r1", 0, 0, 70)
    ids = h.inner_scheduler.blocks_by_req["r1"][0]
    h.worker.unregister_kv_caches()
    h.step()  # completes while released: nothing zeroed, reported failed
    assert slot_state(h.caches.views[LAYERS[0]], ids[4]) == ["loaded"] * 6 + ["stale"] * 10
    assert "released" in caplog.text
    h.worker.restore_kv_caches()
    out = h.step()  # recompute: vLLM dropped the load and computes the prompt
    assert out.num_scheduled_tokens.get("r1") == 100
    assert h.scheduler.requests["r1"].status == RequestStatus.RUNNING
    h.finish()
    assert h.stats["tails_zeroed"] == 0 and h.stats["tail_bytes_zeroed"] == 0
    assert h.stats["failed_loads"] == 1
    # Zeroing is on again for the next load.
    h.add("r2", 100, double_load_tokens=70, double_finish_after_steps=2)
    h.step()
    h.land("r2", 0, 0, 70)
    ids = h.inner_scheduler.blocks_by_req["r2"][0]
    h.step()
    assert slot_state(h.caches.views[LAYERS[0]], ids[4]) == ["loaded"] * 6 + ["zero"] * 10
    h.finish()
    assert h.stats["tails_zeroed"] == 1


@pytest.mark.parametrize("flip", [False, True], ids=["clean", "one-byte-flipped"])
def test_verification_works_after_release_sleep_wake(flip):
    p = producer()
    fill(p, seed=7)
    params = prefill(p)
    d = consumer()
    _apply(d, SEQUENCES["release-sleep-wake"])
    d.add("c1", 37, double_load_tokens=37, double_finish_after_steps=2, **routed(params))
    d.step()
    (p_ids,) = params["remote_block_ids"]
    transfer(p, p_ids, d, "c1", 37)
    if flip:
        d_ids = d.inner_scheduler.blocks_by_req["c1"][0]
        d.caches.views[LAYERS[1]][d_ids[1], 0, 3].view(torch.uint8)[3] ^= 0x10
    d.finish()
    assert (d.stats["digest_mismatches"], d.stats["digests_verified"]) == (
        (1, 0) if flip else (0, 1)
    )
    assert d.stats["failed_loads"] == (1 if flip else 0)


def test_caches_registered_while_asleep_are_not_replaced_by_the_old_ones_on_wake():
    h = Harness("always")
    h.worker.unregister_kv_caches()
    fresh = allocate(h.kv_cache_config)
    h.worker.register_kv_caches(fresh.publish(h.vllm_config))  # a new KV cache, registered anew
    h.worker.restore_kv_caches()
    h.caches = fresh  # the transport writes into the registered caches
    h.add("r1", 100, double_load_tokens=70, double_finish_after_steps=2)
    h.step()
    h.land("r1", 0, 0, 70)
    ids = h.inner_scheduler.blocks_by_req["r1"][0]
    h.step()
    assert slot_state(fresh.views[LAYERS[0]], ids[4]) == ["loaded"] * 6 + ["zero"] * 10
    h.finish()
    assert h.stats["tails_zeroed"] == 1
