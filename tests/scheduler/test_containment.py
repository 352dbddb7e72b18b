"""Containment (issue 18, item 2) on the real Scheduler (0.32 and 0.33).

A fault is injected into the wrapper's own code (a TailWorker / TailScheduler
method replaced, in the test, by one that raises). vLLM's step loop must go on,
the affected load must be reported failed (``kv_load_failure_policy:
recompute``: vLLM drops its blocks and computes the prompt itself), the claim
of an affected producer request must not be made, ``internal_errors`` counts
it and one ERROR names the request. An exception of the inner connector must
still propagate unchanged, as without the wrapper.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any

import pytest
import torch

from kvtail_connector.core.containment import call_inner, raised_by_inner
from kvtail_connector.extras import entry
from tests.helpers.lifecycle import Harness, slot_state
from tests.helpers.vllm_factories import run_step, runs_v2_runner

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


class Injected(RuntimeError):
    """The fault the tests inject into the wrapper's own code."""


def _raise(*_args: Any, **_kwargs: Any) -> Any:
    raise Injected("injected into the wrapper")


def _inject_once(patch: pytest.MonkeyPatch, obj: Any, name: str) -> None:
    """``obj.name`` raises at its first call, then works again."""
    original = getattr(obj, name)
    calls = []

    def faulty(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            _raise()
        return original(*args, **kwargs)

    patch.setattr(obj, name, faulty)


def _slot_bytes(view: torch.Tensor) -> int:
    return view.shape[1] * view.shape[3] * view.element_size()


def _errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


def _load(h: Harness, req_id: str) -> list[int]:
    """Start a 70-token async load of a 100-token prompt and land it."""
    h.add(req_id, 100, double_load_tokens=70, double_finish_after_steps=2)
    h.step()
    h.land(req_id, 0, 0, 70)
    return list(h.inner_scheduler.blocks_by_req[req_id][0])


def _assert_recomputed(h: Harness, req_id: str) -> None:
    """vLLM discarded the load: the request's whole prompt is scheduled anew."""
    out = h.step()
    assert out.num_scheduled_tokens.get(req_id) == 100, out.num_scheduled_tokens


def _assert_clean_load_zeroed(h: Harness, req_id: str) -> None:
    """A later load through the same wrapper: tail zeroed, nothing else moved."""
    ids = _load(h, req_id)
    h.step()
    for layer in LAYERS:
        assert slot_state(h.caches.views[layer], ids[4]) == ["loaded"] * 6 + ["zero"] * 10


@pytest.mark.parametrize(
    ("side", "method"),
    [
        ("worker", "_completions.zero_completed"),  # get_transfer_results, at completion
        ("worker", "bind"),  # bind_connector_metadata: the record is lost
        ("scheduler", "_records.from_written"),  # the record, built with the metadata
        ("scheduler", "build_connector_meta"),  # the step's metadata
    ],
)
def test_an_internal_error_fails_the_load_and_the_engine_goes_on(side, method, caplog):
    h = Harness("always")
    part = h.worker._worker if side == "worker" else h.scheduler.connector._scheduler
    owner, _, method = method.rpartition(".")
    with pytest.MonkeyPatch.context() as patch:
        _inject_once(patch, operator.attrgetter(owner)(part) if owner else part, method)
        ids = _load(h, "r1")
        view = h.caches.views[LAYERS[0]]
        h.step()  # the load completes: reported failed, not finished clean
    # The wrapper zeroed nothing for it (and reported it failed, below).
    assert slot_state(view, ids[4]) == ["loaded"] * 6 + ["stale"] * 10
    _assert_recomputed(h, "r1")
    errors = _errors(caplog)
    assert len(errors) == 1 and "r1" in errors[0].getMessage(), [e.getMessage() for e in errors]
    assert errors[0].exc_info is not None  # the traceback, once
    _assert_clean_load_zeroed(h, "r2")
    h.finish()
    assert h.stats["internal_errors"] == 1
    assert h.stats["failed_loads"] == 1
    assert h.stats["tails_zeroed"] == 1  # r2 only
    assert h.stats["tail_bytes_zeroed"] == 10 * len(LAYERS) * _slot_bytes(view)


def test_the_traceback_is_logged_once_per_hook(caplog):
    h = Harness("always")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(h.worker._worker._completions, "zero_completed", _raise)
        _load(h, "r1")
        _load(h, "r2")  # both complete in the same later steps
        h.step()
        h.step()
        h.step()
    errors = _errors(caplog)
    assert len(errors) == 2
    assert [e.exc_info is not None for e in errors] == [True, False]
    h.finish()
    assert h.stats["internal_errors"] == 2 and h.stats["failed_loads"] == 2
    assert h.stats["tails_zeroed"] == 0


def test_a_failing_fallback_is_contained_too(caplog):
    h = Harness("always")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(h.worker._worker._completions, "zero_completed", _raise)
        patch.setattr(h.worker._worker, "contain_transfer_results", _raise)
        _load(h, "r1")
        h.step()
    _assert_recomputed(h, "r1")  # still reported failed (the facade's last resort)
    while h.scheduler.has_requests():
        h.step()
    # (The worker keeps r1's record: a double fault leaves that much behind.)
    h.worker.get_kv_connector_stats()
    h.scheduler.connector.get_kv_connector_stats()
    assert h.stats["internal_errors"] == 2 and h.stats["failed_loads"] == 1


def test_a_producer_hook_failure_makes_no_claim(caplog):
    h = Harness("always", kv_role="kv_producer", vouch_tails="trust")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(h.worker._worker, "produce", _raise)
        h.add("p1", 37, max_tokens=1, do_remote_decode=True)
        out, engine_outputs = run_step(h.scheduler, h.worker)
    params = {
        o.request_id: o.kv_transfer_params for v in engine_outputs.values() for o in v.outputs
    }
    assert params["p1"] is not None and entry.KEY not in params["p1"]
    h.add("p2", 37, max_tokens=1, do_remote_decode=True)
    _, engine_outputs = run_step(h.scheduler, h.worker)
    params = {
        o.request_id: o.kv_transfer_params for v in engine_outputs.values() for o in v.outputs
    }
    assert entry.read(params["p2"]).why == "ok"  # the next request is claimed as usual
    h.finish()
    assert h.stats["internal_errors"] == 1 and h.stats["tails_vouched"] == 1
    # Named after the hook of the runner this engine runs (V1 on 0.32/0.33 here).
    hook = "finish_forward" if runs_v2_runner(h.vllm_config) else "wait_for_save"
    assert any(hook in e.getMessage() for e in _errors(caplog))


def test_a_scheduler_side_failure_at_output_makes_no_claim():
    h = Harness("always", kv_role="kv_producer", vouch_tails="trust")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(h.scheduler.connector._scheduler._extra._claims, "granted", _raise)
        h.add("p1", 37, max_tokens=1, do_remote_decode=True)
        _, engine_outputs = run_step(h.scheduler, h.worker)
    params = {
        o.request_id: o.kv_transfer_params for v in engine_outputs.values() for o in v.outputs
    }
    assert entry.KEY not in params["p1"]
    h.finish()
    assert h.stats["internal_errors"] == 1 and h.stats["tails_vouched"] == 0


# ----------------------------------------------- the inner connector's own


class InnerFault(RuntimeError):
    pass


@pytest.mark.parametrize(
    ("side", "method"),
    [
        ("worker", "get_transfer_results"),  # called by the facade
        ("worker", "get_block_ids_with_load_errors"),  # called from the wrapper's ledger
        # called by vLLM before an allocation (the wrapper keeps its answer)
        ("scheduler", "get_loaded_kv_cache_group_ids"),
        ("scheduler", "update_state_after_alloc"),
        ("scheduler", "build_connector_meta"),
    ],
)
def test_an_inner_connectors_exception_propagates_unchanged(side, method):
    h = Harness("always")
    inner = h.worker.inner if side == "worker" else h.inner_scheduler
    fault = InnerFault("the inner connector's own")
    original = getattr(inner, method)
    calls = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        # Raise once the load is in flight (not during the first schedule).
        calls["n"] += 1
        if side == "scheduler" or calls["n"] > 1:
            raise fault
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(inner, method, flaky)
        with pytest.raises(InnerFault) as caught:
            _load(h, "r1")
            h.step()
            h.step()
    assert caught.value is fault
    assert h.stats["internal_errors"] == 0


def test_call_inner_tags_what_the_inner_connector_raises():
    class Inner:
        def method(self, x: int) -> int:
            if x < 0:
                raise InnerFault("x")
            return x + 1

    inner = Inner()
    assert call_inner(inner.method, 1) == 2
    with pytest.raises(InnerFault) as caught:
        call_inner(inner.method, -1)
    assert raised_by_inner(caught.value)
    # Raised by the inner connector but not called through call_inner: ours.
    with pytest.raises(InnerFault) as direct:
        inner.method(-1)
    assert not raised_by_inner(direct.value)
    with pytest.raises(ZeroDivisionError) as own:
        _ = 1 // 0
    assert not raised_by_inner(own.value)


def test_call_inner_tags_an_exception_type_that_refuses_attributes():
    @dataclasses.dataclass(frozen=True)
    class Frozen(Exception):
        code: int

    def method() -> None:
        raise Frozen(7)

    with pytest.raises(Frozen) as caught:
        call_inner(method)
    assert raised_by_inner(caught.value)


def test_invalid_blocks_reach_vllm_when_attributing_them_fails():
    # The inner connector reports a block of r1's load invalid; the wrapper's
    # attribution fails: vLLM must still get the id (and so fail the load).
    h = Harness("always")
    with pytest.MonkeyPatch.context() as patch:
        h.add("r1", 100, double_load_tokens=70, double_finish_after_steps=2)
        h.step()
        ids = h.inner_scheduler.blocks_by_req["r1"][0]
        h.worker.inner.report_invalid_blocks("r1", {ids[1]})
        patch.setattr(h.worker._worker._errors._ledger, "_attribute", _raise)
        out = run_step(h.scheduler, h.worker)[0]
        del out
    _assert_recomputed(h, "r1")
    while h.scheduler.has_requests():
        h.step()
    h.scheduler.connector.get_kv_connector_stats()
    h.worker.get_kv_connector_stats()
    assert h.stats["failed_loads"] == 1 and h.stats["internal_errors"] >= 1


def test_the_ledger_keeps_fetched_ids_for_the_runner_when_attributing_fails():
    from kvtail_connector.core.parts.load_errors.ledger import LoadErrorLedger

    class Inner:
        def __init__(self) -> None:
            self.ids: set[int] = set()

        def get_block_ids_with_load_errors(self) -> set[int]:
            out, self.ids = self.ids, set()
            return out

    inner = Inner()
    ledger = LoadErrorLedger(lambda: [("a", {1, 2})])
    inner.ids = {2, 9}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ledger, "_attribute", _raise)
        with pytest.raises(Injected):
            ledger.take(inner)
    assert ledger.drain() == {2, 9}  # what the facade's fallback hands to vLLM
    assert ledger.drain() == set()
