"""The ``kvtail`` entry of ``kv_transfer_params``: what a producer (P) guarantees.

P's wrapper adds it to the params its ``request_finished`` returns; the router
copies the params into the decode request, where the consumer's (D's) wrapper
reads it. A plain vLLM D ignores the key.

Wire format (JSON; :data:`VERSION` 1)::

    "kvtail": {"v": 1, "n": 4753,
               "geom": {"bs": [16], "dcp": 1, "ilv": 1, "sig": "<16 hex>"},
               "tail": "zero",
               "dg": {"alg": "mix64-1", "seg": 1024, "sig": "<16 hex>",
                      "g": {"0": {"0": ["<16 hex>", ...], ...}}}}

- ``v`` is an integer. Within a version keys are only ever added, never
  changed in meaning; a reader ignores keys it does not know, and treats an
  unknown ``v`` as no entry at all.
- ``n``: the prompt tokens P's KV holds; ``geom``: the geometry the claim
  holds for (rank-local block size of every KV cache group with token tails,
  in group order; DCP size and interleave; a signature of those groups'
  specs); ``tail: "zero"``: every slot past ``n`` in the block holding token
  ``n - 1`` is zero on every rank and group of P. ``tail`` is absent where P
  does not vouch for its tail.
- ``dg`` (added within version 1; ``verify_kv: digest``): the KV digest of
  tokens ``[0, n)``: algorithm ``alg`` (versioned on its own, see
  ``ops/digest_reference.py``), tokens per segment ``seg``, a signature
  ``sig`` of what the sums are keyed on (groups, layers, slot words), and per
  KV cache group and global KV head the sum of each segment, as 16 hex digits
  (u64 values lose precision as JSON numbers in JavaScript proxies). A reader
  that cannot parse ``dg`` ignores it and keeps the rest of the entry.

This module only builds and reads the entry; who trusts it and when is the
consumer's business (see ``TailScheduler``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KEY = "kvtail"
VERSION = 1
TAIL_ZERO = "zero"
# A digest covers at most this many segments; more would make the entry big.
MAX_SEGMENTS = 32
MIN_SEGMENT = 256


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


@dataclass(frozen=True)
class Digest:
    """The ``dg`` of an entry: P's KV digest of tokens ``[0, n)``.

    Attributes:
        algorithm: the digest's own version (``mix64-1``).
        segment: tokens per segment, a power of two >= :data:`MIN_SEGMENT`.
        signature: 16 hex digits over what the sums are keyed on; a consumer
            compares only sums made with its own.
        sums: group -> global KV head -> the sum of each segment.
    """

    algorithm: str
    segment: int
    signature: str
    sums: Sums

    def to_json(self) -> dict[str, Any]:
        return {
            "alg": self.algorithm,
            "seg": self.segment,
            "sig": self.signature,
            "g": {
                str(g): {str(h): [f"{v:016x}" for v in row] for h, row in heads.items()}
                for g, heads in self.sums.items()
            },
        }


def segment_for(num_tokens: int) -> int:
    """Tokens per segment for a prompt of ``num_tokens``: 1024, or the power
    of two that keeps it to :data:`MAX_SEGMENTS` segments."""
    segment = 1024
    while segment * MAX_SEGMENTS < num_tokens:
        segment *= 2
    return segment


@dataclass(frozen=True)
class Entry:
    """A parsed ``kvtail`` entry (:data:`VERSION`)."""

    num_tokens: int
    geometry: Geometry
    tail_zero: bool
    digest: Digest | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": VERSION, "n": self.num_tokens, "geom": self.geometry.to_json()}
        if self.tail_zero:
            out["tail"] = TAIL_ZERO
        if self.digest is not None:
            out["dg"] = self.digest.to_json()
        return out


def read(params: Mapping[str, Any] | None) -> tuple[Entry | None, str]:
    """The entry in ``params`` and why there is none: ``(entry, "ok")``, or
    ``(None, reason)`` with reason ``"absent"``, ``"unknown version"`` or
    ``"malformed"``. Never raises: the params come from the network."""
    raw = params.get(KEY) if isinstance(params, Mapping) else None
    if raw is None:
        return None, "absent"
    if not isinstance(raw, Mapping):
        return None, "malformed"
    if type(raw.get("v")) is not int or raw.get("v") != VERSION:
        return None, "unknown version"
    try:
        geom = raw["geom"]
        sizes = tuple(_int(b) for b in geom["bs"])
        entry = Entry(
            num_tokens=_int(raw["n"]),
            geometry=Geometry(sizes, _int(geom["dcp"]), _int(geom["ilv"]), _str(geom["sig"])),
            tail_zero=raw.get("tail") == TAIL_ZERO,
            digest=read_digest(raw.get("dg")),
        )
    except (KeyError, TypeError, ValueError):
        return None, "malformed"
    return entry, "ok"


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"not a string: {value!r}")
    return value


def read_digest(raw: Any) -> Digest | None:
    """The :class:`Digest` in an entry's ``dg``, or None where it is absent or
    malformed in any way (never raises: it comes from the network)."""
    if not isinstance(raw, Mapping):
        return None
    try:
        algorithm, signature, groups = raw["alg"], raw["sig"], raw["g"]
        segment = _int(raw["seg"])
        if not isinstance(algorithm, str) or not isinstance(signature, str):
            return None
        if segment < MIN_SEGMENT or segment & (segment - 1) or not isinstance(groups, Mapping):
            return None
        sums: Sums = {}
        for g, heads in groups.items():
            if not isinstance(heads, Mapping):
                return None
            per_head: dict[int, tuple[int, ...]] = {}
            for h, row in heads.items():
                if not isinstance(row, list) or len(row) > MAX_SEGMENTS:
                    return None
                per_head[_key(h)] = tuple(_hex64(v) for v in row)
            sums[_key(g)] = per_head
    except (KeyError, TypeError, ValueError):
        return None
    return Digest(algorithm, segment, signature, sums)


def _key(value: Any) -> int:
    if not isinstance(value, str) or not value.isdigit() or len(value) > 9:
        raise ValueError(f"not a decimal key: {value!r}")
    return int(value)


_HEX = frozenset("0123456789abcdefABCDEF")


def _hex64(value: Any) -> int:
    if not isinstance(value, str) or len(value) != 16 or not _HEX.issuperset(value):
        raise ValueError(f"not 16 hex digits: {value!r}")
    return int(value, 16)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"not a non-negative integer: {value!r}")
    return value
