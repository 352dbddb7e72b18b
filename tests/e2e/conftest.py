"""Shared fixtures of the engine tests."""

from __future__ import annotations

import importlib.util

import pytest

from demo.tiny_model import ensure_tiny_llama


@pytest.fixture(scope="session")
def model() -> str:
    """The tiny random Llama (float32), built on first use."""
    if importlib.util.find_spec("vllm") is None:  # no engine can start at all
        pytest.skip("vllm is not installed")
    return str(ensure_tiny_llama())
