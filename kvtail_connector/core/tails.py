"""Where a load's never-written slots are: pure arithmetic, no vLLM objects.

A load fills tokens ``[0, L)`` of a request. For a KV cache group whose
manager block covers ``eb`` tokens (``block_size * dcp_world_size`` for
DCP-sharded caches), block ``k = L // eb`` holds ``n = L % eb`` valid tokens
and the rest of it is stale. Each DCP rank stores its own share of those
``n`` tokens; caches that store one state per ``tokens_per_state`` tokens
hold only the states whose tokens are all present.
"""

from __future__ import annotations

from fractions import Fraction


def tail_block(num_loaded: int, effective_block: int) -> tuple[int, int] | None:
    """``(block index, valid tokens in it)`` of the partially loaded block, or
    None when the load ends on a block boundary."""
    k, n = divmod(num_loaded, effective_block)
    return (k, n) if n else None


def first_stale_slot(
    num_valid: int,
    *,
    dcp_rank: int,
    dcp_world_size: int,
    interleave: int,
    tokens_per_state: int | Fraction = 1,
) -> int:
    """The first slot of this rank's page(s) that the load left unwritten.

    The DCP count is :func:`~kvtail_connector.ops.dcp.dcp_local_valid_slots`
    (validated there, inlined here: this runs per load on the hot path; the
    tests check the two agree).

    Args:
        num_valid: valid tokens of the (DCP-virtual) block, ``0 <= n < eb``.
        dcp_rank, dcp_world_size, interleave: this rank's DCP placement
            (``dcp_world_size=1`` for caches replicated across DCP ranks).
        tokens_per_state: tokens one stored state covers. DeepSeek-V4's
            compressor writes a state only when its last token arrives
            (``(position + 1) % ratio == 0``), so a partially covered state
            holds stale bytes: states are counted with a floor. Fractions
            below 1 (several states per token) count exactly.
    """
    turn = dcp_world_size * interleave
    local = (num_valid // turn) * interleave + min(
        max(num_valid % turn - dcp_rank * interleave, 0), interleave
    )
    if type(tokens_per_state) is int:
        return local // tokens_per_state
    # floor(local / tps), exact for Fractions, without Fraction arithmetic.
    tps = Fraction(tokens_per_state)
    return local * tps.denominator // tps.numerator
