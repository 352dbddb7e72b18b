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

This module only builds and reads the entry (the values it carries are in
:mod:`kvtail_connector.extras.entry_values`); who trusts it and when is the
consumer's business (:mod:`kvtail_connector.extras.trust`, ``TailScheduler``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from kvtail_connector._version import __version__
from kvtail_connector.extras.entry_values import (
    MAX_STATE_SHARDS,
    UNBOUNDED,
    Digest,
    Geometry,
    Limits,
    StateDigest,
    StateSums,
    Sums,
    segment_for,
)

KEY = "kvtail"
VERSION = 2
TAIL_ZERO = "zero"

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
