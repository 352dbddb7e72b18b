"""What a contained failure leaves behind (issue 18, review of item 2).

Each test injects a fault into the wrapper's own code where a review found a
contained failure that still lost data, hung a request, or counted work that
never ran, and runs the facade's fallback as the facade does
(:class:`~kvtail_connector.core.containment.Containment`): a failed call leaves no
per-step state for a later step to act on, every completion taken out of a
hold in a failed pass still reaches vLLM (reported failed), counters count only
launches that returned, and a device error is never contained.
"""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvtail_connector.core.containment import Containment, mark_inner
from kvtail_connector.core.metadata import GroupLoad, KVTailMetadata, LoadRecord
from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.extras.kv_verification import rank_digests as kv_digests_mod
from kvtail_connector.ops import KVZeroer, reference_zero_kv_blocks
from tests.helpers.layouts import rebase
from tests.helpers.lifecycle import Harness, slot_state
from tests.helpers.vllm_factories import make_kv_cache_config
from tests.helpers.worker_caches import ErrorSource, allocate, make_tail_worker
from tests.scheduler.test_containment import (
    LAYERS,
    Injected,
    _assert_clean_load_zeroed,
    _assert_recomputed,
    _inject_once,
    _load,
    _slot_bytes,
)
from tests.scheduler.test_kv_digest import (  # noqa: F401  (sent: a fixture)
    PROMPT,
    consumer,
    load_with_a_late_digest,
    routed,
    run_step,
    sent,
    transfer,
)
from tests.scheduler.test_read_tails import LAYERS as READ_LAYERS
from tests.scheduler.test_read_tails import (
    TAILS,
    _expected,
    _land_read,
    setup,  # noqa: F401  (a fixture)
)


def _guard(worker: Any) -> Containment:
    """The facade's guard around ``worker`` (no inner connector's frames)."""
    return Containment(worker._rank.stats)


# ------------------------------------------------ 1. per-layer READ tails


def _reads_started_contained(worker: Any, landed: bool = False) -> None:
    """The facade's start_load_kv: reads_started, contain_reads on failure."""
    reads = worker.read_loads
    try:
        worker.reads_started(landed)
    except Exception as exc:
        _guard(worker).failed(
            exc, "start_load_kv (READ tails)", (), lambda: worker.contain_reads(reads, landed)
        )


def _decode_then_next_read(s: Any) -> None:
    """Step k's forward: request a decodes into block 6, slots 5..7 (valid KV);
    step k+1: one new READ load c (block 7, tail from slot 2), landed per layer."""
    for name in READ_LAYERS:
        s.caches.views[name][6, :, 5:8] = 1.0
    c = LoadRecord("c", 0, 2, (GroupLoad(0, 0, (7,)),))
    s.worker.bind(KVTailMetadata(inner=None, read_loads=(c,)))  # type: ignore[arg-type]
    s.worker.reads_started(landed=False)
    for name in READ_LAYERS:
        s.worker.layer_loaded(name)
    s.worker.end_step()


def test_a_failed_read_staging_zeroes_at_the_waits_and_leaves_nothing_for_the_next_step(
    setup,  # noqa: F811
    monkeypatch,
):
    s = setup
    _inject_once(monkeypatch, s.worker._reads._per_layer._by_layer, "stage")
    _reads_started_contained(s.worker)  # step k: a and b armed, staging fails
    assert s.stats.data["internal_errors"] == 1
    before = _land_all(s)
    for name in READ_LAYERS:  # step k's forward: each layer's wait, before its attention
        s.worker.layer_loaded(name)
    s.worker.end_step()
    assert torch.equal(s.caches.raw[0], _expected(s, list(READ_LAYERS), before))
    assert s.worker.num_tracked == 0
    _decode_then_next_read(s)
    for name in READ_LAYERS:
        # a's decode of step k kept; c's tail zeroed as usual.
        assert bool((s.caches.views[name][6, :, 5:8] == 1.0).all()), name
        assert not s.caches.views[name][7, :, 2:].any(), name


def _inject_nth(patch: pytest.MonkeyPatch, obj: Any, name: str, n: int) -> None:
    """``obj.name`` raises at its ``n``-th call (1-based), works otherwise."""
    original = getattr(obj, name)
    calls = []

    def faulty(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == n:
            raise Injected("injected")
        return original(*args, **kwargs)

    patch.setattr(obj, name, faulty)


def _tail_bytes(s: Any) -> int:
    """What zeroing READS' tails in every layer counts."""
    slot_bytes = sum(_slot_bytes(s.caches.views[name]) for name in READ_LAYERS)
    return sum(16 - first for _, first in TAILS) * slot_bytes


def _land_all(s: Any) -> torch.Tensor:
    for i, name in enumerate(READ_LAYERS):
        _land_read(s.caches.views[name], seed=i)
    return s.caches.raw[0].clone()


def _layer_loaded_contained(worker: Any, name: str) -> None:
    """The facade's wait_for_layer_load: layer_loaded, its fallback on failure."""
    try:
        worker.layer_loaded(name)
    except Exception as exc:
        _guard(worker).failed(
            exc, "wait_for_layer_load (READ tails)", (), worker.contain_layer_loaded
        )


@pytest.mark.parametrize("failing", [1, 2], ids=["first-layer-left", "second-layer-left"])
def test_a_failed_end_step_zeroes_what_is_left_and_leaves_no_layer_work_behind(
    setup,  # noqa: F811
    monkeypatch,
    failing,
):
    s = setup
    s.worker.reads_started(landed=False)
    before = _land_all(s)
    s.worker.layer_loaded(READ_LAYERS[0])  # the other layers' waits never ran
    _inject_nth(monkeypatch, s.worker._reads._per_layer._by_layer, "zero", failing)
    try:
        s.worker.end_step()
    except Exception as exc:
        _guard(s.worker).failed(exc, "clear_connector_metadata", (), s.worker.contain_end_step)
    assert s.stats.data["internal_errors"] == 1
    assert s.worker.num_tracked == 0
    # The layers end_step had left to zero are zeroed on the reference path,
    # as end_step would have; each layer's bytes counted once.
    assert torch.equal(s.caches.raw[0], _expected(s, list(READ_LAYERS), before))
    assert s.stats.data["tail_bytes_zeroed"] == _tail_bytes(s)
    _decode_then_next_read(s)
    for name in READ_LAYERS:
        assert bool((s.caches.views[name][6, :, 5:8] == 1.0).all()), name


@pytest.mark.parametrize("partway", ["first-layer", "second-layer"])
def test_a_fallback_failing_partway_after_end_step_still_fences_what_it_zeroed(
    setup,  # noqa: F811
    monkeypatch,
    caplog,
    partway,
):
    # end_step's first launch fails; its fallback zeroes on the reference path
    # and raises partway: after one tail of the first layer, or on the second
    # layer. The event the next start_load_kv's fence waits on is recorded
    # behind what was zeroed and becomes the rank's (on CPU no event exists:
    # a stand-in stands for it), and nothing is left for a later step.
    from kvtail_connector.core.parts.read_tails import per_layer as read_worker

    s = setup
    by_layer = s.worker._reads._per_layer._by_layer
    s.worker.reads_started(landed=False)
    before = _land_all(s)
    _inject_once(monkeypatch, by_layer, "zero")
    real = read_worker.reference_zero_kv_blocks
    applied: list[tuple[Any, Any]] = []  # what the reference path zeroed

    def fails_partway(caches: Any, tails: Any = (), **kw: Any) -> None:
        if partway == "first-layer" or applied:
            tails = list(tails)[:1] if partway == "first-layer" else []
            if tails:
                real(caches, tails=tails, **kw)
                applied.append((caches, tails))
            raise Injected("injected")
        real(caches, tails=tails, **kw)
        applied.append((caches, list(tails)))

    monkeypatch.setattr(read_worker, "reference_zero_kv_blocks", fails_partway)

    def zeroed_so_far() -> torch.Tensor:
        expected = before.clone()
        for caches, tails in applied:
            reference_zero_kv_blocks(rebase(list(caches), expected), (), tails)
        return expected

    event = object()  # the CUDA event record_done would record
    recorded: list[bool] = []

    def record_done() -> None:
        recorded.append(bool(applied) and torch.equal(s.caches.raw[0], zeroed_so_far()))

    monkeypatch.setattr(by_layer.zeroer, "record_done", record_done)
    monkeypatch.setattr(
        type(by_layer), "last_launch_done", property(lambda _: event if recorded else None)
    )
    try:
        s.worker.end_step()
    except Exception as exc:
        _guard(s.worker).failed(exc, "clear_connector_metadata", (), s.worker.contain_end_step)
    assert recorded == [True]
    assert s.worker._rank.last_zeroing is event
    assert len(applied) == 1  # one layer (all or one of its tails), then the failure
    assert torch.equal(s.caches.raw[0], zeroed_so_far())
    assert not torch.equal(s.caches.raw[0], before)
    assert s.worker.num_tracked == 0
    assert "may be left stale (after the forward)" in caplog.text


def test_a_layer_whose_read_tail_launch_fails_is_zeroed_on_the_reference_path(
    setup,  # noqa: F811
    monkeypatch,
):
    s = setup
    s.worker.reads_started(landed=False)
    before = _land_all(s)
    _inject_once(monkeypatch, s.worker._reads._per_layer._by_layer, "zero")
    _layer_loaded_contained(s.worker, READ_LAYERS[0])
    assert s.stats.data["internal_errors"] == 1
    # Exactly the failed layer's tails zeroed, before its attention; the other
    # layers still wait for their own READs.
    assert torch.equal(s.caches.raw[0], _expected(s, [READ_LAYERS[0]], before))
    for name in READ_LAYERS[1:]:
        s.worker.layer_loaded(name)
    s.worker.end_step()
    assert torch.equal(s.caches.raw[0], _expected(s, list(READ_LAYERS), before))
    assert s.worker.num_tracked == 0
    assert s.stats.data["tail_bytes_zeroed"] == _tail_bytes(s)  # each layer once


def test_a_failure_after_a_layers_launch_neither_zeroes_nor_counts_it_again(
    setup,  # noqa: F811
    monkeypatch,
):
    s = setup
    reads = s.worker._reads._per_layer
    s.worker.reads_started(landed=False)
    before = _land_all(s)
    for name in READ_LAYERS[:-1]:
        s.worker.layer_loaded(name)
    # The last layer's launch returns, then its flush (counts, events) fails.
    _inject_once(monkeypatch, reads, "_flush_layers")
    zeroed_apart = []
    monkeypatch.setattr(reads._by_layer, "zeroed_apart", lambda: zeroed_apart.append(1))
    _layer_loaded_contained(s.worker, READ_LAYERS[-1])
    assert s.stats.data["internal_errors"] == 1
    assert not zeroed_apart  # nothing went the reference path: it was launched
    s.worker.end_step()
    assert torch.equal(s.caches.raw[0], _expected(s, list(READ_LAYERS), before))
    assert s.stats.data["tail_bytes_zeroed"] == _tail_bytes(s)
    assert s.worker.num_tracked == 0


def test_the_facade_runs_the_layer_fallback(setup, monkeypatch):  # noqa: F811
    from types import SimpleNamespace

    from kvtail_connector.facade.connector import KVTailConnector

    s = setup
    # The facade's wait_for_layer_load around this worker (its other parts unused).
    facade = KVTailConnector.__new__(KVTailConnector)
    facade._inner = SimpleNamespace(wait_for_layer_load=lambda name: None)
    facade._worker = s.worker
    facade._sync_read = True
    facade._guard = _guard(s.worker)
    s.worker.reads_started(landed=False)
    before = _land_all(s)
    _inject_once(monkeypatch, s.worker._reads._per_layer._by_layer, "zero")
    facade.wait_for_layer_load(READ_LAYERS[0])
    assert s.stats.data["internal_errors"] == 1
    assert torch.equal(s.caches.raw[0], _expected(s, [READ_LAYERS[0]], before))


def test_a_failed_bind_keeps_the_steps_read_loads(monkeypatch):
    # One async load and one READ in the same step; bind fails on the async one.
    kv = make_kv_cache_config(block_size=16, num_blocks=8)
    caches = allocate(kv)
    worker = make_tail_worker(kv)
    worker.register_kv_caches(caches.views, kv, caches.layers)
    meta = KVTailMetadata(
        inner=None,  # type: ignore[arg-type]
        loads=(LoadRecord("async", 0, 37, (GroupLoad(0, 0, (5, 2, 7)),)),),
        read_loads=(LoadRecord("read", 0, 21, (GroupLoad(0, 0, (3, 4)),)),),
    )
    _inject_once(monkeypatch, worker._tails, "bind")
    try:
        worker.bind(meta)
    except Exception as exc:
        _guard(worker).failed(exc, "bind_connector_metadata", (), lambda: worker.contain_bind(meta))
    views = list(caches.views.values())
    for view in views:
        view[4] = 1.0  # the READ lands: the producer's whole block 4, tail included
    _reads_started_contained(worker, landed=True)
    for view in views:
        assert bool((view[4, :, :5] == 1.0).all()) and not view[4, :, 5:].any()
    assert worker._rank.stats.data["internal_errors"] == 1
    assert worker._rank.stats.data["tails_zeroed"] == 1


# ------------------------------------------------ 2. completions held back


def test_a_failing_digest_comparison_still_reports_the_load(sent, monkeypatch):  # noqa: F811
    def boom(self: Any, check: Any) -> str:
        raise Injected("injected into RankDigests._compare")

    monkeypatch.setattr(kv_digests_mod.RankDigests, "_compare", boom)
    # The digest on the host 2 passes after the load.
    d, _, waiting = load_with_a_late_digest(sent, monkeypatch, after=2, steps=4)
    # Released (reported failed) in the pass whose comparison raised, then
    # recomputed by vLLM (kv_load_failure_policy: recompute). Before: held forever.
    assert waiting == [True, True, True, False]
    d.finish()
    assert d.stats["internal_errors"] == 1 and d.stats["failed_loads"] == 1
    assert d.stats["digests_verified"] == 0


class _Event:
    """A CUDA event stand-in: fires when the test says so."""

    done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        pass


def test_a_completion_released_by_the_hold_in_a_failed_pass_is_reported(monkeypatch):
    event = _Event()
    monkeypatch.setattr(KVZeroer, "last_launch_done", property(lambda self: event))
    kv = make_kv_cache_config(block_size=16, num_blocks=8)
    caches = allocate(kv)
    worker = make_tail_worker(kv, holds_completions=True)
    worker.register_kv_caches(caches.views, kv, caches.layers)
    loads = (
        LoadRecord("a", 0, 37, (GroupLoad(0, 0, (5, 2, 7)),)),
        LoadRecord("b", 0, 21, (GroupLoad(0, 0, (3, 4)),)),
    )
    worker.bind(KVTailMetadata(inner=None, loads=loads))  # type: ignore[arg-type]
    hold_zeroed = worker._tails.hold
    passes = []

    def release_then_fail(*args: Any) -> Any:
        out = hold_zeroed(*args)
        passes.append(out.finished_recving)
        if len(passes) == 2:
            raise Injected("after the hold released")
        return out

    monkeypatch.setattr(worker._tails, "hold", release_then_fail)

    def transfer_results(finished: set[str]) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults(finished_recving=finished, failed_recving=set())
        try:
            return worker.transfer_results(results, set(), ErrorSource())
        except Exception as exc:
            out = _guard(worker).failed(
                exc,
                "get_transfer_results",
                (),
                lambda: worker.contain_transfer_results(results, set()),
            )
            assert out is not None
            return out

    assert transfer_results({"a"}).finished_recving == set()  # held: not executed yet
    event.done = True
    out = transfer_results({"b"})  # a (and b) released by the hold, then the pass fails
    assert passes[1] == {"a", "b"}
    assert out.finished_recving == {"a", "b"} and out.failed_recving == {"a", "b"}
    assert worker.num_tracked == 0
    assert worker._rank.stats.data["internal_errors"] == 1


# ------------------------------------------------ 4. counters


def test_a_failed_zeroing_launch_counts_nothing(monkeypatch):
    h = Harness("always")
    _inject_once(monkeypatch, h.worker._worker._rank.zeroer, "zero")  # CPU caches: torch
    _load(h, "r1")
    h.step()  # the launch raises: r1 reported failed
    _assert_recomputed(h, "r1")
    _assert_clean_load_zeroed(h, "r2")
    h.finish()
    view = h.caches.views[LAYERS[0]]
    assert h.stats["internal_errors"] == 1 and h.stats["failed_loads"] == 1
    assert h.stats["tails_zeroed"] == 1  # r2 only
    assert h.stats["tail_bytes_zeroed"] == 10 * len(LAYERS) * _slot_bytes(view)


# ------------------------------------------------ 5. failed loads counted


@pytest.mark.parametrize(
    "method", ["_extra._reader.read", "_records.written", "_records.from_written"]
)
def test_an_alloc_failure_still_counts_the_failed_load(method, monkeypatch):
    # _extra._reader.read: read_entry fails, the scheduler's update never runs;
    # _records.written: the allocation fails (contain_alloc);
    # _records.from_written: the load's record (built with the step's
    # metadata) fails once the load is in flight.
    h = Harness("always")
    owner, _, name = method.rpartition(".")
    _inject_once(monkeypatch, operator.attrgetter(owner)(h.scheduler.connector._scheduler), name)
    # With a (foreign) kvtail entry: a request without one is not read at all.
    h.add("r1", 100, double_load_tokens=70, double_finish_after_steps=2, kvtail={"v": 0})
    h.step()
    h.land("r1", 0, 0, 70)
    h.step()
    _assert_recomputed(h, "r1")
    h.finish()
    assert h.stats["internal_errors"] == 1
    assert h.stats["failed_loads"] == 1


# ------------------------- 5b. records built with the step's metadata


def _two_loads(h: Harness) -> dict[str, list[int]]:
    """Two 70-token async loads of 100-token prompts started in one step, landed."""
    for req_id in ("r1", "r2"):
        h.add(req_id, 100, double_load_tokens=70, double_finish_after_steps=2)
    h.step()
    for req_id in ("r1", "r2"):
        h.land(req_id, 0, 0, 70)
    return {r: list(h.inner_scheduler.blocks_by_req[r][0]) for r in ("r1", "r2")}


@pytest.mark.parametrize("asked_by", ["vllm", "the wrapper"])
def test_loaded_groups_as_a_one_shot_iterator_still_record_the_tail(asked_by, monkeypatch):
    # The groups are read twice (the ids written at the allocation, the record
    # with the metadata): an inner connector answering with an iterator must
    # not leave the record short, whether vLLM asked through the facade or
    # the wrapper asks itself (the answer vLLM got was for another request).
    h = Harness("always")
    facade = h.scheduler.connector
    real = facade.inner.get_loaded_kv_cache_group_ids
    monkeypatch.setattr(facade.inner, "get_loaded_kv_cache_group_ids", lambda r: iter(real(r)))
    if asked_by == "the wrapper":
        monkeypatch.setattr(facade, "get_loaded_kv_cache_group_ids", lambda r: tuple(real(r)))
    else:
        assert facade.get_loaded_kv_cache_group_ids(object()) == (0,)  # a tuple to vLLM too
    h.add("r1", 100, double_load_tokens=70, double_finish_after_steps=2)
    h.step()
    (record,) = h.metas[-1].loads
    ids = h.inner_scheduler.blocks_by_req["r1"][0]
    assert record.groups == (GroupLoad(0, 0, tuple(ids[:5])),)
    h.land("r1", 0, 0, 70)
    h.step()
    assert slot_state(h.caches.views[LAYERS[0]], ids[4]) == ["loaded"] * 6 + ["zero"] * 10
    h.finish()
    assert h.stats["tails_zeroed"] == 1 and h.stats["failed_loads"] == 0


def test_an_error_inside_the_inner_groups_iterable_propagates_when_the_wrapper_asks(
    monkeypatch,
):
    # vLLM's last question was about another request: the wrapper asks the
    # inner connector itself; an error its generator raises while iterated is
    # the inner's (propagated, as without the wrapper), not a contained one.
    h = Harness("always")
    facade = h.scheduler.connector

    def groups(_: Any) -> Any:
        yield 0
        raise _InnerFault("the inner connector's own")

    monkeypatch.setattr(facade.inner, "get_loaded_kv_cache_group_ids", groups)
    monkeypatch.setattr(facade, "get_loaded_kv_cache_group_ids", lambda r: (0,))
    h.add("r1", 100, double_load_tokens=70, double_finish_after_steps=2)
    with pytest.raises(_InnerFault):
        h.step()
    assert h.stats["internal_errors"] == 0


def test_a_failed_metadata_fails_only_the_loads_it_had_records_for(monkeypatch):
    # zero_tails "off": the wrapper records no tail, so a failure while the
    # step's metadata is built has no record to lose; the load completes
    # normally instead of failing (kv_load_failure_policy would end it).
    h = Harness("off")
    from kvtail_connector.core import scheduler as scheduler_module

    real = scheduler_module.KVTailMetadata
    calls = []

    def fails_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "KVTailMetadata", fails_once)
    h.add("r1", 100, double_load_tokens=70, double_finish_after_steps=2)
    h.step()
    assert h.stats["internal_errors"] == 1
    assert list(h.metas[-1].failing) == []
    assert h.scheduler.connector._scheduler._errors.in_flight == {"r1"}
    h.land("r1", 0, 0, 70)
    h.finish()
    assert h.stats["failed_loads"] == 0


class _MembershipOnly:
    """A group-id answer vLLM accepts (it only tests ``in``), not iterable."""

    def __init__(self, ids: Any) -> None:
        self._ids = frozenset(ids)

    def __contains__(self, group: object) -> bool:
        return group in self._ids


def test_a_membership_only_loaded_groups_answer_fails_the_load_contained(monkeypatch):
    h = Harness("always")
    inner = h.scheduler.connector.inner
    real = inner.get_loaded_kv_cache_group_ids
    monkeypatch.setattr(inner, "get_loaded_kv_cache_group_ids", lambda r: _MembershipOnly(real(r)))
    h.add("r1", 100, double_load_tokens=70, double_finish_after_steps=2)
    h.step()  # not raised out of vLLM's schedule()
    assert list(h.metas[-1].failing) == ["r1"]
    h.land("r1", 0, 0, 70)
    h.step()
    _assert_recomputed(h, "r1")
    h.finish()
    assert h.stats["internal_errors"] == 1 and h.stats["failed_loads"] == 1


def test_an_error_inside_the_inner_groups_iterable_is_the_inner_connectors():
    # Raised as the inner's (vLLM, iterating the answer itself, would meet
    # it too); never a half-spent iterator handed on as "no group loaded".
    h = Harness("always")
    facade = h.scheduler.connector

    def groups(_: Any) -> Any:
        yield 0
        raise TypeError("the inner connector's own")

    facade.inner.get_loaded_kv_cache_group_ids = groups
    with pytest.raises(TypeError, match="inner connector's own"):
        facade.get_loaded_kv_cache_group_ids(object())


@pytest.mark.parametrize("order", ["digest first", "plain first"])
def test_a_failed_record_with_a_digest_leaves_the_plain_loads_of_its_step(
    order,
    sent,  # noqa: F811
    monkeypatch,
):
    # A failure in the record of the load with a digest to verify fails
    # that load alone, whichever is allocated first.
    _, params = sent
    d = consumer()
    records = d.scheduler.connector._scheduler._records
    original = records.from_written

    def fail_the_kept(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("keep"):
            raise RuntimeError("injected")
        return original(*args, **kwargs)

    monkeypatch.setattr(records, "from_written", fail_the_kept)
    digest = ("c1", PROMPT, {"double_load_tokens": PROMPT, **routed(params)})
    plain = ("c2", 100, {"double_load_tokens": 70})
    for req_id, tokens, kw in (digest, plain) if order == "digest first" else (plain, digest):
        d.add(req_id, tokens, double_finish_after_steps=2, **kw)
    d.step()
    meta = d.metas[-1]
    assert [r.req_id for r in meta.loads] == ["c2"]
    assert list(meta.failing) == ["c1"]
    ts = d.scheduler.connector._scheduler
    assert set(ts._errors.in_flight) == {"c1", "c2"} and ts._tails.num_tracked == 0
    assert d.stats["internal_errors"] == 1


def test_one_failed_record_fails_its_load_only(monkeypatch):
    h = Harness("always")
    _inject_once(monkeypatch, h.scheduler.connector._scheduler._records, "from_written")
    ids = _two_loads(h)
    meta = h.metas[-1]
    assert [r.req_id for r in meta.loads] == ["r2"]
    assert list(meta.failing) == ["r1"]
    h.step()  # both complete: r2's tail zeroed, r1 reported failed
    assert slot_state(h.caches.views[LAYERS[0]], ids["r2"][4]) == ["loaded"] * 6 + ["zero"] * 10
    _assert_recomputed(h, "r1")
    h.finish()
    assert h.stats["internal_errors"] == 1 and h.stats["failed_loads"] == 1
    assert h.stats["tails_zeroed"] == 1


class _InnerFault(RuntimeError):
    pass


def test_an_inner_error_in_a_record_propagates_and_leaves_the_load_unrecorded(monkeypatch):
    # An error tagged as the inner connector's is re-raised by the guard, as
    # without the wrapper; the load keeps its start for contain_alloc and
    # has no record.
    h = Harness("always")
    ts = h.scheduler.connector._scheduler

    def fault(*args: Any, **kwargs: Any) -> Any:
        error = _InnerFault("the inner connector's own")
        mark_inner(error)
        raise error

    monkeypatch.setattr(ts._records, "from_written", fault)
    h.add("r1", 100, double_load_tokens=70, double_finish_after_steps=2)
    with pytest.raises(_InnerFault):
        h.step()
    assert ts._tails.num_tracked == 0 and ts._starts.get("r1") is not None
    assert h.stats["internal_errors"] == 0
    assert ts.contain_meta(None).failing == ()


# ------------------------------------------------ 6. device errors


def _device_errors() -> list[BaseException]:
    errors: list[BaseException] = [
        RuntimeError("CUDA error: an illegal memory access was encountered")
    ]
    accelerator = getattr(torch, "AcceleratorError", None)
    if accelerator is not None:
        errors.append(accelerator("CUDA error: an illegal memory access was encountered"))
    return errors


class _BrokenEvent:
    """A CUDA event whose context is gone: every call raises ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def query(self) -> bool:
        raise self.error

    def synchronize(self) -> None:
        raise self.error


@pytest.mark.parametrize("error", _device_errors(), ids=lambda e: type(e).__name__)
def test_a_device_error_in_the_fence_is_not_contained(error):
    h = Harness("always")
    h.worker._worker._rank.last_zeroing = _BrokenEvent(error)
    with pytest.raises(type(error)) as caught:
        h.step()  # start_load_kv: the fence queries the event
    assert caught.value is error
    assert h.stats["internal_errors"] == 0


def test_another_error_in_the_fence_is_contained():
    h = Harness("always")
    h.worker._worker._rank.last_zeroing = _BrokenEvent(RuntimeError("not a device error"))
    h.step()
    h.worker.get_kv_connector_stats()
    assert h.stats["internal_errors"] == 1


@pytest.mark.parametrize("error", _device_errors(), ids=lambda e: type(e).__name__)
def test_a_device_error_in_a_fallback_is_not_contained(error):
    # get_transfer_results' fallback waits for the zeroing launched so far.
    kv = make_kv_cache_config(block_size=16, num_blocks=8)
    worker = make_tail_worker(kv)
    caches = allocate(kv)
    worker.register_kv_caches(caches.views, kv, caches.layers)
    worker._rank.last_zeroing = _BrokenEvent(error)
    results = KVConnectorTransferResults(finished_recving={"a"})
    with pytest.raises(type(error)) as caught:
        _guard(worker).failed(
            Injected("ours"),
            "get_transfer_results",
            (),
            lambda: worker.contain_transfer_results(results, set()),
        )
    assert caught.value is error
    assert worker._rank.stats.data["internal_errors"] == 1  # the first failure: ours, counted


def test_device_errors_are_told_from_others():
    from kvtail_connector.core.containment import is_device_error

    for error in _device_errors():
        assert is_device_error(error)
    assert is_device_error(RuntimeError("HIP error: an illegal memory access"))
    assert not is_device_error(RuntimeError("injected"))
    assert not is_device_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert not is_device_error(ValueError("CUDA error: not a RuntimeError"))


def test_a_vouched_load_is_checked_after_a_failed_rebind_of_its_id(monkeypatch):
    # A new load of a reused id fails to bind (contained), then a vouched load
    # completes: it is still taken one by one (its claim counted, its tail not
    # zeroed), never in bulk as an ordinary load.
    kv = make_kv_cache_config(block_size=16, num_blocks=8)
    stats = KVTailStats()
    worker = make_tail_worker(kv, checks_claims=True, trusts_load_claims=True, stats=stats)
    caches = allocate(kv)
    worker.register_kv_caches(caches.views, kv, caches.layers)

    def load(req_id: str, blocks: tuple[int, ...], vouched: bool) -> KVTailMetadata:
        from kvtail_connector.extras.metadata import EntryStep

        record = LoadRecord(req_id, 0, 37, (GroupLoad(0, 0, blocks),))
        step = EntryStep(vouched=frozenset({req_id})) if vouched else None
        return KVTailMetadata(inner=None, loads=(record,), extra=step)  # type: ignore[arg-type]

    worker.bind(load("a", (5, 2, 7), vouched=True))
    again = load("a", (1, 3, 4), vouched=False)
    _inject_once(monkeypatch, worker._rank, "packed_tail")
    try:
        worker.bind(again)
    except Exception as exc:
        _guard(worker).failed(
            exc, "bind_connector_metadata", (), lambda: worker.contain_bind(again)
        )
    worker.bind(load("b", (6, 0, 2), vouched=True))
    results = KVConnectorTransferResults(finished_recving={"b"}, failed_recving=set())
    worker.transfer_results(results, set(), ErrorSource())
    assert stats["vouched_tails"] == 1 and stats["tails_zeroed"] == 0


def test_a_vouched_read_whose_start_failed_leaves_no_claim_for_a_later_read_of_its_id(
    monkeypatch,
):
    # The READ step fails before its tails are taken (contained: zeroed on the
    # reference path). The claim it came with must end with it: a later READ
    # of the same id without a claim gets its tail zeroed, and nothing is kept.
    from kvtail_connector.extras.metadata import EntryStep

    kv = make_kv_cache_config(block_size=16, num_blocks=8)
    caches = allocate(kv)
    worker = make_tail_worker(
        kv,
        zeroes_read_tails=True,
        checks_claims=True,
        trusts_load_claims=True,
        trusts_read_claims=True,
    )
    worker.register_kv_caches(caches.views, kv, caches.layers)
    read = LoadRecord("r", 0, 37, (GroupLoad(0, 0, (5, 2, 7)),))
    claimed = EntryStep(vouched=frozenset({"r"}))
    worker.bind(KVTailMetadata(inner=None, read_loads=(read,), extra=claimed))  # type: ignore[arg-type]
    reads = list(worker.read_loads)
    _inject_once(monkeypatch, worker._reads, "started")
    try:
        worker.reads_started(True)
    except Exception as exc:
        _guard(worker).failed(exc, "start_load_kv", (), lambda: worker.contain_reads(reads, True))
    worker.end_step()
    assert worker.num_tracked == 0

    for raw in caches.raw.values():
        raw.fill_(0x7F)
    worker.bind(KVTailMetadata(inner=None, read_loads=(read,)))  # type: ignore[arg-type]
    worker.reads_started(True)
    worker.end_step()
    stale_slots = [
        state for state in slot_state(caches.views[next(iter(caches.views))], 7)[37 % 16 :]
    ]
    assert stale_slots and set(stale_slots) == {"zero"}
    assert worker.num_tracked == 0
