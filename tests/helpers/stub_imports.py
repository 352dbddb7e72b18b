"""Import vLLM's attention backends on a machine without their GPU libraries.

A backend's ``customize_spec`` and its class attributes are plain Python, but
its module imports FlashInfer, AITER, FlashMLA... at the top. For reading
those class-level facts (never for running a kernel), :func:`import_with_stubs`
imports a module with every missing third-party package replaced by a stub
whose every attribute is a stub class: enough for ``from x import y``, base
classes and decorators at import time. The stubs live only for the call:
``sys.modules`` is restored afterwards, except for the modules that imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

# Never stubbed: a failure to import these is a real failure.
_REAL = ("vllm", "torch", "triton", "numpy", "kvtail_connector", "tests")
# vLLM's compiled extensions of other builds: loading ``vllm/_C.abi3.so`` next
# to the CPU build's ``_C_AVX2`` (which registers the same op namespace)
# aborts the process, so they are stubs, never imported.
_EXTENSIONS = frozenset({"vllm._C", "vllm._rocm_C", "vllm._moe_C", "vllm._flashmla_C"})


class _StubMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator: keep what it decorates
        return _stub_class(cls.__name__)

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    __ror__ = __or__

    def __iter__(cls) -> Any:
        return iter(())

    def __bool__(cls) -> bool:
        return False


def _stub_class(name: str) -> type:
    return _StubMeta(str(name), (), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []  # a package: its submodules are stubs too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _StubFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.stubbed: set[str] = set()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        top = name.partition(".")[0]
        if top in self.stubbed or name in _EXTENSIONS:
            return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)
        return None


def import_with_stubs(module: str, attempts: int = 40) -> types.ModuleType:
    """Import ``module``, stubbing each missing third-party package it needs.

    Raises:
        ImportError: the module still fails (a vLLM-internal import error,
            or more than ``attempts`` missing packages).
    """
    finder = _StubFinder()
    before = set(sys.modules)
    sys.meta_path.insert(0, finder)
    try:
        for _ in range(attempts):
            try:
                return importlib.import_module(module)
            except ModuleNotFoundError as e:
                missing = (e.name or "").partition(".")[0]
                if not missing or missing in _REAL or missing in finder.stubbed:
                    raise
                # Python already dropped the modules that failed half-way.
                finder.stubbed.add(missing)
        raise ImportError(f"{module}: more than {attempts} missing packages")
    finally:
        sys.meta_path.remove(finder)
        for name in set(sys.modules) - before:
            if name.partition(".")[0] in finder.stubbed or name in _EXTENSIONS:
                sys.modules.pop(name, None)
