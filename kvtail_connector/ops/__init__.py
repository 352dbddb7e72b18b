"""KV zeroing ops: the Triton kernel's launcher, the torch path and the reference."""

from kvtail_connector.ops.dcp import dcp_local_valid_slots
from kvtail_connector.ops.functional import zero_kv_blocks
from kvtail_connector.ops.geometry import PageRegion, RegionCache, indexer_cache
from kvtail_connector.ops.launcher import warmup
from kvtail_connector.ops.reference import reference_zero_kv_blocks
from kvtail_connector.ops.zeroer import KVZeroer

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
