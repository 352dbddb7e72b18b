"""The wrapper runs MoRIIO in the mode MoRIIO itself runs (issue 36, review item 9).

MoRIIO decides READ or WRITE with vLLM's ``get_moriio_mode``, which lowers
and strips ``read_mode``. A copy of that parsing without the strip took
``"read_mode": "true "`` for WRITE while MoRIIO ran READ: no READ record and
no READ exclusion, silently (stale tails and the READ race back). The adapter
now asks ``get_moriio_mode`` itself.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
    MoRIIOMode,
    get_moriio_mode,
)

from kvtail_connector.connectors.moriio import MoRIIOAdapter
from tests.scheduler.moriio import test_moriio_read
from tests.scheduler.moriio.test_moriio_read import (  # noqa: F401  (make_run: a fixture)
    REMOTE_BLOCKS,
    _mixed,
    _read_step,
    make_run,
)

# read_mode values as a user may write them: MoRIIO's own answer decides.
VALUES: list[Any] = [
    "true",
    "true ",
    " TRUE",
    "True\n",
    "1",
    " 1 ",
    "false",
    "false ",
    "0",
    "",
    "yes",
    True,
    1,
    False,
    None,
]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_the_adapter_reads_read_mode_as_moriio_does(value: Any) -> None:
    extra = {"read_mode": value}
    moriio = KVTransferConfig(
        kv_connector="MoRIIOConnector", kv_role="kv_consumer", kv_connector_extra_config=extra
    )
    reads = get_moriio_mode(moriio) == MoRIIOMode.READ
    adapter = MoRIIOAdapter(dict(extra))
    assert adapter.sync_read is reads
    assert adapter.writes_past_the_fence is not reads


@pytest.mark.parametrize("value", ["true ", " True", "1\t"], ids=repr)
def test_a_padded_read_mode_keeps_read_destinations_from_zeroing(
    make_run: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    value: str,
) -> None:
    extra = test_moriio_read._moriio_extra(read=True) | {"read_mode": value}
    monkeypatch.setattr(test_moriio_read, "_moriio_extra", lambda read: extra)
    run = make_run(wrapped=True, kv_cache_config=_mixed())
    # MoRIIO inside the wrapper runs READ (its own decision)...
    assert run.scheduler.connector.inner.connector_scheduler.mode == MoRIIOMode.READ
    out, alloc = _read_step(run)  # ...and READs this request's first blocks.
    # ...so the wrapper keeps the READ destinations out of vLLM's zeroing.
    # Before: every one of them stayed in the list (the READ race).
    dests = {b for g in alloc["read"] for b in g[:REMOTE_BLOCKS]}
    assert not set(out.new_block_ids_to_zero) & dests
    assert run.lookups == 1
