"""Loggers that live under vLLM's ``vllm`` logger.

vLLM configures only the ``vllm`` logger (handler, level from
``VLLM_LOGGING_LEVEL``, format) and does not propagate it; a plugin's own
module names would land on the unconfigured root logger and lose INFO lines.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

PARENT = "vllm.kvtail"


def get_logger(module_name: str) -> Any:
    from vllm.logger import init_logger

    return init_logger(f"{PARENT}.{module_name.rsplit('.', 1)[-1]}")


def request_names(req_ids: Iterable[str]) -> str:
    """Request ids for a log line, once each, in a stable order."""
    return ", ".join(sorted(set(req_ids)))
