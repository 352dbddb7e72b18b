"""Which global KV heads a rank's digest sums are keyed on (:class:`HeadPlacement`)
and the signature of what they are keyed on (:func:`signature`), for
:class:`~kvtail_connector.extras.kv_verification.rank_digests.RankDigests`.

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

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvtail_connector.core.cache_sets import CacheSet
from kvtail_connector.ops import RegionCache


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
        every rank counted, and :func:`signature` says so, so that such sums
        compare only between P and D at the same TP."""
        if local != self.heads_per_rank:
            return self.tp_rank * local, None
        return self.heads(local)


def signature(sets: Sequence[CacheSet], placement: HeadPlacement) -> str:
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
