"""MoRIIO READ exclusion applies to a MoRIIO child of a MultiConnector backend.

The adapter is chosen per child: MultiConnector's metadata holds one entry
per child, in ``connectors`` order, and the READ destinations are read from
the MoRIIO child's own entry. Real vLLM Scheduler, real MultiConnector with
real MoRIIO and NIXL children (scheduler side, as in test_moriio_read).
"""

from __future__ import annotations

import pytest

from kvtail_connector.core.metadata import KVTailMetadata
from kvtail_connector.facade.inner import wrapper_fields
from tests.helpers.vllm_factories import (
    make_request,
    make_scheduler,
    make_vllm_config,
)
from tests.scheduler.moriio.test_moriio_read import (
    LOCAL_BLOCKS,
    OTHER_TOKENS,
    READ_TOKENS,
    REMOTE_BLOCKS,
    _flat,
    _mixed,
    _moriio_extra,
    _peer_params,
)


@pytest.fixture
def scheduler():
    children = [
        {
            "kv_connector": "MoRIIOConnector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": _moriio_extra(read=True),
        },
        {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
    ]
    vllm_config = make_vllm_config(
        **wrapper_fields(
            {
                "backend": "MultiConnector",
                "backend_extra_config": {"connectors": children},
            }
        ),
        kv_role="kv_consumer",
    )
    sched = make_scheduler(vllm_config, _mixed())
    yield sched
    sched.shutdown()


def test_read_destinations_of_a_moriio_child_are_kept_from_zeroing(scheduler):
    built = []
    build = scheduler._get_new_block_ids_to_zero
    scheduler._get_new_block_ids_to_zero = lambda: built.append(build()) or built[-1]
    remote = [list(range(1000, 1000 + REMOTE_BLOCKS)), list(range(2000, 2000 + REMOTE_BLOCKS))]
    for req_id, tokens, params in (
        ("read", READ_TOKENS, _peer_params(remote, req_id="read")),
        ("other", OTHER_TOKENS, None),
    ):
        scheduler.add_request(
            make_request(
                req_id, tokens, block_size=scheduler.hash_block_size, kv_transfer_params=params
            )
        )
    out = scheduler.schedule()
    alloc = {
        r: [list(g) for g in scheduler.kv_cache_manager.get_block_ids(r)] for r in ("read", "other")
    }
    assert [len(g) for g in alloc["read"]] == [LOCAL_BLOCKS, LOCAL_BLOCKS]
    meta = out.kv_connector_metadata
    assert isinstance(meta, KVTailMetadata)
    moriio_meta, nixl_meta = meta.inner.metadata  # one entry per child, in order
    assert list(moriio_meta.reqs_to_recv) == ["read"]
    (before,) = built
    assert sorted(before) == sorted(_flat(alloc["read"]) + _flat(alloc["other"]))
    dests = {b for g in alloc["read"] for b in g[:REMOTE_BLOCKS]}
    assert out.new_block_ids_to_zero == [b for b in before if b not in dests]
