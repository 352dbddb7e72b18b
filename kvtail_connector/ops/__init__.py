"""KV ops: zeroing and digesting KV slots (Triton launchers, torch paths, references).

One folder per kernel (``zero/``, ``digest/``); beside them what both kernels or the
package outside ``ops`` use: page geometry, the integer rule, ownership maps, DCP slot
placement, pinned staging."""

from kvtail_connector.ops.dcp import dcp_local_valid_slots
from kvtail_connector.ops.digest.launcher import DigestGroup, GroupDigest, GroupSpan, KVDigester
from kvtail_connector.ops.digest.reference import reference_digest
from kvtail_connector.ops.geometry import PageRegion, RegionCache, indexer_cache
from kvtail_connector.ops.zero.functional import zero_kv_blocks
from kvtail_connector.ops.zero.launcher import warmup
from kvtail_connector.ops.zero.reference import reference_zero_kv_blocks
from kvtail_connector.ops.zero.zeroer import KVZeroer

__all__ = [
    "DigestGroup",
    "GroupDigest",
    "GroupSpan",
    "KVDigester",
    "KVZeroer",
    "PageRegion",
    "RegionCache",
    "dcp_local_valid_slots",
    "indexer_cache",
    "reference_digest",
    "reference_zero_kv_blocks",
    "warmup",
    "zero_kv_blocks",
]
