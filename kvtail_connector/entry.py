"""The ``kvtail`` entry of ``kv_transfer_params``: what a producer (P) guarantees.

P's wrapper adds it to the params its ``request_finished`` returns; the router
copies the params into the decode request, where the consumer's (D's) wrapper
reads it. A plain vLLM D ignores the key.

Wire format (JSON; :data:`VERSION` 1)::

    "kvtail": {"v": 1, "n": 4753,
               "geom": {"bs": [16], "dcp": 1, "ilv": 1, "sig": "<16 hex>"},
               "tail": "zero"}

- ``v`` is an integer. Within a version keys are only ever added, never
  changed in meaning; a reader ignores keys it does not know, and treats an
  unknown ``v`` as no entry at all.
- ``n``: the prompt tokens P's KV holds; ``geom``: the geometry the claim
  holds for (rank-local block size of every KV cache group with token tails,
  in group order; DCP size and interleave; a signature of those groups'
  specs); ``tail: "zero"``: every slot past ``n`` in the block holding token
  ``n - 1`` is zero on every rank and group of P.

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


@dataclass(frozen=True)
class Entry:
    """A parsed ``kvtail`` entry (:data:`VERSION`)."""

    num_tokens: int
    geometry: Geometry
    tail_zero: bool

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": VERSION, "n": self.num_tokens, "geom": self.geometry.to_json()}
        if self.tail_zero:
            out["tail"] = TAIL_ZERO
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
        )
    except (KeyError, TypeError, ValueError):
        return None, "malformed"
    return entry, "ok"


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"not a string: {value!r}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"not a non-negative integer: {value!r}")
    return value
