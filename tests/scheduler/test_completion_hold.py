"""Completions held back until their zeroing has executed (MoRIIO WRITE).

On vLLM's V2 runner the step's output is copied before ``post_forward``, and no
runner syncs in a no-forward step, so the scheduler can see a load finished
while the tail zeroing launched with it is still queued on the device; MoRIIO
WRITE then lets the producer write into a freed and reallocated block straight
from the consumer's scheduler. The worker
keeps such completions out of ``finished_recving`` until the zeroing's event
has fired.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
)

from kvtail_connector.connectors import adapter_for
from kvtail_connector.core.metadata import GroupLoad, KVTailMetadata, LoadRecord
from kvtail_connector.core.parts.consumer_tails import hold as completion_hold
from kvtail_connector.ops import KVZeroer
from tests.helpers.vllm_factories import make_kv_cache_config
from tests.helpers.worker_caches import ErrorSource, allocate, make_tail_worker


class _Event:
    """A CUDA event stand-in: fires when the test says so."""

    def __init__(self) -> None:
        self.done = False
        self.synchronized = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized = self.done = True


def _worker(monkeypatch, event: _Event, hold: bool, zero_failed: bool = False):
    # The CPU zeroer records no event; give it the one the test controls.
    monkeypatch.setattr(KVZeroer, "last_launch_done", property(lambda self: event))
    kv = make_kv_cache_config(block_size=16, num_blocks=8)
    caches = allocate(kv)
    worker = make_tail_worker(kv, holds_completions=hold, zeroes_failed_loads=zero_failed)
    worker.register_kv_caches(caches.views, kv, caches.layers)
    loads = (
        LoadRecord("a", 0, 37, (GroupLoad(0, 0, (5, 2, 7)),)),  # a tail: zeroed
        LoadRecord("b", 0, 32, (GroupLoad(0, 0, (3, 4)),)),  # block-aligned: nothing
    )
    worker.bind(KVTailMetadata(inner=None, loads=loads))  # type: ignore[arg-type]
    return worker


def _pass(worker, finished=(), failed=()):
    results = KVConnectorTransferResults(
        finished_recving=set(finished) | set(failed), failed_recving=set(failed)
    )
    return worker.transfer_results(results, set(), ErrorSource())


def test_a_completion_waits_for_its_zeroing_and_others_pass_at_once(monkeypatch):
    event = _Event()
    worker = _worker(monkeypatch, event, hold=True)
    out = _pass(worker, finished={"a", "b"})
    assert out.finished_recving == {"b"}  # nothing zeroed for b: nothing to wait for
    assert worker.held_requests() == 1
    assert _pass(worker).finished_recving == set()  # still queued on the device
    event.done = True
    assert _pass(worker).finished_recving == {"a"}
    assert worker.num_tracked == 0 and not event.synchronized


def test_a_held_failure_stays_a_failure(monkeypatch):
    event = _Event()
    # "always" on a model vLLM does not zero: failed loads are zeroed too.
    worker = _worker(monkeypatch, event, hold=True, zero_failed=True)
    out = _pass(worker, failed={"a"})
    assert out.finished_recving == set() and out.failed_recving == set()
    event.done = True
    out = _pass(worker)
    assert out.finished_recving == {"a"} and out.failed_recving == {"a"}


def test_a_hold_that_outlives_its_bound_waits_for_the_event(monkeypatch):
    event = _Event()
    worker = _worker(monkeypatch, event, hold=True)
    _pass(worker, finished={"a"})
    for _ in range(completion_hold.MAX_PASSES - 2):
        assert _pass(worker).finished_recving == set()
    assert _pass(worker).finished_recving == {"a"}
    assert event.synchronized


def test_without_the_hold_completions_pass_through(monkeypatch):
    worker = _worker(monkeypatch, _Event(), hold=False)
    assert _pass(worker, finished={"a", "b"}).finished_recving == {"a", "b"}


def test_the_hold_is_on_only_for_writes_past_the_fence():
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector import (
        MoRIIOConnector,
    )

    assert adapter_for(MoRIIOConnector, {"read_mode": "false"}).writes_past_the_fence
    assert not adapter_for(MoRIIOConnector, {"read_mode": "true"}).writes_past_the_fence
    assert not adapter_for(object, {}).writes_past_the_fence
