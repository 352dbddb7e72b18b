"""Worker side of ``verify_kv: digest``: digest a producer's prompts, check a
consumer's loads.

A producer (P) digests tokens ``[0, n)`` of each completing remote-decode
prompt in the hook ordered after the step's forward
(:meth:`RankDigests.digest_prompts`); the sums travel to the scheduler in the
worker metadata, still on their way to the host (a CUDA event behind a
non-blocking copy) until read or pickled.

A consumer (D) digests what a completed async load wrote, before anything
reads it (:meth:`RankDigests.check_loads`, in ``get_transfer_results``), holds
the completion until the sums are on the host, compares the segments that lie
entirely inside the loaded range with P's, and reports a mismatch as a failed
load (:meth:`RankDigests.release`). Each rank compares the heads it holds.

Sums are keyed by logical coordinates (``ops/digest/``): P and D may differ
in block ids, block size, page layout and TP. Covered: every KV cache group
with token tails held in one cache set of one slot per token; other groups
(several page splits, compressed states) and groups whose blocks a
sliding window dropped are not digested. Page layouts described as regions
(CPU attention, ROCm, the fp8 indexer) count as one head and so compare only
between equal layouts at TP 1.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvtail_connector import entry
from kvtail_connector.cache_sets import CacheSet, cache_slots
from kvtail_connector.features.consumer_tails.hold import MAX_PASSES
from kvtail_connector.log import get_logger
from kvtail_connector.metadata import (
    MISMATCH,
    NULL_BLOCK,
    UNVERIFIED,
    VERIFIED,
    DigestPart,
    LoadRecord,
)
from kvtail_connector.ops import RegionCache
from kvtail_connector.ops.digest.launcher import (
    ALGORITHM,
    DigestGroup,
    GroupSpan,
    KVDigester,
    PendingDigest,
)

logger = get_logger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True)
class HeadPlacement:
    """Which global KV heads this rank holds (tensor parallelism).

    Attributes:
        tp_rank, tp_size: this rank in its TP group.
        total_kv_heads: the model's KV heads over all ranks (1 for MLA).
    """

    tp_rank: int = 0
    tp_size: int = 1
    total_kv_heads: int = 1

    def heads(self, local: int) -> tuple[int, list[int] | None]:
        """``(head_offset, counted_heads)`` of a cache with ``local`` heads on
        this rank. Heads replicated over ranks (TP > KV heads) are counted on
        their lowest replica only, so that the ranks' sums add up."""
        if self.tp_size <= self.total_kv_heads:
            return self.tp_rank * local, None
        replicas = self.tp_size // max(self.total_kv_heads, 1)
        return self.tp_rank // replicas, [0] if self.tp_rank % replicas == 0 else []


@dataclass
class _Check:
    """A consumer's digest of one load, on its way to the host."""

    record: LoadRecord
    result: Any  # () -> the digester's per-group results of this request
    event: Any  # CUDA event behind the read-back, or None
    segments: range  # the segments compared
    passes: int = 0


@dataclass
class RankDigests:
    """This rank's digest groups, its pending checks and its verdicts.

    Args:
        sets: the rank's cache sets (``cache_sets``).
        placement: its TP placement.
    """

    sets: Sequence[CacheSet]
    placement: HeadPlacement = field(default_factory=HeadPlacement)

    def __post_init__(self) -> None:
        by_group: dict[int, list[CacheSet]] = {}
        for s in self.sets:
            by_group.setdefault(s.group_id, []).append(s)
        self._sets: list[CacheSet] = []
        excluded = []
        for gid, sets in sorted(by_group.items()):
            regions = any(isinstance(c, RegionCache) for c in sets[0].caches)
            if (
                len(sets) != 1
                or sets[0].tokens_per_state != 1
                or (regions and self.placement.tp_size > 1)
            ):
                excluded.append(gid)
                continue
            self._sets.append(sets[0])
        if excluded:
            logger.info(
                "KVTailConnector: verify_kv: KV cache group(s) %s not digested (several page "
                "splits, compressed states, or region-described pages under TP)",
                excluded,
            )
        self.group_ids = tuple(s.group_id for s in self._sets)
        self.signature = _signature(self._sets, self.placement.tp_size)
        self._digesters: dict[tuple[int, bool], KVDigester] = {}
        self._held: dict[str, _Check] = {}
        # Released since the caller last said its results reached vLLM
        # (:meth:`reported`): a failure in between must still report them.
        self._unreported: set[str] = set()
        self._verdicts: dict[str, str] = {}

    # -------------------------------------------------------------- producer

    def digest_prompts(self, records: Sequence[LoadRecord]) -> dict[str, DigestPart]:
        """Digest tokens ``[0, num_loaded)`` of each producer record, one launch
        per segment size, on the current stream; the parts resolve when read."""
        parts: dict[str, DigestPart] = {}
        for segment, batch in _by_segment(records, lambda r: entry.segment_for(r.num_loaded)):
            spans = [[self._span(r, g, 0, r.num_loaded) for g in self.group_ids] for r in batch]
            pending = self._digester(segment, producer=True).digest(spans)
            results = _memo(pending)
            for i, r in enumerate(batch):
                parts[r.req_id] = DigestPart(
                    ALGORITHM,
                    segment,
                    self.signature,
                    resolve=functools.partial(self._sums, results, i),
                )
        return parts

    # -------------------------------------------------------------- consumer

    def check_loads(self, records: Iterable[LoadRecord]) -> None:
        """Digest the received slots of completed loads whose producer sent a
        digest (``record.expected``), one launch per segment size, and hold
        them until :meth:`release`. A load that cannot be compared (another
        algorithm or signature, no whole segment inside the loaded range) is
        released at once, not verified."""
        todo: list[tuple[LoadRecord, int, int, range]] = []  # record, segment, n, segments
        for r in records:
            expected = r.expected
            if expected is None:
                continue
            dg = expected.digest
            if dg.algorithm != ALGORITHM or dg.signature != self.signature:
                logger.debug("kvtail: %s: digest of another algorithm or layout", r.req_id)
                self._verdicts[r.req_id] = UNVERIFIED
                continue
            segments = _inside(dg.segment, expected.num_tokens, r.num_local, r.num_loaded)
            if not segments:
                self._verdicts[r.req_id] = UNVERIFIED
                continue
            todo.append((r, dg.segment, expected.num_tokens, segments))
        for segment, batch in _by_segment(todo, lambda t: t[1]):
            spans = []
            for r, _, n, segs in batch:
                lo, hi = segs.start * segment, min(segs.stop * segment, n)
                spans.append([self._span(r, g, lo, hi) for g in self.group_ids])
            pending = self._digester(segment, producer=False).digest(spans)
            results = _memo(pending)
            for i, (r, _, _, segs) in enumerate(batch):
                self._held[r.req_id] = _Check(
                    r, functools.partial(_row, results, i), pending.event, segs
                )

    def release(self) -> tuple[set[str], set[str]]:
        """``(finished, mismatched)``: held loads whose sums reached the host
        (after :data:`~kvtail_connector.features.consumer_tails.hold.MAX_PASSES` passes,
        waited for), compared; a mismatch is logged and goes in both sets,
        as vLLM's ``failed_recving`` contract has it."""
        finished: set[str] = set()
        bad: set[str] = set()
        for req_id, check in self._held.items():
            check.passes += 1
            if check.event is not None and not check.event.query():
                if check.passes < MAX_PASSES:
                    continue
                check.event.synchronize()
            finished.add(req_id)
            verdict = self._compare(check)
            self._verdicts[req_id] = verdict
            if verdict == MISMATCH:
                bad.add(req_id)
        # Removed only once every one is compared: if a comparison raises,
        # every load is still held, for the caller's fallback (drop_held).
        for req_id in finished:
            del self._held[req_id]
        self._unreported.update(finished)
        return finished, bad

    def reported(self) -> None:
        """What :meth:`release` returned has reached vLLM."""
        self._unreported.clear()

    def drop_held(self) -> set[str]:
        """Forget every held load, uncompared (after a contained internal
        error: the caller reports them failed); returns their ids, and those
        released since the last :meth:`reported` (never returned to vLLM)."""
        held = set(self._held)
        for check in self._held.values():
            if check.event is not None:
                check.event.synchronize()  # the digest kernel read the blocks
        self._held.clear()
        held |= self._unreported
        self._unreported.clear()
        for req_id in held:
            self._verdicts[req_id] = UNVERIFIED
        return held

    def take_verdicts(self) -> dict[str, str]:
        verdicts, self._verdicts = self._verdicts, {}
        return verdicts

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._held

    @property
    def held(self) -> set[str]:
        """Loads whose completion waits for their digest."""
        return set(self._held)

    @property
    def num_tracked(self) -> int:
        return len(self._held) + len(self._verdicts)

    # --------------------------------------------------------------- helpers

    def _digester(self, segment: int, *, producer: bool) -> KVDigester:
        """Digesters per segment size; a producer's counts each replicated
        head once, a consumer's every head it holds (each rank compares its own)."""
        key = (segment, producer)
        digester = self._digesters.get(key)
        if digester is None:
            groups = []
            for s in self._sets:
                local = max(
                    (1 if isinstance(c, RegionCache) else int(c.shape[1]) for c in s.caches),
                    default=1,
                )
                offset, counted = self.placement.heads(local)
                groups.append(
                    DigestGroup(
                        s.caches,
                        s.pages_per_block,
                        group_id=s.group_id,
                        head_offset=offset,
                        counted_heads=counted if producer else None,
                    )
                )
            digester = self._digesters[key] = KVDigester(groups, segment=segment)
        return digester

    def _span(self, record: LoadRecord, group: int, start: int, end: int) -> GroupSpan | None:
        """Tokens ``[start, end)`` of ``record`` in ``group``, or None where the
        record does not write that group or a block of the range is null."""
        for load in record.groups:
            if load.group != group:
                continue
            ids = [0] * load.first_block + list(load.block_ids)
            eb = record_block_tokens(self._sets, group)
            if (
                eb == 0
                or -(-end // eb) > len(ids)
                or NULL_BLOCK in ids[start // eb : -(-end // eb)]
            ):
                return None
            return GroupSpan(ids, start, end)
        return None

    def _sums(self, results: Any, index: int) -> entry.Sums:
        out: entry.Sums = {}
        for gid, digest in zip(self.group_ids, results()[index], strict=True):
            if digest is not None:
                out[gid] = {h: tuple(row) for h, row in digest.by_head().items()}
        return out

    def _compare(self, check: _Check) -> str:
        record = check.record
        expected = record.expected
        assert expected is not None
        theirs_by_group = expected.digest.sums
        n_seg = -(-expected.num_tokens // expected.digest.segment)
        compared = 0
        first_bad: tuple[int, int, int] | None = None
        bad = 0
        for gid, mine in zip(self.group_ids, check.result(), strict=True):
            theirs = theirs_by_group.get(gid)
            if mine is None or theirs is None:
                continue
            for k, head in enumerate(mine.heads):
                row = theirs.get(head)
                if row is None or len(row) != n_seg:
                    logger.debug(
                        "kvtail: %s: the producer's digest lacks head %d", record.req_id, head
                    )
                    if first_bad is not None:
                        break  # a difference found already stands
                    return UNVERIFIED
                for s in check.segments:
                    compared += 1
                    if int(mine.sums[k, s]) != row[s]:
                        bad += 1
                        if first_bad is None:
                            first_bad = (gid, head, s)
        if first_bad is not None:
            gid, head, s = first_bad
            segment = expected.digest.segment
            logger.warning(
                "KVTailConnector: request %s: the loaded KV differs from what the producer "
                "digested: KV cache group %d, KV head %d, tokens [%d, %d) (%d of %d segment "
                "sum(s) differ); reporting the load failed (kv_load_failure_policy applies)",
                record.req_id,
                gid,
                head,
                s * segment,
                min((s + 1) * segment, expected.num_tokens),
                bad,
                compared,
            )
            return MISMATCH
        return VERIFIED if compared else UNVERIFIED


def record_block_tokens(sets: Sequence[CacheSet], group: int) -> int:
    """Tokens of one manager block of ``group`` on this rank (0: not digested)."""
    for s in sets:
        if s.group_id == group and s.caches:
            return s.pages_per_block * cache_slots(s.caches[0])
    return 0


def _inside(segment: int, num_tokens: int, start: int, end: int) -> range:
    """Segments of a ``num_tokens`` digest lying entirely inside ``[start, end)``."""
    first = -(-start // segment)
    # The last segment ends at num_tokens, every other one at a multiple of segment.
    last = -(-num_tokens // segment) if num_tokens <= end else end // segment
    return range(first, max(first, last))


def _by_segment(items: Iterable[_T], segment_of: Callable[[_T], int]) -> list[tuple[int, list[_T]]]:
    groups: dict[int, list[_T]] = {}
    for item in items:
        groups.setdefault(segment_of(item), []).append(item)
    return list(groups.items())


def _memo(pending: PendingDigest) -> Any:
    return functools.cache(pending.result)


def _row(results: Any, index: int) -> Any:
    return results()[index]


def _signature(sets: Sequence[CacheSet], tp_size: int) -> str:
    """What the sums are keyed on, TP- and block-size-independent for
    ``[B, H, N, C]`` views (group, layers, words per head, dtype), the whole
    page description for region caches."""
    parts = []
    for s in sets:
        parts.append(f"g{s.group_id}:{len(s.caches)}")
        for c in s.caches:
            if isinstance(c, RegionCache):
                regions = [(r.slot_bytes, r.first_slot, r.n_slots, r.slot_step) for r in c.regions]
                parts.append(f"r:{c.slots_per_page}:{tp_size}:{c.tensor.dtype}:{regions}")
            else:
                parts.append(f"v:{c.dtype}:{int(c.shape[3])}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
