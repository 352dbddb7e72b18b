"""Stand-ins for the few vLLM names the worker side imports, for a machine without vLLM.

The GPU benchmarks (``bench_worker_gpu.py``) run the worker's per-step paths
where the package's dependencies are installed but vLLM is not. Those paths
run no vLLM code; importing them needs only what ``STAND_INS`` lists: the connector
metadata and stats base classes, the transfer-results record and vLLM's logger
factory. ``install_if_absent()`` builds modules holding those objects at run
time and puts them into ``sys.modules`` under vLLM's module names, and only
when vLLM is not installed: with vLLM present it changes nothing.

No folder named ``vllm`` exists in the tree for this (a tool that follows
imports would take it for vLLM), and the package never falls back to these:
production code imports the real vLLM. ``tests/with_vllm/test_vllm_stand_ins.py``
checks every stand-in against the vLLM object it replaces (dataclass fields,
abstract and public methods, signatures), so they cannot drift;
``tests/unit/test_import_paths.py`` imports the worker side through them with
vLLM blocked, and ``tests/unit/test_bench_worker_cpu.py`` runs the benchmark so.
"""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any


class KVConnectorMetadata(ABC):  # noqa: B024 - vLLM's is an ABC with no methods too
    """Scheduler connector -> worker connector (vLLM's ``v1.base``)."""


class KVConnectorWorkerMetadata(ABC):
    """Worker connector -> scheduler connector, folded across workers (vLLM's ``v1.base``)."""

    @abstractmethod
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Fold another worker's metadata into this one."""


@dataclass
class KVConnectorTransferResults:
    """One worker's transfer completions (vLLM's ``v1.base``)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


@dataclass
class KVConnectorStats:
    """A connector's stats payload (vLLM's ``v1.metrics``); subclasses implement the rest."""

    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def reset(self) -> None:
        raise NotImplementedError

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        raise NotImplementedError

    def reduce(self) -> dict[str, int | float]:
        raise NotImplementedError

    def is_empty(self) -> bool:
        raise NotImplementedError


_LOGGED_ONCE: set[tuple[str, str, str, tuple[Hashable, ...]]] = set()


def _once(logger: logging.Logger, level: str) -> Callable[..., None]:
    log = getattr(logger, level)

    def log_once(msg: str, *args: Hashable, scope: str = "local") -> None:
        # One process: this is the first rank of every scope vLLM knows.
        key = (logger.name, level, msg, args)
        if key not in _LOGGED_ONCE:
            _LOGGED_ONCE.add(key)
            log(msg, *args, stacklevel=2)

    return log_once


def init_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with ``debug_once`` ... ``error_once`` (``vllm.logger``)."""
    logger = logging.getLogger(name)
    for level in ("debug", "info", "warning", "error"):
        setattr(logger, f"{level}_once", _once(logger, level))
    return logger


# vLLM module -> the objects standing in for its names there (each under its
# ``__name__``). The one list to extend when the worker side imports another name.
STAND_INS: dict[str, tuple[Any, ...]] = {
    "vllm.logger": (init_logger,),
    "vllm.distributed.kv_transfer.kv_connector.v1.base": (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
        KVConnectorTransferResults,
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics": (KVConnectorStats,),
}


def _module(name: str, *, package: bool) -> types.ModuleType:
    module = types.ModuleType(name, f"Stand-in from {__file__} (vLLM is not installed).")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        # Empty: a vLLM submodule not stood in for fails to import, naming itself.
        module.__path__ = []
    return module


def install_if_absent() -> bool:
    """Put the stand-ins into ``sys.modules`` if vLLM is not installed.

    Returns whether it did. A vLLM that is installed but fails to import
    raises here (the stand-ins would hide that).
    """
    try:
        import vllm  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name != "vllm":
            raise
    else:
        return False
    packages = {
        name.rsplit(".", depth)[0] for name in STAND_INS for depth in range(1, name.count(".") + 1)
    }
    for name in sorted(packages | STAND_INS.keys(), key=lambda n: n.count(".")):
        sys.modules[name] = _module(name, package=name in packages)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[name])
    for module_name, objects in STAND_INS.items():
        for obj in objects:
            setattr(sys.modules[module_name], obj.__name__, obj)
    return True
