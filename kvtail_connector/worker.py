"""Worker side: zero a load's stale tail when the inner connector reports it done.

The wrapper's ``get_transfer_results`` asks the inner connector, then zeroes
the tails of every request reported in ``finished_recving`` (not failed) on
the current stream, in one launch, *before* returning. The scheduler cannot
promote, free, reuse or CoW-copy those blocks before it has seen that result.
What that orders after the zeroing:

- every reader on the compute stream (the request's forward, CoW copies, a new
  owner's forward), on both model runners;
- transfers the inner connector starts in ``start_load_kv``: the wrapper's
  fence waits for earlier zeroing first;
- on the V1 runner everything else too: its connector hooks run before
  sampling, and the scheduler reads the step's output after it. The V2 runner
  copies the output before ``post_forward``, so the scheduler may act on a
  completion while its zeroing is still queued; where a new owner's KV can
  arrive without ``start_load_kv`` (MoRIIO WRITE, started by the consumer's
  scheduler) completions are held until their zeroing has executed
  (:mod:`~kvtail_connector.completion_hold`), and loads whose request was
  aborted in flight are not zeroed at all (see :meth:`TailWorker.on_transfer_results`).

Loads whose producer vouched for a clean tail (``LoadRecord.vouched``) are not
zeroed; with ``probe_stale_tails`` they are checked, and zeroed where the
check finds bytes (the canary).

On a producer the worker zeroes the tails of the remote-decode prompts that
complete in the step, in the hook ``TailPolicy.producer_hook`` names, and
reports which it zeroed in :class:`~kvtail_connector.metadata.KVTailWorkerMeta`.

With ``verify_kv: digest`` (:mod:`~kvtail_connector.kv_digests`) a producer
also digests those prompts in that hook, and a consumer digests each completed
load that came with the producer's digest, holding it out of
``finished_recving`` until the comparison and reporting a mismatch in
``failed_recving``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvtail_connector.cache_sets import CacheSet, TailBytes, cache_sets
from kvtail_connector.completion_hold import CompletionHold
from kvtail_connector.kv_digests import HeadPlacement, RankDigests
from kvtail_connector.kvgroups import GroupInfo
from kvtail_connector.load_errors import LoadErrorLedger
from kvtail_connector.log import get_logger
from kvtail_connector.metadata import (
    NULL_BLOCK,
    DigestPart,
    KVTailMetadata,
    KVTailWorkerMeta,
    LoadRecord,
)
from kvtail_connector.ops import reference_zero_kv_blocks
from kvtail_connector.ops.zero._step_zeroer import StepZeroer
from kvtail_connector.ops.zero.plan import Line
from kvtail_connector.policy import TailPolicy
from kvtail_connector.probe import probe_items
from kvtail_connector.read_tails import LayerWork, ReadTailsByLayer
from kvtail_connector.stats import KVTailStats
from kvtail_connector.tails import first_stale_slot, tail_block

logger = get_logger(__name__)


@dataclass(frozen=True)
class RankPlacement:
    """Where this worker sits in decode context parallelism."""

    dcp_rank: int = 0
    dcp_world_size: int = 1
    interleave: int = 1


@dataclass(frozen=True)
class _Zeroing:
    """Kernel work lines for one request, and the bytes they zero."""

    owner: str
    lines: list[Line]
    nbytes: int


@dataclass(frozen=True)
class _Pending:
    """A load in flight: its record and its tails, encoded when it arrived."""

    record: LoadRecord
    tails: _Zeroing | None  # None: no caches registered when it arrived


@dataclass(frozen=True)
class _SetInfo:
    index: int  # zeroer group
    tokens_per_state: int | Fraction


class TailWorker:
    """The wrapper's worker-side state around the inner connector.

    Args:
        groups: tail facts per KV cache group.
        placement: this rank's DCP placement.
        policy: what this worker zeroes, probes and holds (see
            :class:`~kvtail_connector.policy.TailPolicy`).
        counts_requests: this rank reports the per-request counters
            (``tails_zeroed``, ``probed_tails``): one rank per request, since
            vLLM sums every worker's stats. Byte counts come from every rank.
        rank: this worker's rank among the engine's workers (its producer
            confirmations are counted by id).
        stats: the counters this side reports.
        heads: this rank's TP placement of the KV heads (``verify_kv``).
    """

    def __init__(
        self,
        groups: tuple[GroupInfo, ...],
        placement: RankPlacement,
        policy: TailPolicy,
        *,
        counts_requests: bool = True,
        rank: int = 0,
        stats: KVTailStats,
        heads: HeadPlacement | None = None,
    ) -> None:
        self._groups = groups
        self._placement = placement
        self._policy = policy
        self._stats = stats
        self._per_request = counts_requests
        self._rank = rank
        self._zeroer: StepZeroer | None = None
        self._sets: list[CacheSet] = []
        self._sets_of_group: dict[int, list[_SetInfo]] = {}
        self._loads: dict[str, _Pending] = {}
        self._tail_bytes = TailBytes((), ())
        self._read_loads: list[LoadRecord] = []
        self._by_layer: ReadTailsByLayer | None = None
        self._layer_probe: dict[str, list[int]] = {}  # per request, summed over layers
        self._errors = LoadErrorLedger()
        # Loads in flight whose request vLLM has already finished (aborted).
        self._abandoned: set[str] = set()
        self._hold = CompletionHold() if policy.hold_completions else None
        self._last_zeroing: torch.cuda.Event | None = None
        # Producer: this step's prompt tails, and those zeroed in the hook.
        self._producer_tails: list[LoadRecord] = []
        self._producer_zeroed: list[str] = []
        # verify_kv: the digest groups; a producer's prompts to digest in the
        # hook and their sums, on their way to this step's worker metadata.
        self._heads = heads or HeadPlacement()
        self._digests: RankDigests | None = None
        self._producer_digest_records: list[LoadRecord] = []
        self._producer_parts: dict[str, DigestPart] = {}
        # Consumer: requests whose vouched tail the probe found non-zero, on
        # their way to this step's worker metadata (counted once per request
        # on the scheduler side, whichever rank found them).
        self._false_vouches: list[str] = []
        # Sleep mode: what unregister_kv_caches put away (None: registered).
        self._released: tuple[Any, Any, Any] | None = None
        # Loads to report failed when they complete: their record was lost to
        # a contained internal error (here or on the scheduler side), or they
        # completed while the KV caches were released.
        self._failing: set[str] = set()

    # ------------------------------------------------------------ lifecycle

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, Any],
        kv_cache_config: Any,
        layer_objects: Mapping[str, Any] | None = None,
    ) -> None:
        self._released = None  # new caches supersede any put away by sleep mode
        if not self._policy.needs_caches:
            return
        self._sets = cache_sets(kv_caches, kv_cache_config, self._groups, layer_objects)
        if not self._sets:
            logger.info("KVTailConnector: no attention cache with token tails on this worker")
            return
        self._zeroer = StepZeroer([(s.caches, s.pages_per_block) for s in self._sets])
        self._sets_of_group = {}
        for i, s in enumerate(self._sets):
            self._sets_of_group.setdefault(s.group_id, []).append(_SetInfo(i, s.tokens_per_state))
        self._tail_bytes = TailBytes.of(self._sets)
        self._zeroer.warmup()
        if self._policy.digest_prompts or self._policy.verify_loads:
            self._digests = RankDigests(self._sets, self._heads)
        if self._policy.read_tails_by_layer:
            self._by_layer = ReadTailsByLayer(self._sets)
            self._by_layer.zeroer.warmup()
        logger.info(
            "KVTailConnector: zeroing tails on %s (%s%s): %d layer(s) in %d set(s), "
            "DCP rank %d/%d, interleave %d",
            self._zeroer.device,
            self._zeroer.implementation,
            ", CUDA graphs" if self._zeroer.uses_graphs else "",
            sum(len(s.caches) for s in self._sets),
            len(self._sets),
            self._placement.dcp_rank,
            self._placement.dcp_world_size,
            self._placement.interleave,
        )

    def unregister_kv_caches(self) -> None:
        """Sleep mode released the KV memory: launch nothing until restored.

        Idempotent, as vLLM 0.33 needs: ``release_kv_cache_memory()`` (or
        ``discard(("kv_cache",))``) unregisters, a later ``sleep()``
        unregisters again, and ``wake_up()`` restores once."""
        if self._released is None:
            self._released = (self._zeroer, self._by_layer, self._digests)
            self._zeroer = self._by_layer = self._digests = None

    def restore_kv_caches(self) -> None:
        """Undo :meth:`unregister_kv_caches`; a no-op when registered."""
        if self._released is not None:
            self._zeroer, self._by_layer, self._digests = self._released
            self._released = None

    @property
    def caches_released(self) -> bool:
        return self._released is not None

    def bind(self, meta: KVTailMetadata) -> None:
        """Keep this step's new loads, their tails encoded for the launch now,
        so completion costs a concatenation and a launch."""
        if meta.failing:
            self._failing.update(meta.failing)
        # First: a READ cannot be reported failed and vLLM no longer zeroes its
        # blocks, so a failure below (contain_bind) must not lose its tail.
        self._read_loads.extend(meta.read_loads)
        for record in meta.loads:
            # Without registered caches (profiling, sleep mode) the lines are
            # built at completion instead.
            tails = self._zeroing(record.req_id, self._tail_items(record)) if self._zeroer else None
            self._loads[record.req_id] = _Pending(record, tails)
            self._abandoned.discard(record.req_id)  # a new load of a reused id
            self._errors.track(
                record.req_id, (b for g in record.groups for b in g.block_ids if b != NULL_BLOCK)
            )
        self._producer_tails.extend(meta.producer_tails)
        self._producer_digest_records.extend(meta.producer_digests)

    def zero_producer_tails(self) -> None:
        """The producer hook (``policy.producer_hook``): zero the slots past each
        completing remote-decode prompt in its last block, on the current
        stream, after the step's forward and before its output; each request
        zeroed here is confirmed in this step's worker metadata. Without
        registered caches (sleep mode) nothing is zeroed and nothing confirmed.

        With ``verify_kv: digest``, then digests those prompts' tokens (after
        the zeroing, which writes only slots past them), without waiting."""
        records, self._producer_tails = self._producer_tails, []
        if records and self._zeroer is not None:
            batches = [self._zeroing(r.req_id, self._tail_items(r)) for r in records]
            # Not probed: the counters say what consumers received.
            self._zero(batches, counter="producer_tail_bytes_zeroed", probe=False)
            self._producer_zeroed.extend(r.req_id for r in records)
        digests, self._producer_digest_records = self._producer_digest_records, []
        if digests and self._digests is not None:
            self._producer_parts.update(self._digests.digest_prompts(digests))

    def worker_meta(self, inner: Any) -> Any:
        """This step's ``build_connector_worker_meta``: the inner connector's,
        wrapped with the producer tails this rank zeroed (every step where the
        policy vouches or digests, so every rank's metadata aggregates alike),
        with this rank's digests and verdicts (``verify_kv``). Digest sums are
        read from the device only when the scheduler side reads them, or when
        the metadata is pickled to reach it."""
        if not self._policy.reports_worker_meta:
            return inner
        if self._producer_tails:
            # Bound this step but the hook never ran: not zeroed, not confirmed.
            logger.debug("kvtail: %d producer tail(s) not zeroed", len(self._producer_tails))
            self._producer_tails = []
        if self._producer_digest_records:
            logger.debug(
                "kvtail: %d producer prompt(s) not digested", len(self._producer_digest_records)
            )
            self._producer_digest_records = []
        zeroed, self._producer_zeroed = self._producer_zeroed, []
        parts, self._producer_parts = self._producer_parts, {}
        verdicts = self._digests.take_verdicts() if self._digests is not None else {}
        false = frozenset(self._false_vouches) if self._false_vouches else frozenset()
        self._false_vouches.clear()
        mine = frozenset({self._rank})
        return KVTailWorkerMeta(
            inner=inner,
            confirmed=dict.fromkeys(zeroed, mine),
            ranks=mine,
            digests=parts,
            verdicts=verdicts,
            false_vouches=false,
        )

    # ------------------------------------------------- contained failures
    # The fallbacks the facade runs after an internal error in a hook
    # (kvtail_connector.containment): minimal, and never half a claim.

    def contain_bind(self, meta: KVTailMetadata) -> None:
        """``bind`` failed: this step's async loads are reported failed when
        they complete; its READ loads, kept first by ``bind``, are zeroed as
        usual; its producer records are neither zeroed nor confirmed (no
        claim: the consumer zeroes as after a plain producer)."""
        for record in meta.loads:
            self._failing.add(record.req_id)
            self._loads.pop(record.req_id, None)
            self._errors.release(record.req_id)
        self._drop_producer_work()

    def contain_producer(self) -> None:
        """The producer hook failed: nothing of this step is confirmed."""
        self._drop_producer_work()

    def contain_worker_meta(self, inner: Any) -> Any:
        """``worker_meta`` failed: no confirmation, digest or verdict from this
        rank this step (no claim made; loads count as not verified)."""
        self._drop_producer_work()
        if not self._policy.reports_worker_meta:
            return inner
        return KVTailWorkerMeta(inner=inner, ranks=frozenset({self._rank}))

    @property
    def read_loads(self) -> list[LoadRecord]:
        """The READ loads bound this step (``reads_started`` replaces the list)."""
        return self._read_loads

    def contain_load_errors(self) -> set[int]:
        """``take_load_errors`` failed: the ids fetched so far, unattributed."""
        return self._errors.drain()

    def contain_reads(self, records: list[LoadRecord], landed: bool) -> None:
        """``reads_started`` failed. Where every READ has landed (``landed``),
        zero the records' tails now, before the forward, on the reference path
        (slow, exact, independent of the zeroer's kernels and work lines);
        otherwise a READ may still land over a zeroing, so nothing is zeroed
        (the ERROR says so). Forget this step's READ work either way, armed
        or staged per layer too: left there, a later step would zero these
        tails over KV written since."""
        self._read_loads = []
        if self._by_layer is not None:
            self._by_layer.reset()
        if not landed or self._released is not None:
            logger.error(
                "KVTailConnector: READ tails of %s not zeroed (reads not landed yet)",
                ", ".join(r.req_id for r in records),
            )
            return
        for record in records:
            for index, block, first in self._tail_items(record):
                cache_set = self._sets[index]
                reference_zero_kv_blocks(
                    cache_set.caches,
                    tails=[(block, first)],
                    pages_per_block=cache_set.pages_per_block,
                )

    def contain_end_step(self) -> None:
        """``end_step`` failed: drop the per-layer READ work left (never zeroed
        in a later step, over KV written since); the ERROR names its requests."""
        by_layer = self._by_layer
        self._layer_probe = {}
        if by_layer is None:
            return
        left = by_layer.owners_pending()
        by_layer.reset()
        if left:
            logger.error(
                "KVTailConnector: READ tails of %s not zeroed (after the forward)",
                ", ".join(sorted(left)),
            )

    def _drop_producer_work(self) -> None:
        self._producer_tails = []
        self._producer_zeroed = []
        self._producer_digest_records = []
        self._producer_parts = {}

    def fence(self) -> None:
        """Before the inner connector starts a load, earlier zeroing has executed.

        A transfer that bypasses the stream (RDMA) into a block freed and
        reallocated since could otherwise land before a zeroing of that block
        enqueued in an earlier step.
        """
        event = self._last_zeroing
        if event is not None and not event.query():
            event.synchronize()

    @property
    def has_read_loads(self) -> bool:
        """READ loads bound this step wait for ``reads_started``."""
        return bool(self._read_loads)

    def held_requests(self) -> int:
        """Requests this worker holds state for (the ``held_requests`` gauge)."""
        held = (
            self._loads.keys()
            | {r.req_id for r in self._read_loads}
            | {r.req_id for r in self._producer_tails}
        )
        if self._by_layer is not None:
            held |= self._by_layer.owners_pending()
        if self._digests is not None:
            held |= self._digests.held
        return len(held) + (len(self._hold) if self._hold is not None else 0)

    @property
    def num_tracked(self) -> int:
        """Loads (and layers with READ tails) this worker still holds (0 when
        idle: the leak check)."""
        waiting_layers = self._by_layer.num_pending if self._by_layer is not None else 0
        held = len(self._hold) if self._hold is not None else 0
        return (
            len(self._loads)
            + len(self._read_loads)
            + waiting_layers
            + self._errors.num_tracked
            + len(self._abandoned)
            + held
            + len(self._producer_tails)
            + len(self._producer_zeroed)
            + len(self._producer_digest_records)
            + len(self._producer_parts)
            + len(self._false_vouches)
            + len(self._failing)
            + (self._digests.num_tracked if self._digests is not None else 0)
        )

    # ------------------------------------------------------------ completion

    def take_load_errors(self, inner: Any) -> set[int]:
        """The runner's ``get_block_ids_with_load_errors``: the inner connector's
        ids (some fetched earlier, in ``on_transfer_results``), each kept only
        for the load in flight that writes the block."""
        return self._errors.take(inner)

    def transfer_results(
        self, results: KVConnectorTransferResults, finished_req_ids: set[str], inner: Any
    ) -> KVConnectorTransferResults:
        """The runner's ``get_transfer_results``: the inner connector's
        ``results``, after zeroing what completed, with completions held back
        while their zeroing has not executed (``hold_completions``) and,
        with ``verify_kv``, while their digest is not on the host."""
        if self._loads and finished_req_ids:
            self._abandoned.update(r for r in finished_req_ids if r in self._loads)
        zeroed: set[str] = set()
        if results.finished_recving:
            zeroed = self.on_transfer_results(
                results.finished_recving, results.failed_recving, inner
            )
        results = self._hold_zeroed(results, zeroed)
        digests = self._digests if self._policy.verify_loads else None
        if digests is not None:
            results = self._hold_digested(results, digests)
        if self._failing:
            results = self._report_failing(results, finished_req_ids)
        # Returned to vLLM: a later failed pass need not report these again
        # (until here, contain_transfer_results does).
        if self._hold is not None:
            self._hold.reported()
        if digests is not None:
            digests.reported()
        return results

    def _report_failing(
        self, results: KVConnectorTransferResults, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        """Loads in ``_failing`` that complete now go in ``failed_recving`` too
        (vLLM's contract: a failed load is also reported finished), so
        ``kv_load_failure_policy`` applies instead of a read of a tail nobody
        zeroed. A request that finished without completing a load is forgotten."""
        now = self._failing.intersection(results.finished_recving)
        self._failing.difference_update(now)
        if finished_req_ids:
            self._failing.difference_update(finished_req_ids)
        if not now:
            return results
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=set(results.failed_recving) | now,
        )

    def contain_transfer_results(
        self, results: KVConnectorTransferResults, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        """The fallback of :meth:`transfer_results` after an internal error:
        every completion of this pass, and every completion held back, is
        reported failed (nothing proves their tails zeroed or their digests
        compared), after the zeroing launched so far has executed (vLLM may
        hand the blocks to a new owner at once). So is every completion a
        hold released in this pass before it failed: nothing else would ever
        report it, and vLLM would wait for it forever (the holds keep them
        until told they were reported). State for them is dropped."""
        event = self._last_zeroing
        if event is not None:
            event.synchronize()
        done = set(results.finished_recving)
        if self._hold is not None:
            finished, _ = self._hold.drain()
            done |= finished
        if self._digests is not None:
            done |= self._digests.drop_held()
        done |= self._failing.intersection(results.finished_recving)
        for req_id in done:
            self._loads.pop(req_id, None)
            self._errors.release(req_id)
            self._abandoned.discard(req_id)
            self._failing.discard(req_id)
        if finished_req_ids:
            self._failing.difference_update(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=done,
            failed_recving=set(results.failed_recving) | done,
        )

    def _hold_zeroed(
        self, results: KVConnectorTransferResults, zeroed: set[str]
    ) -> KVConnectorTransferResults:
        hold = self._hold
        if hold is None or not (zeroed or len(hold)):
            return results
        if zeroed and self._last_zeroing is not None:
            hold.withhold(zeroed, results.failed_recving, self._last_zeroing)
        released, released_failed = hold.release()
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving={r for r in results.finished_recving if r not in hold} | released,
            failed_recving={r for r in results.failed_recving if r not in hold} | released_failed,
        )

    def _hold_digested(
        self, results: KVConnectorTransferResults, digests: RankDigests
    ) -> KVConnectorTransferResults:
        """Completions whose digest is on its way are held; those compared now
        are released, a mismatch as a failed load."""
        held = {r for r in results.finished_recving if r in digests}
        released, mismatched = digests.release()
        if not held and not released:
            return results
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=(set(results.finished_recving) - held) | released,
            failed_recving=(set(results.failed_recving) - held) | mismatched,
        )

    def on_transfer_results(
        self, finished_recving: Iterable[str], failed_recving: Iterable[str], inner: Any
    ) -> set[str]:
        """Zero the tails of completed loads (and failed loads' blocks) in one
        launch. Returns the requests it zeroed for.

        A load whose request vLLM finished (aborted) while it was in flight is
        not zeroed: nothing reads its blocks as that request's KV again (they
        were never cached: async loads cache their blocks only on a live
        completion), and every next owner of a block either has it zeroed by
        vLLM at allocation (models that need zeroing), writes the slots it
        reads, or is itself a load whose tail the wrapper zeroes at its own
        completion. Zeroing it anyway could land after a new owner's transfer
        that bypasses the worker's fence (MoRIIO WRITE) and wipe it.
        """
        if not self._loads:
            return set()
        # A completing load's invalid blocks arrive at the latest in this pass:
        # needed now, before the runner asks for them.
        self._errors.fetch(inner)
        failed = set(failed_recving)
        done = [p for p in (self._loads.pop(req, None) for req in finished_recving) if p]
        if not done:
            return set()
        batches: list[_Zeroing] = []
        vouched: list[_Zeroing] = []
        vouched_records: list[LoadRecord] = []
        checks: list[LoadRecord] = []  # verify_kv: loads to digest
        tails = 0  # requests
        released = self._released is not None
        for pending in done:
            record = pending.record
            invalid = _first_invalid(record, self._errors.release(record.req_id))
            if record.req_id in self._abandoned:
                self._abandoned.discard(record.req_id)
                logger.debug("kvtail: %s finished while loading: nothing to zero", record.req_id)
                continue
            if released:
                # The KV memory is released (sleep mode): nothing can be
                # zeroed or verified, and what the load wrote does not survive
                # wake-up (vLLM discards the KV cache; only weights are kept).
                self._failing.add(record.req_id)
                logger.warning(
                    "KVTailConnector: request %s: KV load completed while the KV cache was "
                    "released (sleep mode): reported failed",
                    record.req_id,
                )
                continue
            if record.expected is not None and record.req_id not in failed and invalid is None:
                checks.append(record)
            # Failures are counted once per request by the scheduler side.
            if record.req_id in failed or invalid is not None:
                if self._policy.zero_failed_loads:
                    items = self._failed_items(record, invalid)
                    batches.append(self._zeroing(record.req_id, items))
            elif self._policy.zero_tails:
                batch = pending.tails or self._zeroing(record.req_id, self._tail_items(record))
                if record.vouched:
                    vouched.append(batch)
                    vouched_records.append(record)
                    continue
                if batch.lines:
                    batches.append(batch)
                tails += self._has_tail(record)
        if checks and self._digests is not None:
            # Before the zeroing launch (disjoint slots) and before the
            # scheduler can hand the blocks to a forward.
            self._digests.check_loads(checks)
        false, false_tails = self._check_vouched(vouched, vouched_records)
        batches += false
        self._zero(batches)
        # Counted once the launch returned: a failed one zeroed nothing.
        self._count_tails(tails + false_tails)
        return {b.owner for b in batches if b.lines}

    def reads_started(self, landed: bool) -> None:
        """The inner ``start_load_kv`` returned. If every READ has landed
        (``landed``), zero this step's READ tails now, before the forward;
        otherwise each layer's, once that layer's READs have landed."""
        if not self._read_loads:
            return
        records, self._read_loads = self._read_loads, []
        # Under "auto" a claim skips only the per-layer launches (0.32, the
        # READs not all landed): where one launch zeroes every READ tail now,
        # skipping saves a share of it, and the tail is zeroed (claim unused).
        per_layer = not landed and self._by_layer is not None
        trusted = [
            r for r in records if r.vouched and (per_layer or self._policy.trust_load_claims)
        ]
        unused = [r for r in records if r.vouched and r not in trusted]
        if unused and self._per_request:
            self._stats.add("vouches_unused", sum(self._has_tail(r) for r in unused))
        if trusted:
            # READs copy the producer's blocks, zeroed at the source: no
            # per-layer launch and no work lines, only the bytes left alone
            # (the probe's canary covers async loads only).
            tail_bytes = self._tail_bytes if self._zeroer is not None else None
            nbytes = (
                sum(tail_bytes(s, first) for r in trusted for s, _, first in self._tail_items(r))
                if tail_bytes is not None
                else 0
            )
            self._count_vouched(nbytes, trusted)
            records = [r for r in records if r not in trusted]
            if not records:
                return
        by_layer = self._by_layer
        if self._released is not None:
            logger.warning(
                "KVTailConnector: %d READ load(s) while the KV cache is released: not zeroed",
                len(records),
            )
            return
        if landed or by_layer is None:
            batches = [self._zeroing(r.req_id, self._tail_items(r)) for r in records]
            self._zero(batches)
            self._count_tails(sum(self._has_tail(r) for r in records))
            return
        for r in records:
            by_layer.arm(r.req_id, self._tail_items(r))
        by_layer.stage()
        self._count_tails(sum(self._has_tail(r) for r in records))

    def layer_loaded(self, layer_name: str) -> None:
        """``wait_for_layer_load(layer_name)`` returned: that layer's READs have
        landed and its attention has not run; zero its READ tails."""
        by_layer = self._by_layer
        if by_layer is None or not by_layer.pending:
            return
        work = by_layer.take(layer_name)
        if work is not None:
            self._zero_layer_work(by_layer, work)

    def end_step(self) -> None:
        """After the forward: layers whose ``wait_for_layer_load`` never ran
        (no KV-transfer hook, e.g. the indexer cache) are zeroed now. This is
        after their first read, but never wipes valid KV: the zeroing starts
        at the producer's prompt length, past which this step wrote only the
        rows vLLM pads a new decode with (draft id -1, always rejected)."""
        by_layer = self._by_layer
        if by_layer is None:
            return
        left = by_layer.take_all()
        if left:
            logger.debug("kvtail: READ tails of %d layer(s) zeroed after the forward", len(left))
        for work in left:
            self._zero_layer_work(by_layer, work)
        by_layer.record_done()
        self._last_zeroing = by_layer.last_launch_done

    # -------------------------------------------------------------- helpers

    def _zeroing(self, owner: str, items: list[tuple[int, int, int]]) -> _Zeroing:
        """Work lines for ``items`` (set index, block, first slot), built in
        Python: a handful of items per request, where numpy costs more."""
        zeroer = self._zeroer
        if zeroer is None or not items:
            return _Zeroing(owner, [], 0)
        lines = [ln for ln in (zeroer.line(*item) for item in items) if ln is not None]
        tail_bytes = self._tail_bytes
        nbytes = sum(tail_bytes(g, first) for g, _, first in (ln.item for ln in lines))
        return _Zeroing(owner, lines, nbytes)

    def _check_vouched(
        self, batches: list[_Zeroing], records: list[LoadRecord]
    ) -> tuple[list[_Zeroing], int]:
        """Vouched tails are not zeroed, only counted; with the probe on they are
        checked first, and those holding any non-zero byte are returned to be
        zeroed, with how many of them the caller counts as zeroed tails once
        launched (the producer's claim was false: a WARNING and
        ``false_vouches``)."""
        if not batches:
            return [], 0
        lined = [b for b in batches if b.lines]
        if not self._policy.probe or not lined:
            self._count_vouched(sum(b.nbytes for b in batches), records)
            return [], 0
        found = probe_items(
            self._sets,
            np.array([ln.item for b in lined for ln in b.lines], dtype=np.int64),
            [b.owner for b in lined for _ in b.lines],
        )
        false = {req for req, (nonzero, _) in found.items() if nonzero}
        honest = [r for r in records if r.req_id not in false]
        self._count_vouched(sum(b.nbytes for b in batches if b.owner not in false), honest)
        if self._per_request:
            self._stats.add("probed_tails", sum(self._has_tail(r) for r in honest))
        false_tails = sum(self._has_tail(r) for r in records if r.req_id in false)
        for req_id in sorted(false):
            nonzero, nonfinite = found[req_id]
            logger.warning(
                "KVTailConnector: request %s: the producer vouched for a zero tail, yet it held "
                "%d non-zero byte(s) (%d non-finite value(s)); zeroing it. Is the producer's "
                'kvtail-connector healthy? (vouch_tails: "off" on either side stops trusting)',
                req_id,
                nonzero,
                nonfinite,
            )
        if false:
            # Counted once per request by the scheduler side, whichever rank
            # found it: reported in this step's worker metadata.
            self._false_vouches.extend(false)
        return [b for b in lined if b.owner in false], false_tails

    def _count_vouched(self, nbytes: int, records: list[LoadRecord]) -> None:
        self._stats.add("vouched_tail_bytes", nbytes)
        if self._per_request:
            self._stats.add("vouched_tails", sum(self._has_tail(r) for r in records))

    def _zero(
        self, batches: list[_Zeroing], counter: str = "tail_bytes_zeroed", *, probe: bool = True
    ) -> None:
        zeroer = self._zeroer
        if zeroer is None:
            return
        lines = [ln for b in batches for ln in b.lines]
        if not lines:
            return
        if probe and self._policy.probe:
            self._report_probe(
                self._sets,
                [ln.item for b in batches for ln in b.lines],
                [b.owner for b in batches for _ in b.lines],
            )
        zeroer.zero_lines(lines)
        self._stats.add(counter, sum(b.nbytes for b in batches))  # launched
        # Recorded behind the launch by the zeroer: start_load_kv's fence.
        self._last_zeroing = zeroer.last_launch_done
        logger.debug("kvtail: zeroed %d tail item(s) in one launch", len(lines))

    def _tail_items(self, record: LoadRecord) -> list[tuple[int, int, int]]:
        items = []
        for load in record.groups:
            info = self._groups[load.group]
            tail = tail_block(record.num_loaded, info.effective_block)
            if tail is None:
                continue
            k, n = tail
            idx = k - load.first_block
            if not 0 <= idx < len(load.block_ids):
                continue
            block = load.block_ids[idx]
            if block == NULL_BLOCK:
                continue
            sharded = info.dcp_size > 1
            for s in self._sets_of_group.get(load.group, ()):
                first = first_stale_slot(
                    n,
                    dcp_rank=self._placement.dcp_rank if sharded else 0,
                    dcp_world_size=info.dcp_size,
                    interleave=self._placement.interleave if sharded else 1,
                    tokens_per_state=s.tokens_per_state,
                )
                items.append((s.index, block, first))
        return items

    def _failed_items(
        self, record: LoadRecord, invalid: tuple[int, int] | None
    ) -> list[tuple[int, int, int]]:
        """Whole destination blocks from the first invalid one on (all, if none
        is named); never the blocks before it, which hold valid KV."""
        items = []
        for load in record.groups:
            start = invalid[1] if invalid is not None and invalid[0] == load.group else 0
            for block in load.block_ids[start:]:
                if block != NULL_BLOCK:
                    for s in self._sets_of_group.get(load.group, ()):
                        items.append((s.index, block, 0))
        return items

    def _zero_layer_work(self, by_layer: ReadTailsByLayer, work: LayerWork) -> None:
        if self._policy.probe:
            found = probe_items(
                by_layer.layer_sets,
                np.array(work.items, dtype=np.int64),
                work.armed.owners,
            )
            for req_id, (nonzero, nonfinite) in found.items():
                counts = self._layer_probe.setdefault(req_id, [0, 0])
                counts[0] += nonzero
                counts[1] += nonfinite
        by_layer.zero(work)
        self._stats.add("tail_bytes_zeroed", by_layer.nbytes(work))  # launched
        self._last_zeroing = by_layer.last_launch_done
        if self._layer_probe and not by_layer.pending:
            # Every layer is done: one report per request, as for other tails.
            summed, self._layer_probe = self._layer_probe, {}
            self._report_found({req: (c[0], c[1]) for req, c in summed.items()})

    def _report_probe(
        self, sets: list[CacheSet], items: list[tuple[int, int, int]], owners: list[str]
    ) -> None:
        self._report_found(probe_items(sets, np.array(items, dtype=np.int64), owners))

    def _has_tail(self, record: LoadRecord) -> bool:
        """Whether ``record`` leaves a stale tail in some group: the same answer
        on every rank (a DCP rank whose share of the block is full has none of
        its own to zero, yet the request still counts once)."""
        for load in record.groups:
            info = self._groups[load.group]
            tail = tail_block(record.num_loaded, info.effective_block)
            if info.has_tails and tail is not None:
                idx = tail[0] - load.first_block
                if 0 <= idx < len(load.block_ids) and load.block_ids[idx] != NULL_BLOCK:
                    return True
        return False

    def _count_tails(self, requests: int) -> None:
        """Per-request counters, on the counting rank only."""
        if requests and self._per_request:
            self._stats.add("tails_zeroed", requests)
            if self._policy.probe:
                self._stats.add("probed_tails", requests)

    def _report_found(self, found: dict[str, tuple[int, int]]) -> None:
        for req_id, (nonzero, nonfinite) in found.items():
            self._stats.add("stale_nonzero_bytes", nonzero)
            self._stats.add("stale_nonfinite_values", nonfinite)
            if nonfinite:
                logger.warning(
                    "KVTailConnector: request %s: the loaded KV's stale tail held %d non-finite "
                    "value(s) (%d non-zero bytes); zeroing them before any read",
                    req_id,
                    nonfinite,
                    nonzero,
                )


def _first_invalid(record: LoadRecord, invalid: set[int]) -> tuple[int, int] | None:
    """(group, index in its block list) of the load's first invalid block."""
    if not invalid:
        return None
    for load in record.groups:
        for i, block in enumerate(load.block_ids):
            if block in invalid:
                return load.group, i
    return None
