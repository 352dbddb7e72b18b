"""Shared pytest set-up.

Without CUDA, Triton kernels run through the interpreter: it must be switched
on before the kernel module is imported, hence here. Tests never need the
Hugging Face hub (models and configs are built locally); the offline switches
are set before vLLM or huggingface_hub read them, so an accidental lookup fails
at once instead of waiting on the network.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
