"""A consumer's check of one load (``verify_kv: digest``): its plan
(:class:`PlannedLoad`), its digest on the way to the host (:class:`LoadCheck`),
the segments it compares (:func:`inside`) and its verdict (:func:`compare`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtail_connector.extras.metadata import MISMATCH, UNVERIFIED, VERIFIED, CheckedLoad, Compared
from kvtail_connector.extras.ops.digest.launcher import GroupSpan
from kvtail_connector.log import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class PlannedLoad:
    """A consumer's load, ready to digest and compare (``RankDigests.plan_loads``);
    ``verdict`` is set where it cannot be compared (nothing to digest)."""

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
class LoadCheck:
    """A consumer's digest of one load, on its way to the host."""

    load: PlannedLoad
    result: Any  # () -> the digester's per-group results of this request
    event: Any  # CUDA event behind the read-back, or None
    passes: int = 0

    @property
    def record(self) -> CheckedLoad:
        return self.load.record


def inside(segment: int, num_tokens: int, start: int, end: int) -> range:
    """Segments of a ``num_tokens`` digest lying entirely inside ``[start, end)``."""
    first = -(-start // segment)
    # The last segment ends at num_tokens, every other one at a multiple of segment.
    last = -(-num_tokens // segment) if num_tokens <= end else end // segment
    return range(first, max(first, last))


def compare(
    check: LoadCheck, group_ids: Sequence[int], head_name: Callable[[int, int], str]
) -> Compared:
    """VERIFIED, MISMATCH (any compared segment differs; ``differs`` names
    the first) or UNVERIFIED (nothing compared, or a head of ours lacks in
    the producer's sums and nothing differs)."""
    load = check.load
    record = load.record
    lo, hi = load.segments.start, load.segments.stop
    compared = bad = 0
    missing = False
    first_bad: tuple[int, int, int] | None = None
    for gid, mine, theirs in zip(group_ids, check.result(), load.theirs, strict=True):
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
        differs = (
            f"KV cache group {gid}, {head_name(gid, head)}, tokens "
            f"[{s * segment}, {min((s + 1) * segment, expected.num_tokens)}) "
            f"({bad} of {compared} segment sum(s) on this rank differ)"
        )
        logger.debug("kvtail: %s: %s", record.req_id, differs)
        return Compared(MISMATCH, differs)
    if missing:
        logger.debug("kvtail: %s: the producer's digest lacks a head", record.req_id)
        return Compared(UNVERIFIED)
    return Compared(VERIFIED if compared else UNVERIFIED)
