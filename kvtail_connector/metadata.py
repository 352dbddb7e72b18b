"""What crosses from the scheduler side to the workers (and back).

The wrapper's metadata carries the inner connector's metadata untouched, plus
one :class:`LoadRecord` per load that started this step. Records are shipped
once; workers keep them until the inner connector reports the load done.

This protocol is in-process (scheduler <-> workers of one engine, one
installed package on both ends): no reader meets another version of it.
:data:`KVTAIL_PROTOCOL_VERSION`, which every :class:`KVTailMetadata` carries,
is bumped when a field changes meaning or layout. What crosses from a producer
to a consumer is the ``kvtail`` entry (:mod:`kvtail_connector.entry`),
versioned on its own.
"""

from __future__ import annotations

import functools
import struct
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtail_connector.entry import Digest, StateDigest, StateSums, Sums

KVTAIL_PROTOCOL_VERSION = 6
MASK64 = (1 << 64) - 1

NULL_BLOCK = -1  # a block the load does not write (vLLM's null block)


# The record types are NamedTuples: immutable like a frozen dataclass, and
# built about five times faster (a LoadRecord in ~0.2 µs on CPU against ~1 µs
# as a frozen dataclass: benchmarks/RESULTS.md §4, host cost); one is built per
# load on the scheduler's step path. ``_replace`` where a part attaches something.


class GroupLoad(NamedTuple):
    """The blocks one load writes in one KV cache group.

    Attributes:
        group: KV cache group id.
        first_block: index, in the request's block list, of ``block_ids[0]``
            (the block holding token ``num_local``).
        block_ids: the blocks covering tokens ``[num_local, num_loaded)``;
            :data:`NULL_BLOCK` for null (skipped) blocks. A tuple where the
            scheduler built it; an ``array('q')`` once pickled to a worker
            process (a multi-process executor): index, slice, iterate or
            ``np.frombuffer`` it, never hash or compare it to a tuple.
    """

    group: int
    first_block: int
    block_ids: Sequence[int]

    def __reduce__(self) -> tuple[Any, ...]:
        # To a worker process the ids travel as one int64 buffer: one object
        # to unpickle and, when the load completes, to free, where a tuple
        # is one int object per block (64 for a 1k-token load).
        return (GroupLoad, (self.group, self.first_block, _WireIds(self.block_ids)))

    # Immutable: a copy is the record itself (copy would go through __reduce__).
    def __copy__(self) -> GroupLoad:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> GroupLoad:
        return self


class _WireIds:
    """Block ids on their way to a worker process: pickled as
    ``array('q', <int64 bytes>)``."""

    __slots__ = ("ids",)

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = ids

    def __reduce__(self) -> tuple[Any, ...]:
        ids = self.ids
        raw = ids.tobytes() if isinstance(ids, array) else _int64s(len(ids)).pack(*ids)
        return (array, ("q", raw))


@functools.lru_cache(maxsize=512)
def _int64s(n: int) -> struct.Struct:
    # Native order and size, as array('q') reads its bytes back.
    return struct.Struct(f"={n}q")


@dataclass(frozen=True, slots=True)
class ExpectedDigest:
    """What a consumer checks a load against: the producer's digest of
    tokens ``[0, num_tokens)`` (its entry's ``n`` and ``dg``)."""

    num_tokens: int
    digest: Digest


class LoadRecord(NamedTuple):
    """One load: tokens ``[num_local, num_loaded)`` of ``req_id`` arrive.

    ``num_loaded`` is the count before vLLM's full-hit ``N-1`` rewind (the
    forward rewrites that slot anyway); the tail starts there.

    ``vouched``: the producer zeroed that tail before sending it and said so
    (a matching ``kvtail`` entry): workers skip its zeroing. A producer's own
    tail record (``KVTailMetadata.producer_tails``) has ``num_local == 0``,
    ``num_loaded`` = the prompt length, and only the block holding the prompt's
    last token in each group with a partial last block; a producer's digest
    record (``KVTailMetadata.producer_digests``) has every block of the prompt.

    ``expected``: the producer's digest the consumer verifies the load against
    (``verify_kv: digest``), or None.

    ``states``: per state (Mamba / linear-attention) group the load writes,
    or the producer's prompt holds, the block holding the request's state
    after the prompt (``GroupLoad`` with one block id; ``first_block``: its
    index in the request's block list); only for ``verify_kv``.
    """

    req_id: str
    num_local: int
    num_loaded: int
    groups: tuple[GroupLoad, ...]
    vouched: bool = False
    expected: ExpectedDigest | None = None
    states: tuple[GroupLoad, ...] = ()


@dataclass
class KVTailMetadata(KVConnectorMetadata):
    """Scheduler -> worker: the inner connector's metadata and new loads.

    Attributes:
        inner: the wrapped connector's metadata, as it built it.
        loads: async loads started this step (tails zeroed on completion).
        read_loads: synchronous MoRIIO READ loads (tails zeroed once landed);
            their ``num_loaded`` is the producer's prompt length, where the
            stale tail its blocks carry starts.
        producer_tails: remote-decode prompts completing this step (on a
            producer): tails the workers zero and confirm.
        producer_digests: the same prompts with all their blocks (first
            block 0), for the workers to digest (``verify_kv: digest``).
        failing: async loads whose record a contained internal error lost:
            workers report them failed when they complete.
        version: :data:`KVTAIL_PROTOCOL_VERSION` of the sender.
    """

    inner: KVConnectorMetadata
    loads: tuple[LoadRecord, ...] = ()
    read_loads: tuple[LoadRecord, ...] = ()
    producer_tails: tuple[LoadRecord, ...] = ()
    producer_digests: tuple[LoadRecord, ...] = ()
    failing: tuple[str, ...] = ()
    version: int = KVTAIL_PROTOCOL_VERSION


class StatePart:
    """One request's state-group sums from the worker ranks folded into it
    (each rank adds its own TP shard's sums); ``resolve`` as for
    :class:`DigestPart`."""

    def __init__(
        self,
        algorithm: str,
        signature: str,
        sums: StateSums | None = None,
        resolve: Callable[[], StateSums] | None = None,
    ) -> None:
        assert (sums is None) != (resolve is None), "sums or a way to them"
        self.algorithm = algorithm
        self.signature = signature
        self._sums = sums
        self._resolve = resolve

    def sums(self) -> StateSums:
        if self._sums is None:
            assert self._resolve is not None
            self._sums, self._resolve = self._resolve(), None
        return self._sums

    def digest(self) -> StateDigest | None:
        if not self.signature:
            return None
        return StateDigest(self.algorithm, self.signature, self.sums())

    def merged(self, other: StatePart) -> StatePart:
        """Both parts' shards; the same shard twice (a replayed output) must
        hold the same sum, else the digest is dropped."""
        same = (self.algorithm, self.signature) == (other.algorithm, other.signature)
        out: StateSums = {g: dict(shards) for g, shards in self.sums().items()}
        for g, shards in other.sums().items():
            mine = out.setdefault(g, {})
            for r, v in shards.items():
                if mine.setdefault(r, v) != v:
                    same = False
        return StatePart(self.algorithm, self.signature if same else "", out)

    def __reduce__(self) -> tuple[Any, ...]:
        return (StatePart, (self.algorithm, self.signature, self.sums(), None))


class DigestPart:
    """One request's digest sums from the worker ranks folded into it.

    A rank's part may still be on its way to the host (a CUDA event behind a
    non-blocking copy): ``resolve`` turns it into ints when first read, and
    pickling (multiproc and Ray workers send their output to the scheduler's
    process) reads it first, so only host ints ever cross a process.

    Args:
        algorithm, segment, signature: what the sums were made with (see
            :class:`~kvtail_connector.entry.Digest`).
        sums: group -> global KV head -> segment sums; or None with
            ``resolve`` given.
        resolve: returns the sums (waits for the device).
        ranks: ranks folded into this part.
        states: the state groups' part (hybrid models), or None.
    """

    def __init__(
        self,
        algorithm: str,
        segment: int,
        signature: str,
        sums: Sums | None = None,
        resolve: Callable[[], Sums] | None = None,
        ranks: int = 1,
        states: StatePart | None = None,
    ) -> None:
        assert (sums is None) != (resolve is None), "sums or a way to them"
        self.algorithm = algorithm
        self.segment = segment
        self.signature = signature
        self.ranks = ranks
        self.states = states
        self._sums = sums
        self._resolve = resolve

    def sums(self) -> Sums:
        if self._sums is None:
            assert self._resolve is not None
            self._sums, self._resolve = self._resolve(), None
        return self._sums

    def digest(self) -> Digest | None:
        """The entry's ``dg``, or None where the ranks disagreed on what they digested."""
        if not self.signature:
            return None
        states = self.states.digest() if self.states is not None else None
        return Digest(self.algorithm, self.segment, self.signature, self.sums(), states)

    def merged(self, other: DigestPart) -> DigestPart:
        """Both parts' sums added (mod 2**64), per group, head and segment:
        ranks hold disjoint heads (replicated ones are counted once)."""
        same = (self.algorithm, self.segment, self.signature) == (
            other.algorithm,
            other.segment,
            other.signature,
        )
        out: Sums = {g: dict(heads) for g, heads in self.sums().items()}
        for g, heads in other.sums().items():
            mine = out.setdefault(g, {})
            for h, row in heads.items():
                have = mine.get(h)
                if have is None:
                    mine[h] = row
                elif len(have) != len(row):
                    same = False
                else:
                    mine[h] = tuple((a + b) & MASK64 for a, b in zip(have, row, strict=True))
        signature = self.signature if same else ""
        # A rank without states (none registered) leaves the fold without them.
        states = (
            self.states.merged(other.states)
            if self.states is not None and other.states is not None
            else None
        )
        return DigestPart(
            self.algorithm,
            self.segment,
            signature,
            out,
            ranks=self.ranks + other.ranks,
            states=states,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            DigestPart,
            (
                self.algorithm,
                self.segment,
                self.signature,
                self.sums(),
                None,
                self.ranks,
                self.states,
            ),
        )


# A rank's verdict on one verified load, and how ranks' verdicts combine.
VERIFIED, MISMATCH, UNVERIFIED = "verified", "mismatch", "unverified"
_VERDICT_RANK = {UNVERIFIED: 0, VERIFIED: 1, MISMATCH: 2}


def combined_verdict(a: str, b: str) -> str:
    """Any rank's mismatch wins; one rank that compared anything verifies."""
    return a if _VERDICT_RANK[a] >= _VERDICT_RANK[b] else b


@dataclass
class KVTailWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: which producer tails each rank zeroed.

    vLLM's ``KVOutputAggregator`` folds every worker's metadata with
    :meth:`aggregate`, so after it ``confirmed[req] == ranks`` means every rank
    that reported zeroed that request's tail. Ranks are ids, not counts: an
    output folded twice (replayed) cannot stand in for a rank that did not zero.

    Attributes:
        inner: the inner connector's worker metadata (unwrapped before the
            inner connector's ``update_connector_output``).
        confirmed: request id -> ranks that zeroed its producer tail this step.
        ranks: ranks (vLLM world-group ranks) folded into this object.
        digests: request id -> the digest sums of its prompt (producer,
            ``verify_kv``), folded over the ranks that digested it.
        verdicts: request id -> what the ranks that checked its load found
            (consumer, ``verify_kv``): :data:`MISMATCH` if any rank did.
        false_vouches: requests whose vouched tail a rank's probe found
            non-zero this step (consumer): counted once on the scheduler side.
    """

    inner: KVConnectorWorkerMetadata | None = None
    confirmed: dict[str, frozenset[int]] = field(default_factory=dict)
    ranks: frozenset[int] = frozenset({0})
    digests: dict[str, DigestPart] = field(default_factory=dict)
    verdicts: dict[str, str] = field(default_factory=dict)
    false_vouches: frozenset[str] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVTailWorkerMeta):
            raise TypeError(
                f"every worker runs KVTailConnector, yet one sent {type(other).__name__}"
            )
        inner: Any = self.inner
        if inner is None:
            inner = other.inner
        elif other.inner is not None:
            inner = inner.aggregate(other.inner)
        confirmed = dict(self.confirmed)
        for req_id, ranks in other.confirmed.items():
            confirmed[req_id] = confirmed.get(req_id, frozenset()) | ranks
        digests = dict(self.digests)
        for req_id, part in other.digests.items():
            have = digests.get(req_id)
            digests[req_id] = part if have is None else have.merged(part)
        verdicts = dict(self.verdicts)
        for req_id, verdict in other.verdicts.items():
            have_v = verdicts.get(req_id)
            verdicts[req_id] = verdict if have_v is None else combined_verdict(have_v, verdict)
        return KVTailWorkerMeta(
            inner=inner,
            confirmed=confirmed,
            ranks=self.ranks | other.ranks,
            digests=digests,
            verdicts=verdicts,
            false_vouches=self.false_vouches | other.false_vouches,
        )
