"""A completion pass whose fallback fails too (issue 36, review item 9).

The facade then reports the pass's own completions failed
(``every_completion_failed``) while the worker's holds may still keep one of
them, or may have released others that no answer carried. Every completion
must reach vLLM exactly once: a second report of the same request trips
vLLM's ``_update_from_kv_xfer_finished`` (and at TP > 1 miscounts the ranks'),
a missing one leaves the request waiting for its KV forever. Real vLLM
scheduler and worker connector, the hold on (a transport that writes past the
fence, as MoRIIO WRITE does), faults injected into the wrapper's own code.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvtail_connector.ops import KVZeroer
from tests.helpers.async_double import AsyncLoadDoubleAdapter
from tests.helpers.lifecycle import Harness
from tests.scheduler.test_containment import _assert_recomputed, _inject_once
from tests.scheduler.test_kv_digest import (  # noqa: F401  (sent: a fixture)
    load_with_a_late_digest,
    sent,
)


class _Event:
    """A CUDA event stand-in behind every zeroing: fires when the test says so
    (the CPU zeroer records none)."""

    done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        pass


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> tuple[Harness, _Event]:
    """A wrapper whose worker holds completions until their zeroing executed."""
    event = _Event()
    monkeypatch.setattr(KVZeroer, "last_launch_done", property(lambda self: event))
    monkeypatch.setattr(
        AsyncLoadDoubleAdapter, "writes_past_the_fence", property(lambda self: True)
    )
    h = Harness("always")
    assert h.worker._worker._policy.holds_completions
    return h, event


def _start(h: Harness, req_id: str) -> None:
    """A 70-token async load of a 100-token prompt, landed; it completes in
    the next step's pass."""
    h.add(req_id, 100, double_load_tokens=70, double_finish_after_steps=2)
    h.step()
    h.land(req_id, 0, 0, 70)


def _both_fail_once(patch: pytest.MonkeyPatch, worker: Any) -> None:
    """The next completion pass raises after its holds ran, and so does its
    fallback, while it waits for what the holds keep."""
    _inject_once(patch, worker._errors, "report_failing")
    _inject_once(patch, worker._tails, "drain")


def test_a_held_completion_the_facade_reported_is_not_reported_again(held):
    h, event = held
    worker = h.worker._worker
    _start(h, "r1")
    with pytest.MonkeyPatch.context() as patch:
        _both_fail_once(patch, worker)
        # r1 completes: held (its zeroing has not executed), then the pass and
        # its fallback fail; the facade reports r1 failed.
        h.step()
    assert h.stats["internal_errors"] == 2
    event.done = True
    # Before: the hold released r1 here as a second, successful completion,
    # and vLLM's scheduler asserted on it (the request is running again).
    _assert_recomputed(h, "r1")
    h.finish()
    assert worker.num_tracked == 0
    assert h.stats["failed_loads"] == 1


def test_a_completion_released_in_a_pass_the_facade_answered_is_reported(held):
    h, event = held
    worker = h.worker._worker
    _start(h, "r1")
    h.add("r2", 100, double_load_tokens=70, double_finish_after_steps=2)
    h.step()  # r1 completes and is held; r2's load starts
    h.land("r2", 0, 0, 70)
    assert worker.held_requests() == 2  # r1 held, r2 in flight
    event.done = True
    with pytest.MonkeyPatch.context() as patch:
        _both_fail_once(patch, worker)
        # r2 completes; the hold releases r1 (and r2), then the pass and its
        # fallback fail: the facade reports r2 alone.
        h.step()
    # Before: r1 was never reported, and waited for its KV forever (finish()
    # gave up). Now the next pass reports it failed: both are recomputed.
    h.finish()
    assert worker.num_tracked == 0
    assert h.stats["internal_errors"] == 2 and h.stats["failed_loads"] == 2


def test_two_passes_in_a_row_whose_fallbacks_fail_leave_nothing_behind(held):
    # Pass A and its fallback fail (the facade reports r2 failed); in pass B,
    # where r3 completes, settling pass A fails, and so does the fallback's
    # settling (the facade reports r3 failed). The next pass settles both:
    # nothing is held for r2 or r3, and neither is reported again.
    h, event = held
    worker = h.worker._worker
    h.add("r2", 100, double_load_tokens=70, double_finish_after_steps=2)
    h.add("r3", 100, double_load_tokens=70, double_finish_after_steps=3)
    h.step()  # both loads start
    h.land("r2", 0, 0, 70)
    h.land("r3", 0, 0, 70)
    tails = worker._tails
    real = tails.finished
    calls = []

    def fails_twice(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        _both_fail_once(patch, worker)
        h.step()  # r2 completes: pass A and its fallback fail
        patch.setattr(tails, "finished", fails_twice)
        h.step()  # r3 completes: settling pass A fails, in the fallback too
    event.done = True
    h.finish()
    assert worker.num_tracked == 0
    assert h.stats["failed_loads"] == 2


def test_a_completion_held_for_its_digest_is_not_reported_again(sent, monkeypatch):  # noqa: F811
    # verify_kv: a load's completion is held until its digest reached the host
    # (two passes after it completed, here).
    with pytest.MonkeyPatch.context() as patch:
        worker = []
        build = Harness.__init__

        def faulty(self: Harness, *args: Any, **kwargs: Any) -> None:
            build(self, *args, **kwargs)
            if self.worker._worker._policy.verifies_loads:
                worker.append(self.worker._worker)
                _inject_once(patch, self.worker._worker._errors, "report_failing")
                _inject_once(patch, self.worker._worker._extra, "drop_held")

        patch.setattr(Harness, "__init__", faulty)
        # c1 completes and is held; that pass and its fallback fail, and the
        # facade reports c1 failed. Before: two passes later the digest
        # released c1 as a second completion, and vLLM asserted on it.
        d, _, waiting = load_with_a_late_digest(sent, monkeypatch, after=2, steps=4)
    assert waiting == [True, False, False, False]  # reported (failed) in the pass that failed
    d.finish()
    assert worker[0].num_tracked == 0
    assert d.stats["internal_errors"] == 2 and d.stats["failed_loads"] == 1
    assert d.stats["digests_verified"] == 0
