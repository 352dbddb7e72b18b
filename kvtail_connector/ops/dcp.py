"""Decode-context-parallel (DCP) token placement."""

from __future__ import annotations

from kvtail_connector.ops.integers import as_int


def dcp_local_valid_slots(
    num_tokens: int, dcp_rank: int, dcp_world_size: int, interleave: int
) -> int:
    """Slots of a (DCP-virtual) block that hold valid tokens on one DCP rank.

    vLLM deals token offset ``t`` of a virtual block of ``block_size *
    dcp_world_size`` tokens to rank ``(t // interleave) % dcp_world_size``,
    which stores it at the next local slot. This counts the offsets
    ``t < num_tokens`` that rank owns, i.e. the local slots a load of
    ``num_tokens`` tokens fills. Replicated (not DCP-sharded) caches use
    ``dcp_world_size=1``.

    Every argument is an integral scalar (int, numpy integer, 0-d integer
    tensor); anything else raises ValueError naming it.

    Args:
        num_tokens: valid tokens of the virtual block, ``>= 0``.
        dcp_rank: this rank, ``0 <= dcp_rank < dcp_world_size``.
        dcp_world_size: DCP ranks sharing the block.
        interleave: ``cp_kv_cache_interleave_size``, tokens dealt per turn.
    """
    n = as_int("num_tokens", num_tokens, minimum=0)
    w = as_int("dcp_world_size", dcp_world_size, minimum=1)
    r = as_int("dcp_rank", dcp_rank, minimum=0)
    i = as_int("interleave", interleave, minimum=1)
    if r >= w:
        raise ValueError(f"dcp_rank: must be < dcp_world_size={w}, got {r}")
    turn = w * i
    return (n // turn) * i + min(max(n % turn - r * i, 0), i)
