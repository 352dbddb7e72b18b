"""kvtail-connector: a vLLM KV connector wrapper that zeroes stale block tails.

``import kvtail_connector`` needs only torch; the connector itself (which
needs vLLM) is imported on first access of :class:`KVTailConnector`.
"""

from typing import TYPE_CHECKING, Any

from kvtail_connector._version import __version__
from kvtail_connector.ops import (
    KVZeroer,
    PageRegion,
    RegionCache,
    dcp_local_valid_slots,
    indexer_cache,
    zero_kv_blocks,
)

if TYPE_CHECKING:
    from kvtail_connector.config import KVTailConfig
    from kvtail_connector.facade.connector import KVTailConnector

__all__ = [
    "KVTailConfig",
    "KVTailConnector",
    "KVZeroer",
    "PageRegion",
    "RegionCache",
    "__version__",
    "dcp_local_valid_slots",
    "indexer_cache",
    "zero_kv_blocks",
]


def __getattr__(name: str) -> Any:
    # vLLM resolves the connector with getattr(module, "KVTailConnector");
    # importing it lazily keeps `import kvtail_connector` free of vLLM.
    if name == "KVTailConnector":
        from kvtail_connector.facade.connector import KVTailConnector

        return KVTailConnector
    if name == "KVTailConfig":
        from kvtail_connector.config import KVTailConfig

        return KVTailConfig
    raise AttributeError(f"module 'kvtail_connector' has no attribute {name!r}")
