"""Shared pytest set-up.

Without CUDA, Triton kernels run through the interpreter: it must be switched
on before the kernel module is imported, hence here. Tests never need the
Hugging Face hub (models and configs are built locally); the offline switches
are set before vLLM or huggingface_hub read them, so an accidental lookup fails
at once instead of waiting on the network.
"""

import functools
import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
# A package without kvtail_connector/extras (the core alone, as
# tests/unit/test_without_extras.py runs it): the tests that name the opt-in
# features, or are marked as needing them, are theirs.
HAS_EXTRAS = importlib.util.find_spec("kvtail_connector.extras") is not None


def pytest_ignore_collect(collection_path: Path, config):
    if (
        HAS_EXTRAS
        or collection_path.suffix != ".py"
        or not collection_path.name.startswith("test_")
    ):
        return None
    return _needs_extras(collection_path) or None


_ROOT = Path(__file__).resolve().parent.parent
_TEST_IMPORT = re.compile(r"^\s*from (tests(?:\.\w+)+) import", re.MULTILINE)


@functools.cache
def _needs_extras(path: Path) -> bool:
    """The file names the opt-in features, or imports a test module that does."""
    text = path.read_text()
    if "kvtail_connector.extras" in text:
        return True
    for module in _TEST_IMPORT.findall(text):
        source = _ROOT.joinpath(*module.split(".")).with_suffix(".py")
        if source.name.startswith("test_") and source.exists() and _needs_extras(source):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_extras = pytest.mark.skip(reason="needs kvtail_connector/extras")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "extras" in item.keywords and not HAS_EXTRAS:
            item.add_marker(skip_extras)
