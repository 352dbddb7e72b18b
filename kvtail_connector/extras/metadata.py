"""What the opt-in features ship beside the core's records: scheduler ->
workers (:class:`EntryStep`, in ``KVTailMetadata.extra``) and back
(:class:`EntryReport`, in ``KVTailWorkerMeta.extra``), keyed by request.

In-process like the core's metadata (one installed package on both ends);
``KVTAIL_PROTOCOL_VERSION`` covers both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvtail_connector.core.metadata import GroupLoad, LoadRecord
from kvtail_connector.extras.entry_values import Digest, StateDigest, StateSums, Sums

MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class ExpectedDigest:
    """What a consumer checks a load against: the producer's digest of
    tokens ``[0, num_tokens)`` (its entry's ``n`` and ``dg``)."""

    num_tokens: int
    digest: Digest


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
            :class:`~kvtail_connector.extras.entry_values.Digest`).
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


class Compared(NamedTuple):
    """A rank's verdict on one load and, for a mismatch, what differs (the
    first differing segment or state, for the scheduler's one log line)."""

    verdict: str
    differs: str = ""


def combined_verdict(a: str, b: str) -> str:
    """Any rank's mismatch wins; one rank that compared anything verifies."""
    return a if _VERDICT_RANK[a] >= _VERDICT_RANK[b] else b


class CheckedLoad(NamedTuple):
    """A load (consumer) or a prompt (producer, ``num_local == 0``) the
    digest covers: the core's record with what the digest needs.

    ``expected``: the producer's digest the load is checked against (None on
    a producer). ``states``: per state (Mamba / linear-attention) group, the
    block holding the request's state after the prompt (``GroupLoad`` with
    one block id; ``first_block``: its index in the request's block list).
    """

    req_id: str
    num_local: int
    num_loaded: int
    groups: tuple[GroupLoad, ...]
    expected: ExpectedDigest | None = None
    states: tuple[GroupLoad, ...] = ()


class LoadCheck(NamedTuple):
    """What a consumer checks one async load against (its record travels in
    ``KVTailMetadata.loads``)."""

    expected: ExpectedDigest
    states: tuple[GroupLoad, ...] = ()


@dataclass(frozen=True)
class EntryStep:
    """Scheduler -> workers, per step (``KVTailMetadata.extra``).

    Attributes:
        producer_tails: remote-decode prompts completing this step (on a
            producer): only the block holding each prompt's last token per
            group with a partial last block; tails the workers zero and confirm.
        producer_digests: the same prompts with all their blocks (first block
            0), for the workers to digest (``verify_kv``).
        vouched: loads of this step (async or READ) whose tail the producer
            zeroed and vouched for, in a bound entry: workers skip its zeroing.
        checks: async loads of this step to verify, by request.
    """

    producer_tails: tuple[LoadRecord, ...] = ()
    producer_digests: tuple[CheckedLoad, ...] = ()
    vouched: frozenset[str] = frozenset()
    checks: dict[str, LoadCheck] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.producer_tails or self.producer_digests or self.vouched or self.checks)


@dataclass
class EntryReport:
    """Workers -> scheduler, per step (``KVTailMetadata.extra``), folded over
    the ranks by :meth:`aggregate`; ``KVTailWorkerMeta.ranks`` says which.

    Attributes:
        confirmed: request id -> ranks that zeroed its producer tail this step
            (``confirmed[req] == ranks``: every rank that reported did).
        digests: request id -> the digest sums of its prompt (producer), folded
            over the ranks that digested it.
        verdicts: request id -> what the ranks that checked its load found
            (consumer): :data:`MISMATCH` if any rank did.
        false_vouches: requests whose vouched tail a rank's probe found
            non-zero this step (consumer): counted once on the scheduler side.
        differs: request id -> what differs in its load, as the first rank
            that found a mismatch saw it (consumer; logged once per request by
            the scheduler side).
    """

    confirmed: dict[str, frozenset[int]] = field(default_factory=dict)
    digests: dict[str, DigestPart] = field(default_factory=dict)
    verdicts: dict[str, str] = field(default_factory=dict)
    false_vouches: frozenset[str] = frozenset()
    differs: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.confirmed or self.digests or self.verdicts or self.false_vouches)

    def aggregate(self, other: EntryReport) -> EntryReport:
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
        return EntryReport(
            confirmed=confirmed,
            digests=digests,
            verdicts=verdicts,
            false_vouches=self.false_vouches | other.false_vouches,
            differs={**other.differs, **self.differs},
        )


def report_of(worker_meta: Any) -> EntryReport | None:
    """The folded report in ``worker_meta`` (a ``KVTailWorkerMeta`` or None);
    None where no rank sent any (most steps: nothing is built to be read empty)."""
    extra = getattr(worker_meta, "extra", None)
    return extra if isinstance(extra, EntryReport) else None
