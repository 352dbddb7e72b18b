"""``benchmarks/without_vllm.py``'s stand-ins against the vLLM objects they replace.

The GPU benchmarks import the worker side through those stand-ins where vLLM
is not installed; each must keep the shape of the vLLM object it replaces
(dataclass fields and their defaults, abstract and public methods and their
signatures), and the logger its methods, so a benchmark never measures code
shaped for an older vLLM.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import logging
import sys
import typing
from abc import ABC
from pathlib import Path
from typing import Any

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "without_vllm.py"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("without_vllm", PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["without_vllm"] = module  # dataclasses resolve annotations through it
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["without_vllm"]
    return module


without_vllm = _load()


def _signature(fn: Any) -> list[tuple[str, Any, Any]]:
    # Annotations left out: vLLM's are partly strings, partly its own types.
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _public_methods(obj: Any) -> dict[str, list[tuple[str, Any, Any]]]:
    names = (n for n in dir(obj) if not n.startswith("_"))
    return {n: _signature(getattr(obj, n)) for n in names if callable(getattr(obj, n))}


def _shape(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, type):
        return {"signature": _signature(obj)}
    fields = None
    if dataclasses.is_dataclass(obj):
        # The stand-ins' module is not in sys.modules, where typing looks.
        ours = vars(without_vllm) if obj.__module__ == without_vllm.__name__ else None
        hints = typing.get_type_hints(obj, globalns=ours)
        fields = [
            (f.name, hints[f.name], f.default, f.default_factory) for f in dataclasses.fields(obj)
        ]
    return {
        "abc": issubclass(obj, ABC),
        "abstract": sorted(getattr(obj, "__abstractmethods__", ())),
        "fields": fields,
        "methods": _public_methods(obj),
    }


@pytest.mark.parametrize(
    ("module", "stand_in"),
    [(m, obj) for m, objects in without_vllm.STAND_INS.items() for obj in objects],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_each_stand_in_has_the_shape_of_the_vllm_object(module: str, stand_in: Any) -> None:
    real = getattr(importlib.import_module(module), stand_in.__name__)
    assert _shape(stand_in) == _shape(real)


def test_the_stand_in_logger_behaves_as_vllms(caplog: pytest.LogCaptureFixture) -> None:
    from vllm.logger import init_logger

    # Distinct names: both patch the methods onto logging's one logger per name.
    real = init_logger("kvtail_stand_in_test.real")
    ours = without_vllm.init_logger("kvtail_stand_in_test.ours")
    assert _public_methods(ours) == _public_methods(real)
    for logger in (real, ours):
        with caplog.at_level(logging.DEBUG, logger=logger.name):
            for level in ("debug", "info", "warning", "error"):
                once = getattr(logger, f"{level}_once")
                once("%s once: %s", level, 1)
                once("%s once: %s", level, 1)
                once("%s once: %s", level, 2)
    seen: dict[str, list[tuple[int, str]]] = {real.name: [], ours.name: []}
    for record in caplog.records:
        seen[record.name].append((record.levelno, record.getMessage()))
    assert seen[ours.name] == seen[real.name]
    assert len(seen[ours.name]) == 8  # repeats dropped, other arguments kept


def test_install_if_absent_leaves_an_installed_vllm_alone() -> None:
    import vllm

    assert without_vllm.install_if_absent() is False
    assert sys.modules["vllm"] is vllm and vllm.__file__ is not None
