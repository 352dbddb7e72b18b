"""The ``kvtail`` entry of ``kv_transfer_params``: what a producer (P) states.

P's wrapper adds it to the params its ``request_finished`` returns; the router
copies the params into the decode request, where the consumer's (D's) wrapper
reads it. A plain vLLM D ignores the key.

The entry is untrusted input: any client of D's OpenAI server can set
``kv_transfer_params``, and it is read inside vLLM's engine core. It is read
by one typed, bounded model (:func:`read`): a size walk with an early exit
first (so that no entry costs more to refuse than the largest clean one costs
to read), then strict pydantic models whose bounds come from D's own model
(:class:`Limits`). :func:`read` never raises.

Wire format (JSON; :data:`VERSION` 2)::

    "kvtail": {"v": 2, "pv": "0.2.0", "n": 4753,
               "geom": {"bs": [16], "dcp": 1, "ilv": 1, "sig": "<16 hex>"},
               "bind": "<32 hex>",
               "tail": "zero",
               "dg": {"alg": "mix64-1", "seg": 1024, "sig": "<16 hex>",
                      "g": {"0": {"0": ["<16 hex>", ...], ...}}},
               "mac": "<64 hex>"}

- ``v``: an integer. Within a version keys are only ever added, never
  changed in meaning; a reader ignores keys it does not know. A consumer that
  does not know ``v`` behaves exactly as without an entry. A version-1 entry
  (no ``pv``, ``bind`` or ``mac``) is refused: the only producer that writes
  one, kvtail-connector 0.1.0, is listed in :data:`KNOWN_WRONG_PRODUCERS`.
- ``pv``: the producer's package version (``kvtail_connector.__version__``);
  a consumer refuses producers listed in :data:`KNOWN_WRONG_PRODUCERS`.
- ``n``: the prompt tokens P's KV holds, ``1 <= n <= max_model_len`` of D.
- ``geom``: the geometry the claim holds for (rank-local block size of every
  KV cache group with token tails, in group order, at most one per KV cache
  group of D; DCP size and interleave; a signature of those groups' specs).
- ``bind``: what identifies this transfer in the params P's inner connector
  returned (:func:`kvtail_connector.extras.trust.binding`): D trusts and uses the
  entry only with the params whose binding it matches.
- ``tail: "zero"``: every slot past ``n`` in the block holding token
  ``n - 1`` is zero on every rank and group of P. Absent where P does not
  vouch for its tail.
- ``dg`` (``verify_kv: digest``): the KV digest of tokens ``[0, n)``:
  algorithm ``alg`` (versioned on its own, see ``ops/digest/reference.py``),
  tokens per segment ``seg`` (exactly :func:`segment_for` ``(n)``), a
  signature ``sig`` of what the sums are keyed on, and per KV cache group
  (``< `` D's groups) and global KV head (``<`` D's KV heads) the sum of each
  of the ``ceil(n / seg)`` segments, as 16 hex digits (u64 values lose
  precision as JSON numbers in JavaScript proxies). Optional ``st`` (hybrid
  models): the digest of each state group's state after the prompt,
  ``{"alg": "mix64-state-1", "sig": "<16 hex>", "g": {"<group>": {"<TP
  shard>": "<16 hex>"}}}`` (shards ``<`` :data:`MAX_STATE_SHARDS`). A ``dg``
  outside the model is ignored; the rest of the entry is kept.
- ``mac``: HMAC-SHA256 of the entry without ``mac``
  (:func:`canonical`), with the key both sides share (``entry_key_env``);
  absent without a key.

This module only builds and reads the entry; who trusts it and when is the
consumer's business (:mod:`kvtail_connector.extras.trust`, ``TailScheduler``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from kvtail_connector._version import __version__

KEY = "kvtail"
VERSION = 2
TAIL_ZERO = "zero"
# A digest covers at most this many segments; more would make the entry big.
MAX_SEGMENTS = 32
MIN_SEGMENT = 256

# Producer versions whose entries a consumer refuses, with the reason.
KNOWN_WRONG_PRODUCERS: dict[str, str] = {
    "0.1.0": (
        "a 0.1.0 producer can claim a tail over a NIXL host buffer (kv_buffer_device cpu: "
        "blocks copied to the host when allocated, before the tail is zeroed) and for a "
        "request preempted after its tail was zeroed; an entry names the version, not "
        "whether its build avoids this"
    ),
}
# Entry versions that carry no producer version -> the only producer that
# writes them (refused as that producer is).
_LEGACY_PRODUCER = {1: "0.1.0"}

# Shape caps that do not depend on D's model (the rest are in Limits).
MAX_STRING = 256  # longest string anywhere in an entry (keys included)
MAX_DEPTH = 8  # a clean entry nests 5 deep (entry, dg, g, group, head row)
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


@dataclass(frozen=True)
class Entry:
    """A parsed ``kvtail`` entry (:data:`VERSION`).

    ``binding`` and ``mac`` are None where P had none to give (no transfer
    identity in its params; no shared key)."""

    num_tokens: int
    geometry: Geometry
    tail_zero: bool
    digest: Digest | None = None
    producer_version: str = __version__
    binding: str | None = None
    mac: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "v": VERSION,
            "pv": self.producer_version,
            "n": self.num_tokens,
            "geom": self.geometry.to_json(),
        }
        if self.binding is not None:
            out["bind"] = self.binding
        if self.tail_zero:
            out["tail"] = TAIL_ZERO
        if self.digest is not None:
            out["dg"] = self.digest.to_json()
        if self.mac is not None:
            out["mac"] = self.mac
        return out


def canonical(raw: Mapping[str, Any]) -> bytes | None:
    """The bytes an entry's ``mac`` is made over: the entry without ``mac``,
    as sorted, compact, ASCII JSON; None where it is not JSON (only a hostile
    in-process caller could pass that)."""
    try:
        text = json.dumps(
            {k: v for k, v in raw.items() if k != "mac"},
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=True,
            allow_nan=False,
        )
    except (TypeError, ValueError, RecursionError):
        return None
    return text.encode("ascii")


# ----------------------------------------------------------------- the reader


@dataclass(frozen=True)
class Reading:
    """What :func:`read` found.

    Attributes:
        entry: the entry, or None (then ``why`` says why).
        why: ``"ok"``, ``"absent"``, ``"unknown version"``, ``"too large"``,
            ``"malformed"`` or ``"known-wrong producer <version>"``.
        digest_why: about ``entry.digest``: ``"ok"``, ``"absent"``,
            ``"not read"`` (not asked for) or ``"malformed"``.
        raw: the entry as it came (for :func:`canonical`), when read.
    """

    entry: Entry | None
    why: str
    digest_why: str = "absent"
    raw: Mapping[str, Any] | None = None


# Most params carry no entry: one shared reading for them (immutable).
ABSENT = Reading(None, "absent")


# The strict wire model :func:`read` parses with: no booleans or floats for
# integers, no numeric strings, keys it does not know ignored. Bounds that
# depend on D's model (``Limits``) are checked by :func:`read` after the parse.
_Hex16 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")]
_HexU64 = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{16}$")]
_Key = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")]
_Count = Annotated[int, Field(ge=1, le=1 << 24)]
_STRICT = ConfigDict(strict=True, extra="ignore", frozen=True)


class WireGeometry(BaseModel):
    """An entry's ``geom``."""

    model_config = _STRICT

    bs: list[_Count]
    dcp: _Count
    ilv: _Count
    sig: _Hex16


class WireEntry(BaseModel):
    """An entry without its ``dg`` (read apart, only when asked for)."""

    model_config = _STRICT

    v: int
    pv: Annotated[str, StringConstraints(pattern=r"^[0-9A-Za-z.+!_-]{1,32}$")]
    n: _Count
    geom: WireGeometry
    bind: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")] | None = None
    tail: Annotated[str, StringConstraints(max_length=16)] | None = None
    mac: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = None


class WireStates(BaseModel):
    """A ``dg``'s ``st``."""

    model_config = _STRICT

    alg: Annotated[str, StringConstraints(min_length=1, max_length=32)]
    sig: _Hex16
    g: dict[_Key, dict[_Key, _HexU64]]


class WireDigest(BaseModel):
    """An entry's ``dg``."""

    model_config = _STRICT

    alg: Annotated[str, StringConstraints(min_length=1, max_length=32)]
    seg: _Count
    sig: _Hex16
    g: dict[_Key, dict[_Key, list[_HexU64]]]
    st: WireStates | None = None


def measure(raw: Any, max_nodes: int) -> int | None:
    """Values in ``raw`` (dicts, lists and scalars; keys are checked with
    their dict), or None as soon as it holds more than ``max_nodes``, nests
    deeper than :data:`MAX_DEPTH`, holds a string longer than
    :data:`MAX_STRING`, an integer past 64 bits, or anything but JSON values.
    Visits at most ``max_nodes + 1`` values whatever ``raw`` is."""
    seen = 0
    stack: list[tuple[Any, int]] = [(raw, 0)]
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > max_nodes or depth > MAX_DEPTH:
            return None
        if isinstance(node, dict):
            if len(node) > max_nodes - seen:
                return None
            for key, value in node.items():
                if not isinstance(key, str) or len(key) > MAX_STRING:
                    return None
                stack.append((value, depth + 1))
        elif isinstance(node, list | tuple):
            if len(node) > max_nodes - seen:
                return None
            stack.extend((value, depth + 1) for value in node)
        elif isinstance(node, str):
            if len(node) > MAX_STRING:
                return None
        elif isinstance(node, int):  # bool included
            if node.bit_length() > 64:
                return None
        elif node is not None and not isinstance(node, float):
            return None
    return seen


def raw_entry(params: Any) -> Any:
    """What ``params`` (a request's ``kv_transfer_params``, from the network)
    holds under :data:`KEY`, unchecked; None where nothing (or no mapping)."""
    # dict first: most params are one, and the Mapping ABC check costs a call.
    return params.get(KEY) if isinstance(params, (dict, Mapping)) else None


def read(
    params: Mapping[str, Any] | None,
    limits: Limits = UNBOUNDED,
    *,
    digest: bool = True,
    walk_digest: bool = False,
) -> Reading:
    """The entry in ``params``, bounded by ``limits``; with ``digest`` its
    ``dg`` too. Never raises: the params come from the network. Costs at most
    a walk of ``limits.max_nodes`` values and one strict parse of what
    passed it. Without ``digest`` (and ``walk_digest``: a MAC over the whole
    entry will be checked) the ``dg`` is neither walked nor parsed."""
    raw = raw_entry(params)
    if raw is None:
        return ABSENT
    if not isinstance(raw, dict):
        return Reading(None, "malformed")
    version = raw.get("v")
    if type(version) is not int or version != VERSION:
        legacy = _LEGACY_PRODUCER.get(version) if type(version) is int else None
        if legacy is not None:
            return Reading(None, f"known-wrong producer {legacy}")
        return Reading(None, "unknown version")
    walked = raw
    if not (digest or walk_digest) and "dg" in raw:
        if len(raw) > limits.max_nodes:
            return Reading(None, "too large")
        walked = {k: v for k, v in raw.items() if k != "dg"}
    if measure(walked, limits.max_nodes) is None:
        return Reading(None, "too large")
    try:
        wire = WireEntry.model_validate(raw)
    except ValidationError:
        return Reading(None, "malformed")
    if wire.pv in KNOWN_WRONG_PRODUCERS:
        return Reading(None, f"known-wrong producer {wire.pv}")
    if wire.n > limits.max_tokens or len(wire.geom.bs) > limits.num_groups:
        return Reading(None, "malformed")
    found_digest, digest_why = None, "not read"
    if digest:
        found_digest, digest_why = _read_digest(raw.get("dg"), wire.n, limits)
    found = Entry(
        num_tokens=wire.n,
        geometry=Geometry(tuple(wire.geom.bs), wire.geom.dcp, wire.geom.ilv, wire.geom.sig),
        tail_zero=wire.tail == TAIL_ZERO,
        digest=found_digest,
        producer_version=wire.pv,
        binding=wire.bind,
        mac=wire.mac,
    )
    return Reading(found, "ok", digest_why, raw)


def _read_digest(raw: Any, num_tokens: int, limits: Limits) -> tuple[Digest | None, str]:
    """An entry's ``dg`` for a prompt of ``num_tokens``: the segment P must
    have chosen, ``ceil(n / seg)`` sums per head, D's groups and heads only."""
    if raw is None:
        return None, "absent"
    try:
        wire = WireDigest.model_validate(raw)
    except ValidationError:
        return None, "malformed"
    if wire.seg != segment_for(num_tokens):
        return None, "malformed"
    segments = -(-num_tokens // wire.seg)
    sums: Sums = {}
    for g, heads in wire.g.items():
        group = int(g)
        if group >= limits.num_groups:
            return None, "malformed"
        per_head: dict[int, tuple[int, ...]] = {}
        for h, row in heads.items():
            head = int(h)
            if head >= limits.num_kv_heads or len(row) != segments:
                return None, "malformed"
            per_head[head] = tuple(int(v, 16) for v in row)
        sums[group] = per_head
    states = None
    if wire.st is not None:
        state_sums: StateSums = {}
        for g, shards in wire.st.g.items():
            if int(g) >= limits.num_groups:
                return None, "malformed"
            per_shard: dict[int, int] = {}
            for r, v in shards.items():
                if int(r) >= MAX_STATE_SHARDS:
                    return None, "malformed"
                per_shard[int(r)] = int(v, 16)
            state_sums[int(g)] = per_shard
        states = StateDigest(wire.st.alg, wire.st.sig, state_sums)
    return Digest(wire.alg, wire.seg, wire.sig, sums, states), "ok"
