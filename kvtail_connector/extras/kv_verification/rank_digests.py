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

Host cost: what a request needs is planned where its record arrives
(:meth:`RankDigests.plan_prompts` and :meth:`RankDigests.plan_loads`, from
the worker's ``bind_connector_metadata``): its block ids as one numpy array
per group (the only step linear in the prompt's blocks, at C speed), its
token range, and on D the producer's sums as arrays. The hook and the
completion then cost O(1) Python per request and one launch per step; the
comparison is vectorized.

Sums are keyed by logical coordinates (``ops/digest/``): P and D may differ
in block ids, block size, page layout and TP. Covered: every KV cache group
with token tails held in one cache set of one slot per token; other groups
(several page splits, compressed states) and groups whose blocks a
sliding window dropped are not digested.

Page layouts described as regions (CPU attention, ROCm paged attention, the
fp8 indexer) have no per-head view: a rank's region cache is one head, keyed
by :meth:`HeadPlacement.heads` with one local head. Where TP shards the KV
heads that key is the group's head offset on this rank (the rank's index for
region caches alone) and its sums cover the rank's whole shard;
where TP replicates them (TP > KV heads: one real head per rank; MLA and its
indexer, one latent on every rank) it is the real global head, counted on its
lowest replica by P and compared on every replica by D. The signature carries
the page description and the real heads one key covers
(:attr:`HeadPlacement.heads_per_rank`), so region sums compare exactly between
P and D that key them alike: the same heads per rank (at more than one, the
same TP) and the same pages; any other pair is not verified, never a mismatch.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from kvtail_connector.core.cache_sets import CacheSet, cache_slots
from kvtail_connector.core.metadata import NULL_BLOCK
from kvtail_connector.extras import entry_values
from kvtail_connector.extras.kv_verification.held_checks import HeldChecks
from kvtail_connector.extras.metadata import (
    MISMATCH,
    UNVERIFIED,
    VERIFIED,
    CheckedLoad,
    DigestPart,
)
from kvtail_connector.extras.ops.digest.launcher import (
    ALGORITHM,
    DigestGroup,
    GroupSpan,
    KVDigester,
)
from kvtail_connector.log import get_logger
from kvtail_connector.ops import RegionCache

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

    @property
    def heads_per_rank(self) -> int:
        """Real KV heads each rank holds (vLLM: ``max(1, total // tp)``): what
        the one head of a region cache sums over."""
        return max(1, self.total_kv_heads // self.tp_size)

    def heads(self, local: int) -> tuple[int, list[int] | None]:
        """``(head_offset, counted_heads)`` of a cache with ``local`` heads on
        this rank. Heads replicated over ranks (TP > KV heads) are counted on
        their lowest replica only, so that the ranks' sums add up. vLLM gives
        each rank one KV head wherever TP exceeds them, so the offset there is
        that head's global index."""
        if self.tp_size <= self.total_kv_heads:
            return self.tp_rank * local, None
        replicas = self.tp_size // max(self.total_kv_heads, 1)
        return self.tp_rank // replicas, [0] if self.tp_rank % replicas == 0 else []

    def view_heads(self, local: int) -> tuple[int, list[int] | None]:
        """:meth:`heads` of a ``[B, H, N, C]`` view with ``local`` heads. A
        group whose layers hold other KV heads than the model's total (vLLM
        gives a rank ``max(1, heads // tp)`` of a layer's own heads; the model
        reports one total) cannot be keyed by global head from the model's
        count: its heads are keyed by rank instead, ``tp_rank * local + h``,
        every rank counted, and :func:`_signature` says so, so that such sums
        compare only between P and D at the same TP."""
        if local != self.heads_per_rank:
            return self.tp_rank * local, None
        return self.heads(local)


@dataclass(frozen=True)
class PlannedPrompt:
    """A producer's prompt, ready to digest (:meth:`RankDigests.plan_prompts`)."""

    record: CheckedLoad
    segment: int
    spans: tuple[GroupSpan | None, ...]  # per digested group


@dataclass(frozen=True)
class PlannedLoad:
    """A consumer's load, ready to digest and compare
    (:meth:`RankDigests.plan_loads`); ``verdict`` is set where it cannot be
    compared (nothing to digest)."""

    record: CheckedLoad
    verdict: str | None
    segment: int = 0
    segments: range = range(0)
    spans: tuple[GroupSpan | None, ...] = ()
    # Per digested group: the producer's sums of this rank's heads, uint64
    # [heads, segments], and which of those heads it sent (bool [heads]);
    # None where the producer sent none for the group.
    theirs: tuple[tuple[np.ndarray, np.ndarray] | None, ...] = ()


@dataclass
class _Check:
    """A consumer's digest of one load, on its way to the host."""

    load: PlannedLoad
    result: Any  # () -> the digester's per-group results of this request
    event: Any  # CUDA event behind the read-back, or None
    passes: int = 0

    @property
    def record(self) -> CheckedLoad:
        return self.load.record


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
            if len(sets) != 1 or sets[0].tokens_per_state != 1:
                excluded.append(gid)
                continue
            self._sets.append(sets[0])
        if excluded:
            logger.info(
                "KVTailConnector: verify_kv: KV cache group(s) %s not digested (several page "
                "splits or compressed states)",
                excluded,
            )
        self.group_ids = tuple(s.group_id for s in self._sets)
        self._block_tokens = {gid: record_block_tokens(self._sets, gid) for gid in self.group_ids}
        self.signature = _signature(self._sets, self.placement)
        # Loads planned at bind, until they complete (bounded: a plan that was
        # pushed out is made again at completion).
        self._planned: OrderedDict[str, PlannedLoad] = OrderedDict()
        self._digesters: dict[tuple[int, bool], KVDigester] = {}
        self._checks: HeldChecks[_Check] = HeldChecks(self._compare)

    def warmup(self) -> None:
        """Compile the digest kernel now (at registration, not in the first
        step that digests): the launches of every segment size and role share
        one binary. No cache byte is read; nothing to do off CUDA."""
        tensors = [getattr(c, "tensor", c) for s in self._sets for c in s.caches]
        if any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
            self._digester(entry_values.segment_for(0), producer=False).warmup()

    # -------------------------------------------------------------- producer

    def plan_prompts(self, records: Iterable[CheckedLoad]) -> list[PlannedPrompt]:
        """Plan the digest of tokens ``[0, num_loaded)`` of each producer record
        (at bind)."""
        return [
            PlannedPrompt(
                r,
                entry_values.segment_for(r.num_loaded),
                tuple(self._span(r, g, 0, r.num_loaded) for g in self.group_ids),
            )
            for r in records
        ]

    def digest_prompts(
        self, prompts: Sequence[PlannedPrompt | CheckedLoad]
    ) -> dict[str, DigestPart]:
        """Digest each prompt (planned, or a record planned now), one launch
        per segment size, on the current stream; the parts resolve when read."""
        planned = [
            p if isinstance(p, PlannedPrompt) else self.plan_prompts([p])[0] for p in prompts
        ]
        parts: dict[str, DigestPart] = {}
        for segment, batch in _by_segment(planned, lambda p: p.segment):
            pending = self._digester(segment, producer=True).digest([p.spans for p in batch])
            results = pending.result  # read once, when first needed
            for i, p in enumerate(batch):
                parts[p.record.req_id] = DigestPart(
                    ALGORITHM,
                    segment,
                    self.signature,
                    resolve=functools.partial(self._sums, results, i),
                )
        return parts

    # -------------------------------------------------------------- consumer

    def plan_loads(self, records: Iterable[CheckedLoad]) -> None:
        """Plan the check of each load whose producer sent a digest (at bind);
        :meth:`check_loads` uses the plan when the same record completes. A
        record whose plan fails is planned again (and fails) at completion."""
        for r in records:
            if r.expected is None:
                continue
            try:
                load = self._plan_load(r)
            except Exception:  # re-raised where it used to be: at completion
                continue
            self._planned[r.req_id] = load
            self._planned.move_to_end(r.req_id)
            if len(self._planned) > _MAX_PLANNED:
                self._planned.popitem(last=False)

    def forget_plans(self, req_ids: Iterable[str]) -> None:
        """Drop the plans of loads that completed without being checked."""
        planned = self._planned
        if planned:
            for req_id in req_ids:
                planned.pop(req_id, None)

    def check_loads(self, records: Iterable[CheckedLoad]) -> None:
        """Digest the received slots of completed loads whose producer sent a
        digest (``record.expected``), one launch per segment size, and hold
        them until :meth:`release`. A load that cannot be compared (another
        algorithm or signature, no whole segment inside the loaded range) is
        released at once, not verified."""
        todo: list[PlannedLoad] = []
        for r in records:
            if r.expected is None:
                continue
            load = self._planned.pop(r.req_id, None)
            if load is None or load.record is not r:
                load = self._plan_load(r)
            if load.verdict is not None:
                self._checks.decide(r.req_id, load.verdict)
                continue
            todo.append(load)
        for segment, batch in _by_segment(todo, lambda p: p.segment):
            pending = self._digester(segment, producer=False).digest([p.spans for p in batch])
            results = pending.result  # read once, when first needed
            for i, load in enumerate(batch):
                self._checks.hold(
                    load.record.req_id,
                    _Check(load, functools.partial(_row, results, i), pending.event),
                )

    def _plan_load(self, r: CheckedLoad) -> PlannedLoad:
        expected = r.expected
        assert expected is not None
        dg = expected.digest
        if dg.algorithm != ALGORITHM or dg.signature != self.signature:
            logger.debug("kvtail: %s: digest of another algorithm or layout", r.req_id)
            return PlannedLoad(r, UNVERIFIED)
        segments = _inside(dg.segment, expected.num_tokens, r.num_local, r.num_loaded)
        if not segments:
            return PlannedLoad(r, UNVERIFIED)
        n = expected.num_tokens
        lo, hi = segments.start * dg.segment, min(segments.stop * dg.segment, n)
        n_seg = -(-n // dg.segment)
        digester = self._digester(dg.segment, producer=False)
        theirs: list[tuple[np.ndarray, np.ndarray] | None] = []
        for g, gid in enumerate(self.group_ids):
            by_head = dg.sums.get(gid)
            if by_head is None:
                theirs.append(None)
                continue
            rows = [by_head.get(h) for h in digester.heads(g)]
            sent = np.array([row is not None and len(row) == n_seg for row in rows], dtype=bool)
            table = np.zeros((len(rows), n_seg), dtype=np.uint64)
            for k, row in enumerate(rows):
                if row is not None and len(row) == n_seg:
                    table[k] = row
            theirs.append((table, sent))
        return PlannedLoad(
            r,
            None,
            dg.segment,
            segments,
            tuple(self._span(r, g, lo, hi) for g in self.group_ids),
            tuple(theirs),
        )

    def release(self) -> tuple[set[str], set[str]]:
        """``(finished, mismatched)``: held loads whose sums reached the host,
        compared (:meth:`HeldChecks.release`); a mismatch is logged."""
        return self._checks.release()

    def reported(self) -> None:
        """What :meth:`release` returned has reached vLLM."""
        self._checks.reported()

    def drop_held(self) -> set[str]:
        """Forget every held load and plan, uncompared (after a contained
        internal error: the caller reports them failed); returns their ids,
        and those released since the last :meth:`reported`."""
        self._planned.clear()
        return self._checks.drop_held()

    def take_verdicts(self) -> dict[str, str]:
        return self._checks.take_verdicts()

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._checks

    @property
    def held(self) -> set[str]:
        """Loads whose completion waits for their digest."""
        return self._checks.held

    @property
    def busy(self) -> bool:
        """A load held or a verdict pending: a completion pass has work here
        even with nothing completing (plans wait for their own load's pass)."""
        return self._checks.busy

    def forget_all_plans(self) -> None:
        """Drop every plan (sleep mode: a missing plan is made at completion)."""
        self._planned.clear()

    @property
    def num_tracked(self) -> int:
        return self._checks.num_tracked + len(self._planned)

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
                regions = any(isinstance(c, RegionCache) for c in s.caches)
                placement = self.placement
                offset, counted = placement.heads(local) if regions else placement.view_heads(local)
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

    def _span(self, record: CheckedLoad, group: int, start: int, end: int) -> GroupSpan | None:
        """Tokens ``[start, end)`` of ``record`` in ``group``, or None where the
        record does not write that group or a block of the range is null."""
        eb = self._block_tokens.get(group, 0)
        for load in record.groups:
            if load.group != group:
                continue
            first, last = start // eb if eb else 0, -(-end // eb) if eb else 0
            if eb == 0 or last > load.first_block + len(load.block_ids):
                return None
            ids = np.array(load.block_ids, dtype=np.int64)
            if (ids[first - load.first_block : last - load.first_block] == NULL_BLOCK).any():
                return None
            return GroupSpan(ids, start, end, first_block=load.first_block)
        return None

    def _head_name(self, group: int, head: int) -> str:
        """What a sum's head key names, for messages: a KV head, or where a
        region page holds several, this rank's heads."""
        per_rank = self.placement.heads_per_rank
        caches = next(s.caches for s in self._sets if s.group_id == group)
        if per_rank > 1 and any(isinstance(c, RegionCache) for c in caches):
            first = self.placement.tp_rank * per_rank
            return f"KV heads {first}-{first + per_rank - 1} (digested as one page)"
        return f"KV head {head}"

    def _sums(self, results: Any, index: int) -> entry_values.Sums:
        out: entry_values.Sums = {}
        for gid, digest in zip(self.group_ids, results()[index], strict=True):
            if digest is not None:
                out[gid] = {h: tuple(row) for h, row in digest.by_head().items()}
        return out

    def _compare(self, check: _Check) -> str:
        """VERIFIED, MISMATCH (any compared segment differs, logged) or
        UNVERIFIED (nothing compared, or a head of ours lacks in the
        producer's sums and nothing differs)."""
        load = check.load
        record = load.record
        lo, hi = load.segments.start, load.segments.stop
        compared = bad = 0
        missing = False
        first_bad: tuple[int, int, int] | None = None
        for gid, mine, theirs in zip(self.group_ids, check.result(), load.theirs, strict=True):
            if mine is None or theirs is None:
                continue
            table, sent = theirs
            differ = mine.sums[:, lo:hi] != table[:, lo:hi]
            if not sent.all():  # only the heads the producer sent are compared
                missing = True
                differ &= sent[:, None]
            compared += int(sent.sum()) * (hi - lo)
            if differ.any():
                bad += int(differ.sum())
                if first_bad is None:
                    k, s = np.argwhere(differ)[0]
                    first_bad = (gid, mine.heads[int(k)], lo + int(s))
        if first_bad is not None:
            gid, head, s = first_bad
            expected = record.expected
            assert expected is not None
            segment = load.segment
            logger.warning(
                "KVTailConnector: request %s: the loaded KV differs from what the producer "
                "digested: KV cache group %d, %s, tokens [%d, %d) (%d of %d segment "
                "sum(s) differ); reporting the load failed (kv_load_failure_policy applies)",
                record.req_id,
                gid,
                self._head_name(gid, head),
                s * segment,
                min((s + 1) * segment, expected.num_tokens),
                bad,
                compared,
            )
            return MISMATCH
        if missing:
            logger.debug("kvtail: %s: the producer's digest lacks a head", record.req_id)
            return UNVERIFIED
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


_MAX_PLANNED = 4096


def _by_segment(items: Iterable[_T], segment_of: Callable[[_T], int]) -> list[tuple[int, list[_T]]]:
    groups: dict[int, list[_T]] = {}
    for item in items:
        groups.setdefault(segment_of(item), []).append(item)
    return list(groups.items())


def _row(results: Any, index: int) -> Any:
    return results()[index]


def _signature(sets: Sequence[CacheSet], placement: HeadPlacement) -> str:
    """What the sums are keyed on, TP- and block-size-independent for
    ``[B, H, N, C]`` views (group, layers, words per head, dtype) whose heads
    are the model's (else the TP size and local heads too: keyed by rank, see
    :meth:`HeadPlacement.view_heads`); for region caches the whole page
    description and the real KV heads their one key sums over (above one, a key
    is a TP rank's shard: equal only at equal TP)."""
    heads_per_rank = placement.heads_per_rank
    parts = []
    for s in sets:
        parts.append(f"g{s.group_id}:{len(s.caches)}")
        for c in s.caches:
            if isinstance(c, RegionCache):
                regions = [(r.slot_bytes, r.first_slot, r.n_slots, r.slot_step) for r in c.regions]
                parts.append(f"r:{c.slots_per_page}:{heads_per_rank}:{c.tensor.dtype}:{regions}")
            else:
                local = int(c.shape[1])
                by_rank = f":tp{placement.tp_size}:h{local}" if local != heads_per_rank else ""
                parts.append(f"v:{c.dtype}:{int(c.shape[3])}{by_rank}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
