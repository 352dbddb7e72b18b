"""KV ops: zeroing and digesting KV slots (Triton launchers, torch paths, references).

The zeroing kernel (``zero/``; the digest kernels of the opt-in verification are in
``kvtail_connector/extras/ops``); beside it what every kernel or the package outside
``ops`` uses: page geometry, the integer rule, ownership maps, DCP slot placement,
pinned staging."""

from kvtail_connector.ops.dcp import dcp_local_valid_slots
from kvtail_connector.ops.geometry import PageRegion, RegionCache, indexer_cache
from kvtail_connector.ops.zero.functional import zero_kv_blocks
from kvtail_connector.ops.zero.launcher import warmup
from kvtail_connector.ops.zero.reference import reference_zero_kv_blocks
from kvtail_connector.ops.zero.zeroer import KVZeroer

__all__ = [
    "KVZeroer",
    "PageRegion",
    "RegionCache",
    "dcp_local_valid_slots",
    "indexer_cache",
    "reference_zero_kv_blocks",
    "warmup",
    "zero_kv_blocks",
]
