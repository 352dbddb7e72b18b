"""The values a ``kvtail`` entry carries, apart from its wire form.

:class:`Geometry` (what must be equal on P and D for a tail claim to mean the
same slots), :class:`Digest` and :class:`StateDigest` (P's KV digest of the
prompt, in :func:`segment_for` segments) and :class:`Limits` (what an entry can
hold on a consumer, from its own model). The wire model that writes and reads
them is :mod:`kvtail_connector.extras.entry`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# A digest covers at most this many segments; more would make the entry big.
MAX_SEGMENTS = 32
MIN_SEGMENT = 256
_SLACK_NODES = 64  # keys a later release may add within a version


@dataclass(frozen=True)
class Limits:
    """What an entry can hold on this consumer, from its own model.

    Attributes:
        max_tokens: the longest prompt D can load (its ``max_model_len``).
        num_groups: D's KV cache groups (``geom.bs`` entries and digest
            group keys are bounded by it).
        num_kv_heads: the model's KV heads over all ranks (1 for MLA): digest
            head keys are below it.
    """

    max_tokens: int
    num_groups: int
    num_kv_heads: int

    @property
    def max_nodes(self) -> int:
        """Values (dicts, lists, scalars) in the largest clean entry, and slack:
        the size walk stops past it, before any parse."""
        rows = self.num_groups * (1 + self.num_kv_heads * (1 + MAX_SEGMENTS))
        states = 1 + 3 + 1 + self.num_groups * (1 + MAX_STATE_SHARDS)
        return 1 + 12 + (1 + 4 + self.num_groups) + (1 + 5 + 1 + rows) + states + _SLACK_NODES


# A cap no clean entry reaches on any model, for readers without D's model.
UNBOUNDED = Limits(max_tokens=1 << 24, num_groups=8, num_kv_heads=128)


@dataclass(frozen=True)
class Geometry:
    """What must be equal on P and D for a tail claim to mean the same slots.

    Attributes:
        block_sizes: rank-local block size of each KV cache group with token
            tails, in group order.
        dcp: decode-context-parallel size the tail groups are sharded over.
        interleave: ``cp_kv_cache_interleave_size``.
        signature: 16 hex digits over the tail groups' spec kinds, block sizes,
            dtypes and head sizes (TP may differ: per-rank head counts are out).
    """

    block_sizes: tuple[int, ...]
    dcp: int
    interleave: int
    signature: str

    def to_json(self) -> dict[str, Any]:
        return {
            "bs": list(self.block_sizes),
            "dcp": self.dcp,
            "ilv": self.interleave,
            "sig": self.signature,
        }


def geometry(group_specs: Sequence[Any], dcp: int, interleave: int) -> Geometry:
    """The :class:`Geometry` of the KV cache groups with token tails.

    Args:
        group_specs: each tail group's ``kv_cache_spec`` (vLLM objects with
            ``block_size``, ``dtype`` and ``head_size``), in group order.
        dcp, interleave: this engine's DCP size and interleave.
    """
    parts = [
        f"{type(s).__name__}:{int(s.block_size)}:{getattr(s, 'dtype', '')}:"
        f"{getattr(s, 'head_size', '')}"
        for s in group_specs
    ]
    digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return Geometry(tuple(int(s.block_size) for s in group_specs), dcp, interleave, digest)


# Per KV cache group, per global KV head: the segments' u64 sums.
Sums = dict[int, dict[int, tuple[int, ...]]]
# Per state (Mamba / linear-attention) group, per TP shard: the u64 sum.
StateSums = dict[int, dict[int, int]]
# TP shards a state digest may name (keys are below it).
MAX_STATE_SHARDS = 64


@dataclass(frozen=True)
class StateDigest:
    """The ``st`` of a ``dg``: P's digest of each state group's state after
    the prompt (the block vLLM's transfer sends), per TP shard.

    Attributes:
        algorithm: its own version (``mix64-state-1``, ``ops/state_digest/reference.py``).
        signature: 16 hex digits over what the sums are keyed on (groups,
            layers, state shapes and dtypes, TP size); a consumer compares
            only sums made with its own.
        sums: group -> TP shard -> sum.
    """

    algorithm: str
    signature: str
    sums: StateSums

    def to_json(self) -> dict[str, Any]:
        return {
            "alg": self.algorithm,
            "sig": self.signature,
            "g": {
                str(g): {str(r): f"{v:016x}" for r, v in shards.items()}
                for g, shards in self.sums.items()
            },
        }


@dataclass(frozen=True)
class Digest:
    """The ``dg`` of an entry: P's KV digest of tokens ``[0, n)``.

    Attributes:
        algorithm: the digest's own version (``mix64-1``).
        segment: tokens per segment (:func:`segment_for` of the prompt).
        signature: 16 hex digits over what the sums are keyed on; a consumer
            compares only sums made with its own.
        sums: group -> global KV head -> the sum of each segment.
        states: the state groups' digest (hybrid models), or None.
    """

    algorithm: str
    segment: int
    signature: str
    sums: Sums
    states: StateDigest | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "alg": self.algorithm,
            "seg": self.segment,
            "sig": self.signature,
            "g": {
                str(g): {str(h): [f"{v:016x}" for v in row] for h, row in heads.items()}
                for g, heads in self.sums.items()
            },
        }
        if self.states is not None:
            out["st"] = self.states.to_json()
        return out


def segment_for(num_tokens: int) -> int:
    """Tokens per segment for a prompt of ``num_tokens``: 1024, or the power
    of two that keeps it to :data:`MAX_SEGMENTS` segments."""
    segment = 1024
    while segment * MAX_SEGMENTS < num_tokens:
        segment *= 2
    return segment
