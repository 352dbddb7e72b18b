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

Page layouts described as regions, and how TP keys heads: :mod:`placement`
(:class:`HeadPlacement`, :func:`signature`); the consumer's check of one load:
:mod:`load_checks`.
"""

from __future__ import annotations

import functools
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
from kvtail_connector.extras.kv_verification.load_checks import (
    LoadCheck,
    PlannedLoad,
    compare,
    inside,
)
from kvtail_connector.extras.kv_verification.placement import HeadPlacement, signature
from kvtail_connector.extras.metadata import UNVERIFIED, CheckedLoad, Compared, DigestPart
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
class PlannedPrompt:
    """A producer's prompt, ready to digest (:meth:`RankDigests.plan_prompts`)."""

    record: CheckedLoad
    segment: int
    spans: tuple[GroupSpan | None, ...]  # per digested group


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
        self.signature = signature(self._sets, self.placement)
        # Loads planned at bind, until they complete (bounded: a plan that was
        # pushed out is made again at completion).
        self._planned: OrderedDict[str, PlannedLoad] = OrderedDict()
        self._digesters: dict[tuple[int, bool], KVDigester] = {}
        self._checks: HeldChecks[LoadCheck] = HeldChecks(self._compare)
        self._told_layout = False  # the WARNING below, once per rank

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
                    LoadCheck(load, functools.partial(_row, results, i), pending.event),
                )

    def _plan_load(self, r: CheckedLoad) -> PlannedLoad:
        expected = r.expected
        assert expected is not None
        dg = expected.digest
        if dg.algorithm != ALGORITHM or dg.signature != self.signature:
            if not self._told_layout:
                # Every load from such a producer is skipped: say so once, not
                # only in a counter (digests_skipped).
                self._told_layout = True
                logger.warning(
                    "KVTailConnector: verify_kv: a producer's digest is keyed for another "
                    "layout (another digest algorithm, other page layers, or another TP on a "
                    "page layout without per-head views, e.g. CPU attention); loads from it are "
                    "not verified (vllm:kvtail_digests_skipped_total counts them)"
                )
            logger.debug("kvtail: %s: digest of another algorithm or layout", r.req_id)
            return PlannedLoad(r, UNVERIFIED)
        segments = inside(dg.segment, expected.num_tokens, r.num_local, r.num_loaded)
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

    def take_differs(self) -> dict[str, str]:
        return self._checks.take_differs()

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

    def _compare(self, check: LoadCheck) -> Compared:
        """:func:`compare` over this rank's groups, naming heads as :meth:`_head_name` does."""
        return compare(check, self.group_ids, self._head_name)


def record_block_tokens(sets: Sequence[CacheSet], group: int) -> int:
    """Tokens of one manager block of ``group`` on this rank (0: not digested)."""
    for s in sets:
        if s.group_id == group and s.caches:
            return s.pages_per_block * cache_slots(s.caches[0])
    return 0


_MAX_PLANNED = 4096


def _by_segment(items: Iterable[_T], segment_of: Callable[[_T], int]) -> list[tuple[int, list[_T]]]:
    groups: dict[int, list[_T]] = {}
    for item in items:
        groups.setdefault(segment_of(item), []).append(item)
    return list(groups.items())


def _row(results: Any, index: int) -> Any:
    return results()[index]
