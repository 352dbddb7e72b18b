"""Scheduler side: note where each load ends, ship it to the workers once.

At ``get_num_new_matched_tokens`` the wrapper learns the local computed count
and whether the inner load is async; at ``update_state_after_alloc`` it gets
the blocks and the external token count. That is everything a worker needs to
find the load's stale tail, so a :class:`LoadRecord` goes into this step's
metadata and the scheduler keeps nothing about the request afterwards.

On a producer it also ships a record for each remote-decode prompt that
completes in the step (its tail is zeroed by the workers in that step), and
when the request finishes adds the ``kvtail`` entry to the params the inner
connector returned, once every worker confirmed the zeroing
(:meth:`TailScheduler.update_connector_output`, in the same
``update_from_output`` call).

With ``verify_kv: digest`` a producer ships every block of those prompts for
the workers to digest and adds the ranks' summed digest to the entry (``dg``);
a consumer passes the entry's digest to the workers with the load
(``LoadRecord.expected``) and counts what the workers found once per request.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvtail_connector import _compat, entry, trust
from kvtail_connector._version import __version__
from kvtail_connector.connectors import InnerAdapter
from kvtail_connector.containment import mark_inner
from kvtail_connector.kvgroups import GroupInfo
from kvtail_connector.log import get_logger
from kvtail_connector.metadata import (
    MISMATCH,
    NULL_BLOCK,
    VERIFIED,
    ExpectedDigest,
    GroupLoad,
    KVTailMetadata,
    KVTailWorkerMeta,
    LoadRecord,
    combined_verdict,
)
from kvtail_connector.policy import TailPolicy
from kvtail_connector.stats import KVTailStats
from kvtail_connector.tails import tail_block

logger = get_logger(__name__)


class TailScheduler:
    """The wrapper's scheduler-side state around the inner connector.

    Args:
        inner: the wrapped connector (scheduler role).
        groups: tail facts per KV cache group.
        policy: what to record (``zero_tails``, ``record_every_load``,
            ``zero_read_tails``) and whether to exclude READ destinations.
        adapter: what differs for this inner connector.
        geometry: this engine's tail geometry, as the ``kvtail`` entry states
            it (a producer's claim holds for it; a consumer trusts only a claim
            made for the same).
        num_workers: workers whose outputs vLLM aggregates per step (each
            must confirm a producer tail).
        limits: what a ``kvtail`` entry can hold on this engine (its model).
        min_block_size: the smallest block size of this engine's KV cache
            groups (bounds the block ids a transfer's binding can hold).
        key: the shared entry key (``entry_key_env``), or None.
    """

    def __init__(
        self,
        inner: Any,
        groups: tuple[GroupInfo, ...],
        policy: TailPolicy,
        *,
        adapter: InnerAdapter,
        stats: KVTailStats,
        geometry: entry.Geometry | None = None,
        num_workers: int = 1,
        limits: entry.Limits = entry.UNBOUNDED,
        min_block_size: int = 16,
        key: bytes | None = None,
    ) -> None:
        self._inner = inner
        self._groups = groups
        self._policy = policy
        self._adapter = adapter
        self._stats = stats
        self._geometry = geometry
        self._num_workers = num_workers
        self._limits = limits
        # A producer of a smaller block size (NIXL maps block size ratios)
        # sends up to 4x the block ids D's own would have.
        self._binding_nodes = trust.binding_nodes(limits, max(1, min_block_size // 4))
        self._key = key
        self._kv_cache_manager: Any = None
        # Producer: remote-decode requests from arrival to finish; the prompt
        # length of those whose tail record shipped; the params of those that
        # finished in the update_from_output call now running, until its
        # update_connector_output confirms (or not) the zeroing.
        self._producing: dict[str, Any] = {}
        self._claims: dict[str, tuple[int, int]] = {}  # (prompt length, preemptions then)
        self._provisional: dict[str, tuple[dict[str, Any], int]] = {}
        # verify_kv. Producer: the prompt length of requests whose digest
        # record shipped, then the params of those that finished in this
        # update_from_output call. Consumer: the ranks' verdicts on loads that
        # came with a digest, until vLLM reports the load finished.
        self._digesting: dict[str, int] = {}
        self._provisional_digests: dict[str, tuple[dict[str, Any], int]] = {}
        self._verdicts: dict[str, str] = {}
        # req_id -> (local computed tokens, load is async) from the latest
        # get_num_new_matched_tokens with a positive hit; consumed at alloc.
        self._matched: dict[str, tuple[int, bool]] = {}
        # req_id -> (claim, expected digest) read by read_entry, taken at alloc;
        # and every request's reading until it finishes (read once per request).
        self._entries: dict[str, tuple[int | None, ExpectedDigest | None]] = {}
        self._entries_seen: dict[str, tuple[int | None, ExpectedDigest | None]] = {}
        self._pending: list[LoadRecord] = []
        # READ loads allocated this step: (request, blocks, local, loaded, the
        # prompt length a bound producer claim covers or None). Their records
        # wait for build_connector_meta, which knows the step's tokens.
        self._pending_reads: list[tuple[Any, Any, int, int, int | None]] = []
        # Every async load until vLLM reports it finished: the blocks it
        # writes (to map invalid block ids to requests), and whether its
        # failure was counted already (errors may precede the completion).
        self._in_flight: dict[str, frozenset[int]] = {}
        self._failed: set[str] = set()
        # Consumer: in-flight loads whose false vouch was counted already
        # (several ranks may find the same one, in different steps).
        self._false_vouched: set[str] = set()
        # Async loads whose record was lost to a contained internal error:
        # shipped to the workers, which report them failed at completion.
        self._failing: list[str] = []

    # ----------------------------------------------------------------- hooks

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Any) -> None:
        """A producer notes the remote-decode requests whose tail it vouches for.

        Only single-token prefill legs (``max_tokens == 1``, what P/D routers
        send): the request then finishes in the step its prompt completes, so
        no later forward of it (async scheduling's next step included) writes
        past the prompt into the tail the claim covers.
        """
        if not (self._policy.vouch_tails or self._policy.digest_prompts):
            return
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and getattr(request, "max_tokens", 0) == 1:
            self._producing[request.request_id] = request

    def matched(
        self, request: Any, num_computed_tokens: int, count: int | None, load_async: bool
    ) -> None:
        """The inner ``get_num_new_matched_tokens`` returned ``(count, load_async)``."""
        if count:
            self._matched[request.request_id] = (num_computed_tokens, bool(load_async))
        else:
            self._matched.pop(request.request_id, None)

    def read_entry(self, request: Any, num_external_tokens: int) -> None:
        """Before the inner ``update_state_after_alloc`` (the facade calls this
        first): read the producer's entry once per allocation, only for the
        features that are on, while the params still hold what its binding
        covers (NIXL push seeds ``remote_block_ids`` in the inner update)."""
        matched = self._matched.get(request.request_id)
        if num_external_tokens <= 0 or matched is None:
            return
        req_id = request.request_id
        seen = self._entries_seen.get(req_id)
        if seen is not None:  # allocated again (0.32's MoRIIO re-matches): counted once
            self._entries[req_id] = seen
            return
        load_async = matched[1]
        policy = self._policy
        claims = policy.check_claims and (
            policy.zero_tails if load_async else policy.zero_read_tails
        )
        digest = load_async and policy.verify_loads
        if claims or digest:
            # The binding (and MAC) only where something depends on them: a
            # claim that can skip a zeroing, or a digest that can fail a load.
            usable = claims and (
                policy.trust_load_claims if load_async else policy.trust_read_claims
            )
            found = self._read_entry(request, claims=claims, bind=usable or digest, digest=digest)
            self._entries[req_id] = self._entries_seen[req_id] = found

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """After the inner ``update_state_after_alloc`` (called by the facade),
        and after :meth:`read_entry` (called before it)."""
        # Popped at the end: contain_alloc needs it if this raises.
        matched = self._matched.get(request.request_id)
        claim, expected = self._entries.pop(request.request_id, (None, None))
        if num_external_tokens > 0 and matched is not None:
            self._after_alloc(request, blocks, num_external_tokens, matched, claim, expected)
        self._matched.pop(request.request_id, None)

    def _after_alloc(
        self,
        request: Any,
        blocks: Any,
        num_external_tokens: int,
        matched: tuple[int, bool],
        claim: int | None,
        expected: ExpectedDigest | None,
    ) -> None:
        local, load_async = matched
        if load_async:
            self._in_flight[request.request_id] = frozenset(
                self._written_blocks(request, blocks, local, local + num_external_tokens)
            )
        if load_async and not self._policy.zero_tails and expected is None:
            return
        if not load_async:
            if self._policy.zero_read_tails:
                self._pending_reads.append(
                    (request, blocks, local, local + num_external_tokens, claim)
                )
            return  # other sync loads land in blocks vLLM zeroed first
        record = self._record(
            request, blocks, local, local + num_external_tokens, keep=expected is not None
        )
        if record is None and expected is not None:
            self._stats.add("digests_skipped", 1)  # no group a digest covers
        if record is not None:
            if self._policy.zero_tails and self._claim_used(
                request, claim, record, self._policy.trust_load_claims
            ):
                record = dataclasses.replace(record, vouched=True)
            if expected is not None:
                record = dataclasses.replace(record, expected=expected)
            self._pending.append(record)

    def build_connector_meta(self, scheduler_output: Any, inner_meta: Any) -> KVTailMetadata:
        """``inner_meta``: what the inner ``build_connector_meta`` returned."""
        # Params left by an update_from_output that had no connector output:
        # they have left the engine; no entry is added to them after that.
        self._provisional.clear()
        exclude = self._policy.exclude_reads and bool(scheduler_output.new_block_ids_to_zero)
        read_loads: tuple[LoadRecord, ...] = ()
        kept: list[int] | None = None  # vLLM's zero list without READ destinations
        if exclude or self._pending_reads:
            # request id -> every block its READ writes this step (all groups)
            reads = {
                req_id: {b for ids in per_group for b in ids}
                for req_id, per_group in self._adapter.read_destinations(inner_meta)
            }
            if exclude:
                kept = self._without_read_destinations(scheduler_output, reads)
            if self._pending_reads:
                read_loads = self._read_records(scheduler_output.num_scheduled_tokens, reads)
        producer: tuple[LoadRecord, ...] = ()
        digests: tuple[LoadRecord, ...] = ()
        if self._producing:
            producer, digests = self._producer_records(scheduler_output)
        meta = KVTailMetadata(
            inner=inner_meta,
            loads=tuple(self._pending),
            read_loads=read_loads,
            producer_tails=producer,
            producer_digests=digests,
            failing=self._take_failing() if self._failing else (),
        )
        if self._pending or read_loads or producer:
            logger.debug(
                "kvtail: shipping %d load(s), %d READ load(s), %d producer tail(s)",
                len(self._pending),
                len(read_loads),
                len(producer),
            )
        self._pending.clear()
        if kept is not None:
            # Last: should anything above raise, vLLM's zero list is untouched
            # and it zeroes the READ destinations as without the wrapper.
            scheduler_output.new_block_ids_to_zero = kept
        return meta

    def request_finished(self, request: Any, params: dict[str, Any] | None) -> None:
        """``params``: what the inner connector's ``request_finished`` returned,
        the very dict vLLM puts into the request's output."""
        req_id = request.request_id
        self._matched.pop(req_id, None)
        self._entries.pop(req_id, None)
        self._entries_seen.pop(req_id, None)
        self._producing.pop(req_id, None)
        claim = self._claims.pop(req_id, None)
        digested = self._digesting.pop(req_id, None)
        if not isinstance(params, dict):
            return
        if claim is not None:
            num_tokens, preemptions = claim
            # Preempted since (async scheduling can preempt it after the step
            # that zeroed its tail was scheduled): its blocks were freed; no claim.
            if request.num_preemptions == preemptions and request.num_computed_tokens >= num_tokens:
                self._provisional[req_id] = (params, num_tokens)
        if digested is not None:
            self._provisional_digests[req_id] = (params, digested)

    def update_connector_output(
        self, connector_output: Any, worker_meta: KVTailWorkerMeta | None = None
    ) -> None:
        """Grant the producer claims of requests finished in this call, then
        count each failed async load once: reported in ``failed_recving``, or
        holding a block of ``invalid_block_ids`` (both aggregated over the
        workers by vLLM), then forget the loads reported finished.

        ``worker_meta``: the wrapper's worker metadata of the step being
        processed (aggregated over the workers), unwrapped by the facade.
        """
        if self._provisional or self._provisional_digests:
            self._grant_claims(worker_meta)
        if not self._in_flight:
            return
        if worker_meta is not None and worker_meta.false_vouches:
            self._count_false_vouches(worker_meta.false_vouches)
        if self._policy.verify_loads:
            self._count_verdicts(connector_output, worker_meta)
        failed = set(connector_output.failed_recving or ()) & self._in_flight.keys()
        invalid = connector_output.invalid_block_ids
        if invalid:
            failed.update(
                r for r, blocks in self._in_flight.items() if not blocks.isdisjoint(invalid)
            )
        new = failed - self._failed
        if new:
            self._stats.add("failed_loads", len(new))
            self._failed |= new
        for req_id in connector_output.finished_recving or ():
            if self._in_flight.pop(req_id, None) is not None:
                self._failed.discard(req_id)
                self._false_vouched.discard(req_id)

    def _count_false_vouches(self, found: frozenset[str]) -> None:
        """``false_vouches`` once per load, whichever rank(s) found it (vLLM
        sums every worker's stats; the ranks report ids, counted here)."""
        new = (found & self._in_flight.keys()) - self._false_vouched
        if new:
            self._stats.add("false_vouches", len(new))
            self._false_vouched |= new

    # ------------------------------------------------- contained failures
    # The fallbacks the facade runs after an internal error in a hook
    # (kvtail_connector.containment): minimal, and never half a claim.

    def _take_failing(self) -> tuple[str, ...]:
        failing = tuple(self._failing)
        self._failing.clear()
        return failing

    def contain_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """``update_state_after_alloc`` failed: the load may have no record.
        An async load is reported failed by the workers when it completes
        (and counted in ``failed_loads``: tracked in flight). A synchronous
        READ never completes in ``finished_recving`` and its destinations
        leave vLLM's zero list: it stays a pending READ, without a claim
        (the entry is not read again), so its tail is still zeroed."""
        req_id = request.request_id
        matched = self._matched.pop(req_id, None)
        self._entries.pop(req_id, None)
        if num_external_tokens <= 0 or matched is None:
            return  # no load the wrapper would have recorded
        if matched[1]:
            self._in_flight.setdefault(req_id, frozenset())
            self._failing.append(req_id)
        elif self._policy.zero_read_tails:
            local = matched[0]
            self._pending_reads.append((request, blocks, local, local + num_external_tokens, None))

    @property
    def pending_loads(self) -> list[str]:
        """Requests whose load record waits for this step's metadata."""
        return [*self._failing, *(r.req_id for r in self._pending)]

    def contain_meta(self, inner_meta: Any) -> KVTailMetadata:
        """``build_connector_meta`` failed: the inner metadata, untouched; the
        step's pending async loads are reported failed at completion, its
        READ and producer records are not shipped (no claim is made)."""
        failing = tuple(self.pending_loads)
        self._failing.clear()
        self._pending.clear()
        self._pending_reads.clear()
        return KVTailMetadata(inner=inner_meta, failing=failing)

    def contain_output(self, connector_output: Any) -> None:
        """``update_connector_output`` failed: no claim from this call; loads
        reported finished are forgotten."""
        self._provisional.clear()
        self._provisional_digests.clear()
        for req_id in connector_output.finished_recving or ():
            self._in_flight.pop(req_id, None)
            self._failed.discard(req_id)
            self._verdicts.pop(req_id, None)
            self._false_vouched.discard(req_id)

    def forget(self, req_id: str) -> None:
        """``on_new_request`` or ``request_finished`` failed: no claim for it."""
        self._matched.pop(req_id, None)
        self._entries.pop(req_id, None)
        self._entries_seen.pop(req_id, None)
        self._producing.pop(req_id, None)
        self._claims.pop(req_id, None)
        self._digesting.pop(req_id, None)
        self._provisional.pop(req_id, None)
        self._provisional_digests.pop(req_id, None)

    def held_requests(self) -> int:
        """Requests this side holds state for (the ``held_requests`` gauge)."""
        held = (
            self._matched.keys()
            | self._in_flight.keys()
            | self._producing.keys()
            | self._digesting.keys()
        )
        held.update(r.req_id for r in self._pending)
        held.update(read[0].request_id for read in self._pending_reads)
        return len(held)

    # ---------------------------------------------------------------- helpers

    def _producer_records(
        self, scheduler_output: Any
    ) -> tuple[tuple[LoadRecord, ...], tuple[LoadRecord, ...]]:
        """Tail records of the remote-decode prompts this step completes: in each
        group with token tails, the block holding the prompt's last token, when
        that block is partial. A block-aligned prompt ships an empty record (its
        tail is trivially clean; every worker still confirms it). With
        ``verify_kv``, digest records of the same prompts: every block of
        ``[0, n)`` in each group with token tails."""
        scheduled = scheduler_output.num_scheduled_tokens
        manager = self._kv_cache_manager
        records = []
        digests = []
        for req_id in scheduled.keys() & self._producing.keys():
            request = self._producing[req_id]
            step = scheduled[req_id]
            done = int(request.num_computed_tokens)  # not yet advanced for this step
            n = int(request.num_prompt_tokens)
            if step <= 0 or not done < n <= done + step or manager is None:
                continue
            block_ids = manager.get_block_ids(req_id)
            if self._policy.digest_prompts:
                digests.append(self._digest_record(req_id, n, block_ids))
                self._digesting[req_id] = n
            if not self._policy.vouch_tails:
                continue
            groups = []
            for info in self._groups:
                tail = tail_block(n, info.effective_block) if info.has_tails else None
                if tail is None:
                    continue
                ids = block_ids[info.group_id]
                if tail[0] >= len(ids) or ids[tail[0]] == _compat.NULL_BLOCK_ID:
                    break  # not a block this step writes: no claim
                groups.append(GroupLoad(info.group_id, tail[0], (ids[tail[0]],)))
            else:
                records.append(LoadRecord(req_id, 0, n, tuple(groups)))
                self._claims[req_id] = (n, int(request.num_preemptions))
        return tuple(records), tuple(digests)

    def _digest_record(self, req_id: str, n: int, block_ids: Any) -> LoadRecord:
        groups = []
        for info in self._groups:
            if not info.has_tails:
                continue
            ids = tuple(block_ids[info.group_id][: -(-n // info.effective_block)])
            if _compat.NULL_BLOCK_ID in ids:  # sliding-window gaps: vLLM's null block
                ids = tuple(NULL_BLOCK if i == _compat.NULL_BLOCK_ID else i for i in ids)
            groups.append(GroupLoad(info.group_id, 0, ids))
        return LoadRecord(req_id, 0, n, tuple(groups))

    def _grant_claims(self, worker_meta: KVTailWorkerMeta | None) -> None:
        """Add the ``kvtail`` entry to each finished producer request's params
        whose tail every worker zeroed in the step just processed, or (with
        ``verify_kv``) that every worker digested; the others leave without one
        (their consumer zeroes as if P were plain vLLM, and verifies nothing)."""
        provisional, self._provisional = self._provisional, {}
        digested, self._provisional_digests = self._provisional_digests, {}
        workers = self._num_workers
        confirmed: dict[str, frozenset[int]] = {}
        parts: dict[str, Any] = {}
        if worker_meta is not None and len(worker_meta.ranks) == workers:
            confirmed = worker_meta.confirmed
            parts = worker_meta.digests
        # request id -> (its params, prompt length, tail confirmed, digest)
        sent: dict[str, tuple[dict[str, Any], int, bool, entry.Digest | None]] = {}
        for req_id, (params, num_tokens) in provisional.items():
            # Distinct ranks: a step's outputs replayed (0.33 fault tolerance)
            # repeat a rank's confirmation, never add one.
            if len(confirmed.get(req_id, ())) != workers:
                logger.debug("kvtail: %s: tail not confirmed by every worker: no claim", req_id)
                continue
            sent[req_id] = (params, num_tokens, True, None)
        for req_id, (params, num_tokens) in digested.items():
            part = parts.get(req_id)
            digest = part.digest() if part is not None and part.ranks == workers else None
            if digest is None:
                logger.debug("kvtail: %s: not digested by every worker: no digest", req_id)
                continue
            tail_zero = req_id in sent
            sent[req_id] = (params, num_tokens, tail_zero, digest)
        for req_id, (params, num_tokens, tail_zero, digest) in sent.items():
            self._send_entry(req_id, params, num_tokens, tail_zero, digest)

    def _send_entry(
        self,
        req_id: str,
        params: dict[str, Any],
        num_tokens: int,
        tail_zero: bool,
        digest: entry.Digest | None,
    ) -> None:
        """Add the entry, bound to the transfer its params name and signed
        with the shared key, if any; none where the params name no transfer."""
        assert self._geometry is not None, "a producer knows its geometry"
        bound = trust.binding(params, self._binding_nodes)
        if bound is None:
            logger.debug("kvtail: %s: the params name no transfer to bind to: no entry", req_id)
            return
        wire = entry.Entry(
            num_tokens=num_tokens,
            geometry=self._geometry,
            tail_zero=tail_zero,
            digest=digest,
            producer_version=__version__,
            binding=bound,
        ).to_json()
        if self._key is not None:
            mac = trust.sign(self._key, wire)
            assert mac is not None, "an entry the producer built is JSON"
            wire["mac"] = mac
        params[entry.KEY] = wire
        if tail_zero:
            self._stats.add("tails_vouched", 1)
        if digest is not None:
            self._stats.add("digests_sent", 1)

    def _read_entry(
        self, request: Any, *, claims: bool, bind: bool, digest: bool
    ) -> tuple[int | None, ExpectedDigest | None]:
        """The producer's ``kvtail`` entry of ``request``, read once:
        ``(claim, expected)``. ``claim`` (with ``claims``): the prompt length a
        zero-tail claim covers, where the entry is valid, made for this
        geometry and (with ``bind``) bound to these params and MAC-checked
        with a key; anything else is counted in ``vouches_declined``. Without
        ``bind`` the claim can only be counted (``vouches_unused``), so the
        binding, which walks every block id of the params, is not computed.
        ``expected`` (with ``digest``, which implies ``bind``): the producer's
        digest of this prompt under the same conditions; anything else is
        counted in ``digests_skipped``."""
        params = request.kv_transfer_params
        # With a key the MAC covers the whole entry, dg included: walk it all.
        reading = entry.read(params, self._limits, digest=digest, walk_digest=self._key is not None)
        found, why = reading.entry, reading.why
        if found is not None and bind:
            why = self._bound(found, reading.raw, params)
        claim = None
        if claims and why != "absent":
            if found is None or why != "ok":
                self._decline(request, why)
            elif found.tail_zero:
                if found.geometry == self._geometry:
                    claim = found.num_tokens
                else:
                    self._decline(request, f"geometry {found.geometry} vs {self._geometry}")
            elif reading.raw is not None and "dg" not in reading.raw:
                self._decline(request, "claims nothing")  # a digest alone claims no tail
        expected = None
        if digest:
            if found is not None and why == "ok" and found.digest is not None:
                if found.num_tokens == int(request.num_prompt_tokens):
                    expected = ExpectedDigest(found.num_tokens, found.digest)
                else:
                    why = "digest of another prompt length"
            elif why == "ok":
                why = f"digest {reading.digest_why}"
            if expected is None:
                self._stats.add("digests_skipped", 1)
                logger.debug("kvtail: %s: no producer digest used (%s)", request.request_id, why)
        return claim, expected

    def _bound(self, found: entry.Entry, raw: Any, params: Any) -> str:
        """``"ok"`` where ``found`` carries a valid MAC (with a key) and the
        binding of the params it came with; else why not."""
        if self._key is not None and (found.mac is None or not trust.verifies(self._key, raw)):
            return "no valid MAC" if found.mac is None else "MAC does not verify"
        if found.binding is None:
            return "unbound"
        mine = trust.binding(params, self._binding_nodes)
        if mine is None or mine != found.binding:
            return "bound to another transfer"
        return "ok"

    def _decline(self, request: Any, why: str) -> None:
        self._stats.add("vouches_declined", 1)
        logger.debug("kvtail: %s: producer claim declined (%s)", request.request_id, why)

    def _claim_used(
        self, request: Any, claim: int | None, record: LoadRecord, trusted: bool
    ) -> bool:
        """Whether a claim lets this consumer skip the tail of ``record`` (zeroed
        from token ``record.num_loaded``): the claim's clean tail starts there
        and claims are trusted on this path. A matching claim over a tail this
        consumer zeroes anyway is counted ``vouches_unused`` (as
        ``vouched_tails``, only where there is a tail)."""
        if claim is None:
            return False
        if claim != record.num_loaded:
            self._decline(request, f"claim for {claim} tokens, load of {record.num_loaded}")
            return False
        if not trusted:
            if any(self._tail_index(record.num_loaded, g.group) is not None for g in record.groups):
                self._stats.add("vouches_unused", 1)
            return False
        return True

    def _count_verdicts(self, connector_output: Any, worker_meta: KVTailWorkerMeta | None) -> None:
        """Fold this step's verdicts of the ranks; count each load once vLLM
        reports it finished (every rank then reported its verdict)."""
        if worker_meta is not None:
            for req_id, found in worker_meta.verdicts.items():
                if req_id in self._in_flight:
                    have = self._verdicts.get(req_id)
                    self._verdicts[req_id] = (
                        found if have is None else combined_verdict(have, found)
                    )
        for req_id in connector_output.finished_recving or ():
            verdict = self._verdicts.pop(req_id, None)
            if verdict is None:
                continue
            if verdict == MISMATCH:
                self._stats.add("digest_mismatches", 1)
            elif verdict == VERIFIED:
                self._stats.add("digests_verified", 1)
            else:
                self._stats.add("digests_skipped", 1)

    def _read_records(
        self, num_scheduled: dict[str, int], reads: dict[str, set[int]]
    ) -> tuple[LoadRecord, ...]:
        """Records of this step's READ loads whose tail block the READ overwrites.

        A READ copies whole producer blocks: the producer's KV, valid for its
        whole prompt, and its stale tail after it. ``num_loaded`` is therefore
        the prompt length (MoRIIO reads all but the last prompt token, which
        this step recomputes into the same slot, with the same KV). The step's
        forward may write past it: vLLM pads a new decode to ``1 + k`` rows
        under speculative decoding, and on 0.32 a layer's READ can land after
        the backend wrote them (KV update before attention), putting the
        producer's tail back there; those slots hold nothing valid either way.
        A tail block the READ does not write was zeroed by vLLM, and 0.32's
        MoRIIO also "matches" consumer requests with no remote prefill:
        neither gets a record.
        """
        records = []
        for request, blocks, local, loaded, claim in self._pending_reads:
            dests = reads.get(request.request_id)
            step = num_scheduled.get(request.request_id, 0)
            if not dests or step <= 0:
                continue
            valid = min(loaded + step, int(request.num_prompt_tokens))
            record = self._record(request, blocks, local, valid, tails_only=True)
            if record is not None and any(
                load.block_ids[k - load.first_block] in dests
                for load in record.groups
                if (k := self._tail_index(record.num_loaded, load.group)) is not None
            ):
                if self._claim_used(request, claim, record, self._policy.trust_read_claims):
                    record = dataclasses.replace(record, vouched=True)
                records.append(record)
        self._pending_reads.clear()
        return tuple(records)

    def _tail_index(self, num_loaded: int, group: int) -> int | None:
        tail = tail_block(num_loaded, self._groups[group].effective_block)
        return None if tail is None else tail[0]

    def _loaded_groups(self, request: Any) -> Any:
        """The inner connector's answer; its exceptions tagged as its own."""
        try:
            return self._inner.get_loaded_kv_cache_group_ids(request)
        except BaseException as exc:
            mark_inner(exc)
            raise

    def _written_blocks(self, request: Any, blocks: Any, local: int, loaded: int) -> list[int]:
        """The non-null blocks a load of tokens ``[local, loaded)`` writes, all groups."""
        block_ids = blocks.get_block_ids()
        out: list[int] = []
        for gid in self._loaded_groups(request):
            eb = self._groups[gid].effective_block
            out.extend(b for b in block_ids[gid][local // eb : -(-loaded // eb)])
        return [b for b in out if b != _compat.NULL_BLOCK_ID]

    def _record(
        self,
        request: Any,
        blocks: Any,
        local: int,
        loaded: int,
        *,
        tails_only: bool = False,
        keep: bool = False,
    ) -> LoadRecord | None:
        """The load's record, or None when block-aligned (nothing to zero or
        watch) unless ``keep`` (a load to verify)."""
        block_ids = blocks.get_block_ids()
        loaded_groups = self._loaded_groups(request)
        entries = []
        any_tail = False
        for gid in loaded_groups:
            info = self._groups[gid]
            if not info.has_tails:
                continue
            eb = info.effective_block
            any_tail = any_tail or tail_block(loaded, eb) is not None
            first = local // eb
            last = -(-loaded // eb)  # one past the last block the load writes
            ids = tuple(block_ids[gid][first:last])
            if _compat.NULL_BLOCK_ID in ids:  # sliding-window gaps: vLLM's null block
                ids = tuple(NULL_BLOCK if i == _compat.NULL_BLOCK_ID else i for i in ids)
            entries.append(GroupLoad(group=gid, first_block=first, block_ids=ids))
        if not entries or not (
            any_tail or keep or (self._policy.record_every_load and not tails_only)
        ):
            return None  # block-aligned: nothing stale to zero, nothing to watch
        return LoadRecord(request.request_id, local, loaded, tuple(entries))

    def _without_read_destinations(
        self, scheduler_output: Any, reads: dict[str, set[int]]
    ) -> list[int] | None:
        """vLLM's zero list without the READ destinations (None: nothing to
        drop); the caller sets it. Synchronous READs overwrite their
        destination blocks; zeroing them too can land after the RDMA READ.
        vLLM allows a sync READ connector to drop them
        (KVConnectorBase_V1.build_connector_meta); do it for every group."""
        dests = set().union(*reads.values())
        if not dests:
            return None
        before = scheduler_output.new_block_ids_to_zero
        kept = [b for b in before if b not in dests]
        removed = len(before) - len(kept)
        if not removed:
            return None
        self._stats.add("read_blocks_exempted", removed)
        logger.debug("kvtail: %d READ destination block(s) kept from zeroing", removed)
        return kept

    @property
    def num_tracked(self) -> int:
        """Requests with wrapper state (0 when idle: the leak check)."""
        return (
            len(self._matched)
            + len(self._entries)
            + len(self._entries_seen)
            + len(self._pending)
            + len(self._pending_reads)
            + len(self._in_flight)
            + len(self._failed)
            + len(self._producing)
            + len(self._claims)
            + len(self._provisional)
            + len(self._digesting)
            + len(self._provisional_digests)
            + len(self._verdicts)
            + len(self._false_vouched)
            + len(self._failing)
        )
