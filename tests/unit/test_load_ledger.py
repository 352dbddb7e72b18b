"""The scheduler's ledger of loads in flight against vLLM's reported
invalid blocks, where a load spans a sliding window's gap (vLLM's null
block): the gap never fails a load, a real block of it does."""

from __future__ import annotations

from types import SimpleNamespace

from kvtail_connector import _compat
from kvtail_connector.core.kvgroups import GroupInfo
from kvtail_connector.core.metadata import NULL_BLOCK
from kvtail_connector.core.parts.load_errors.scheduler import LoadErrorsScheduler
from kvtail_connector.core.parts.records import LoadRecords
from kvtail_connector.core.stats import KVTailStats


def _blocks(*ids: int) -> SimpleNamespace:
    """vLLM's ``KVCacheBlocks`` of one group, as far as the reader goes."""
    return SimpleNamespace(blocks=([SimpleNamespace(block_id=i) for i in ids],))


def _output(invalid: set[int]) -> SimpleNamespace:
    return SimpleNamespace(failed_recving=set(), invalid_block_ids=invalid, finished_recving=set())


def test_a_window_gap_never_fails_a_load_a_real_block_of_it_does():
    records = LoadRecords(None, (GroupInfo(0, True, 16, 1),), records_every_load=False)
    null = _compat.NULL_BLOCK_ID
    # Tokens [16, 60): blocks 1..3 of the request, the first a window's gap.
    written = records.written(_blocks(5, null, 7, 9), (0,), 16, 60)
    assert written == ((NULL_BLOCK, 7, 9),)
    record = records.from_written("r", written, 16, 60, (0,))
    assert record is not None and record.groups[0].block_ids == (NULL_BLOCK, 7, 9)
    stats = KVTailStats()
    errors = LoadErrorsScheduler(stats)
    errors.started("r", written)
    errors.settle(_output({null}))
    errors.settle(_output({5}))  # the request's block before the load: not the load's
    assert stats["failed_loads"] == 0
    errors.settle(_output({9}))
    assert stats["failed_loads"] == 1
