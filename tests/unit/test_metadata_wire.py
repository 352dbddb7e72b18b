"""What crosses to a worker process: records pickled as a multi-process
executor sends them (block ids as one int64 buffer), read back equal."""

from __future__ import annotations

import pickle
from array import array

import numpy as np
import pytest

from kvtail_connector.core.metadata import (
    NULL_BLOCK,
    GroupLoad,
    KVTailMetadata,
    LoadRecord,
)


def _roundtrip(obj):
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


@pytest.mark.parametrize(
    "ids",
    [(), (7,), (0, NULL_BLOCK, 3), tuple(range(1000, 1513)), (2**62, NULL_BLOCK)],
    ids=["empty", "one", "null", "512", "large"],
)
def test_block_ids_cross_as_one_int64_array_with_the_same_values(ids):
    load = GroupLoad(2, 5, ids)
    got = _roundtrip(load)
    assert type(got.block_ids) is array and got.block_ids.typecode == "q"
    assert (got.group, got.first_block, tuple(got.block_ids)) == (2, 5, ids)
    # What the worker does with them: index, slice, iterate, numpy.
    if ids:
        assert got.block_ids[-1] == ids[-1] and tuple(got.block_ids[1:]) == ids[1:]
    assert np.array(got.block_ids, dtype=np.int64).tolist() == list(ids)
    # A second trip (an array already) keeps them.
    assert tuple(_roundtrip(got).block_ids) == ids


def test_a_copied_record_keeps_its_block_ids():
    import copy

    load = GroupLoad(0, 1, (3, 4))
    record = LoadRecord("r", 0, 20, (load,))
    for got in (copy.copy(load), copy.deepcopy(load), copy.deepcopy(record).groups[0]):
        assert tuple(got.block_ids) == (3, 4) and len(got.block_ids) == 2


def test_a_whole_metadata_reads_back_field_for_field():
    from kvtail_connector.extras.metadata import CheckedLoad, EntryStep, LoadCheck

    records = tuple(
        LoadRecord(
            f"r{i}",
            i,
            100 + i,
            (GroupLoad(0, 0, tuple(range(i, i + 7))), GroupLoad(1, 2, (NULL_BLOCK, i))),
        )
        for i in range(5)
    )
    prompts = tuple(
        CheckedLoad(*r, states=(GroupLoad(3, 6, (40 + i,)),)) for i, r in enumerate(records)
    )
    step = EntryStep(
        producer_tails=records[:2],
        producer_digests=prompts[2:],
        vouched=frozenset({"r1", "r3"}),
        checks={"r4": LoadCheck(None, (GroupLoad(3, 6, (44,)),))},  # type: ignore[arg-type]
    )
    meta = KVTailMetadata(inner=None, loads=records, extra=step)  # type: ignore[arg-type]
    got = _roundtrip(meta)

    def plain(r):
        return (
            r.req_id,
            r.num_local,
            r.num_loaded,
            tuple((g.group, g.first_block, tuple(g.block_ids)) for g in r.groups),
        )

    def states(loads):
        return tuple((g.group, g.first_block, tuple(g.block_ids)) for g in loads)

    assert [plain(r) for r in got.loads] == [plain(r) for r in records]
    assert [plain(r) for r in got.extra.producer_tails] == [plain(r) for r in records[:2]]
    assert [(plain(p), states(p.states)) for p in got.extra.producer_digests] == [
        (plain(p), states(p.states)) for p in prompts[2:]
    ]
    assert got.extra.vouched == step.vouched
    assert states(got.extra.checks["r4"].states) == ((3, 6, (44,)),)
