"""A contained scheduler-side failure around a MoRIIO READ (issue 18, review
of item 2), on a real vLLM Scheduler.

A READ is synchronous: it never appears in ``finished_recving`` and cannot be
reported failed. Whatever the wrapper's scheduler side fails on, its tail must
still be zeroed: by the workers (a READ record is shipped), or by vLLM (the
READ's destinations stay in vLLM's zero list, as without the wrapper). The
reference is the same step through a wrapper that does not fail.
"""

from __future__ import annotations

import operator
from typing import Any

import pytest

from tests.scheduler.moriio.test_moriio_read import (  # noqa: F401  (make_run: a fixture)
    BLOCK,
    LOCAL_BLOCKS,
    _mixed,
    _peer_params,
    make_run,
)

TOKENS = 100  # tail: token 99, slot 3 of block 6 in each group


class Injected(RuntimeError):
    pass


def _raise(*_args: Any, **_kwargs: Any) -> Any:
    raise Injected("injected into the wrapper")


def _once(original: Any) -> Any:
    """``original``, raising at its first call only."""
    calls = []

    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise Injected("injected into the wrapper, once")
        return original(*args, **kwargs)

    return call


def _read_step(factory: Any, fault: str | None) -> tuple[Any, Any, set[int]]:
    """One READ scheduled, ``TailScheduler.<fault>`` raising (``<fault>!once``:
    at its first call only): (run, the step's output, the READ's tail blocks)."""
    run = factory(wrapped=True, kv_cache_config=_mixed())
    ts = run.scheduler.connector._scheduler
    if fault is not None:
        fault, once, _ = fault.partition("!once")
        owner, _, name = fault.rpartition(".")
        obj = operator.attrgetter(owner)(ts) if owner else ts
        setattr(obj, name, _once(getattr(obj, name)) if once else _raise)
    remote = [list(range(1000, 1000 + LOCAL_BLOCKS)), list(range(2000, 2000 + LOCAL_BLOCKS))]
    # A (foreign) kvtail entry: the reader reads it (a request without one
    # is not read at all), and declines it.
    run.add("read", TOKENS, {**_peer_params(remote, req_id="read"), "kvtail": {"v": 0}})
    out = run.scheduler.schedule()  # contained: does not raise
    alloc = run.blocks("read")
    return run, out, {alloc[gid][(TOKENS - 1) // BLOCK] for gid in (0, 1)}


def _internal_errors(run: Any) -> int:
    return int(run.scheduler.connector._stats.data["internal_errors"])


def test_a_failed_metadata_build_leaves_vllms_zero_list_untouched(make_run):  # noqa: F811
    run, out, tails = _read_step(make_run, "_reads._read_records")
    assert _internal_errors(run) == 1
    (built,) = run.built
    # No READ record shipped, and vLLM zeroes the READ's blocks, tails
    # included, exactly as without the wrapper (the list it built, unchanged).
    assert out.kv_connector_metadata.read_loads == ()
    assert out.new_block_ids_to_zero == built
    assert tails <= set(out.new_block_ids_to_zero)


# _reads.allocated: the READ part itself fails once, after the entry was read
# (contain_alloc's own call to it succeeds).
@pytest.mark.parametrize(
    "fault", ["_extra._reader.read", "update_state_after_alloc", "_reads.allocated!once"]
)
def test_a_failed_alloc_still_ships_the_read_record(make_run, fault):  # noqa: F811
    ref_run, ref, ref_tails = _read_step(make_run, None)
    run, out, tails = _read_step(make_run, fault)
    assert _internal_errors(run) == 1 and _internal_errors(ref_run) == 0
    meta, ref_meta = out.kv_connector_metadata, ref.kv_connector_metadata
    # Not "failing" (a READ never completes in finished_recving): its tail is
    # zeroed by the workers from the same record a healthy wrapper ships.
    assert "read" not in meta.failing
    (record,) = meta.read_loads
    (expected,) = ref_meta.read_loads
    assert record == expected and meta.extra is None
    assert tails == ref_tails
    assert {g.block_ids[(TOKENS - 1) // BLOCK - g.first_block] for g in record.groups} == tails
    # Its destinations are kept from vLLM's zeroing, as in the healthy step.
    assert out.new_block_ids_to_zero == ref.new_block_ids_to_zero
    assert not tails & set(out.new_block_ids_to_zero or ())
