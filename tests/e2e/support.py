"""Helpers of the engine tests: skips for transports that cannot be imported."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from functools import cache

import pytest


@cache
def import_error(module: str) -> str | None:
    """None if ``module`` imports in a fresh interpreter, else the error's last line.

    Checked in a child process: the native libraries (UCX, ibverbs) stay out of
    the pytest process, and a missing shared library shows up as the reason.
    """
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{module.split('.')[0]} is not installed"
    r = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120
    )
    if r.returncode == 0:
        return None
    lines = (r.stderr or r.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {r.returncode}"


def require(module: str) -> None:
    """Skip the test when ``module`` (a transport: ``nixl._api``, ``mooncake.store``)
    cannot be imported, naming the error."""
    err = import_error(module)
    if err is not None:
        pytest.skip(f"cannot import {module}: {err}")


def require_bf16() -> None:
    """Skip the test where vLLM's CPU platform does not run bfloat16 models."""
    import torch
    from vllm.platforms import current_platform

    if torch.bfloat16 not in current_platform.supported_dtypes:
        pytest.skip("vLLM does not run bfloat16 models on this CPU")


def mid_block_hit(block: int, unit: int) -> tuple[int, int]:
    """A prompt length whose store hit ends inside an attention block, and the hit.

    A store hit covers whole ``unit`` s (``cache_hit_alignment_tokens``) and
    never the last prompt token; ``block`` is the attention block the engine
    reports (it follows the Mamba page size, which depends on the CPU: vLLM
    keeps SSM state in bf16 where AVX-512 BF16 or AMX run the GDN kernel).
    The hit spans more than one block, so a full block precedes the tail.
    """
    for length in range(unit + 2, 8 * block):
        hit = (length - 1) // unit * unit
        if hit > block and hit % block:
            return length, hit
    raise AssertionError(f"no store hit ends mid-block for block {block}, unit {unit}")
