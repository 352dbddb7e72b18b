"""The ``kvtail`` entry on the scheduler side: a producer writes it, a
consumer reads it once per request.

The entry (:mod:`kvtail_connector.extras.entry`, its wire model) carries what two
parts say across the network: producer claims (``tail_zero``) and KV
verification (``dg``). A producer adds one entry per request, bound to the
transfer its params name and signed with the shared key, if any
(:class:`EntryWriter`). A consumer reads it before the inner
``update_state_after_alloc`` (NIXL push rewrites ``remote_block_ids`` there),
only for the features that are on, and hands each part its half
(:class:`EntryReader`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvtail_connector._version import __version__
from kvtail_connector.core.policy import TailPolicy
from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.extras import entry, entry_values, trust
from kvtail_connector.extras.metadata import EntryReport, ExpectedDigest, report_of
from kvtail_connector.log import get_logger

logger = get_logger(__name__)


class Reading(NamedTuple):
    """What a consumer read from a producer's entry for one load."""

    claim: int | None  # the prompt length a usable zero-tail claim covers
    expected: ExpectedDigest | None  # the digest to verify the load against


def decline(stats: KVTailStats, request: Any, why: str) -> None:
    """A producer claim not used: counted, and why at DEBUG."""
    stats.add("vouches_declined", 1)
    logger.debug("kvtail: %s: producer claim declined (%s)", request.request_id, why)


def binding_nodes(limits: entry_values.Limits, min_block_size: int) -> int:
    # A producer of a smaller block size (NIXL maps block size ratios)
    # sends up to 4x the block ids D's own would have.
    return trust.binding_nodes(limits, max(1, min_block_size // 4))


class FinishedParams:
    """The params of a producer's requests that finished in the
    ``update_from_output`` call now running, with their prompt lengths, until
    that call's ``update_connector_output`` says what the workers did (vLLM
    finishes requests, then updates the connector with the step's output, in
    one call). The dicts are the ones vLLM puts into the requests' outputs: an
    entry added to them before the call returns reaches the router. What a
    step without connector output leaves has left the engine: dropped at the
    next ``build_connector_meta``."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[str, tuple[dict[str, Any], int]] = {}

    def keep(self, req_id: str, params: dict[str, Any], num_tokens: int) -> None:
        self._held[req_id] = (params, num_tokens)

    def take(self) -> dict[str, tuple[dict[str, Any], int]]:
        held, self._held = self._held, {}
        return held

    def drop(self) -> None:
        self._held.clear()

    def forget(self, req_id: str) -> None:
        self._held.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._held)


def every_rank(worker_meta: Any, workers: int) -> EntryReport | None:
    """The step's report where every worker's metadata is folded into it
    (ranks are ids: a replayed output repeats a rank, never adds one), else None."""
    if worker_meta is not None and len(worker_meta.ranks) == workers:
        return report_of(worker_meta)
    return None


class EntryWriter:
    """A producer's entries.

    Args:
        geometry: this engine's tail geometry, as the entry states it.
        binding_nodes: the most values a transfer's binding may walk.
        key: the shared entry key (``entry_key_env``), or None.
        stats: counts ``tails_vouched`` and ``digests_sent``.
    """

    def __init__(
        self,
        geometry: entry_values.Geometry | None,
        *,
        binding_nodes: int,
        key: bytes | None,
        stats: KVTailStats,
    ) -> None:
        self._geometry = geometry
        self._binding_nodes = binding_nodes
        self._key = key
        self._stats = stats

    def send_all(
        self,
        claims: dict[str, tuple[dict[str, Any], int]],
        digests: dict[str, tuple[dict[str, Any], int, entry_values.Digest]],
    ) -> None:
        """One entry per request: its claim (params, prompt length) and/or its
        digest (params, prompt length, digest)."""
        # request id -> (its params, prompt length, tail confirmed, digest)
        sent: dict[str, tuple[dict[str, Any], int, bool, entry_values.Digest | None]] = {
            req_id: (params, n, True, None) for req_id, (params, n) in claims.items()
        }
        for req_id, (params, n, digest) in digests.items():
            sent[req_id] = (params, n, req_id in sent, digest)
        for req_id, (params, n, tail_zero, dg) in sent.items():
            self.send(req_id, params, n, tail_zero, dg)

    def send(
        self,
        req_id: str,
        params: dict[str, Any],
        num_tokens: int,
        tail_zero: bool,
        digest: entry_values.Digest | None,
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


class EntryReader:
    """A consumer's readings of producers' entries, once per request.

    Args:
        policy: which features read the entry (claims, verification).
        geometry: this engine's tail geometry (a claim holds only for the same).
        limits: what an entry can hold on this engine (its model).
        binding_nodes: the most values a transfer's binding may walk.
        key: the shared entry key (``entry_key_env``), or None.
        stats: the counters this side reports.
    """

    def __init__(
        self,
        policy: TailPolicy,
        *,
        geometry: entry_values.Geometry | None,
        limits: entry_values.Limits,
        binding_nodes: int,
        key: bytes | None,
        stats: KVTailStats,
    ) -> None:
        self._geometry = geometry
        self._limits = limits
        self._binding_nodes = binding_nodes
        self._key = key
        self._stats = stats
        # req_id -> the reading, taken at alloc; and every request's reading
        # until it finishes (``seen``: read once per request).
        self.readings: dict[str, Reading] = {}
        self.seen: dict[str, Reading] = {}
        # By load_async: what the reading is for (claims, bind, digest).
        # Claims are read where their path zeroes tails; the binding (and
        # MAC) only where something depends on it: a claim that can skip a
        # zeroing, or a digest that can fail a load.
        self._asks: dict[bool, tuple[bool, bool, bool]] = {}
        for load_async in (True, False):
            claims = policy.checks_claims and (
                policy.zeroes_tails if load_async else policy.zeroes_read_tails
            )
            digest = load_async and policy.verifies_loads
            usable = claims and (
                policy.trusts_load_claims if load_async else policy.trusts_read_claims
            )
            # A digest is bound too, where the entry has one (_read).
            self._asks[load_async] = (claims, usable, digest)
        # Whether a missing entry is counted (a digest to verify): else a
        # request without one has nothing to read.
        self.counts_absence = any(ask[2] for ask in self._asks.values())

    def read(self, request: Any, load_async: bool) -> None:
        """Read ``request``'s entry for the allocation that follows."""
        req_id = request.request_id
        seen = self.seen.get(req_id)
        if seen is not None:  # allocated again (0.32's MoRIIO re-matches): counted once
            self.readings[req_id] = seen
            return
        claims, bind, digest = self._asks[load_async]
        if entry.raw_entry(request.kv_transfer_params) is None:
            # No entry: nothing to remember (read again, it reads the same),
            # a digest's absence counted (under sampling, most loads). Read
            # once per load: only async loads count, and vLLM allocates an
            # async load once (NIXL clears do_remote_prefill there).
            if digest:
                self._stats.add("digests_absent", 1)
            return
        if claims or digest:
            found = self._read(request, claims=claims, bind=bind, digest=digest)
            self.readings[req_id] = self.seen[req_id] = found

    def take(self, req_id: str) -> Reading | None:
        """The reading for the allocation now running, if any."""
        return self.readings.pop(req_id, None) if self.readings else None

    def forget(self, req_id: str) -> None:
        self.readings.pop(req_id, None)
        self.seen.pop(req_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self.readings) + len(self.seen)

    def _read(self, request: Any, *, claims: bool, bind: bool, digest: bool) -> Reading:
        """The producer's ``kvtail`` entry of ``request``: ``(claim, expected)``.
        ``claim`` (with ``claims``): the prompt length a zero-tail claim
        covers, where the entry is valid, made for this geometry and (with
        ``bind``) bound to these params and MAC-checked with a key; anything
        else is counted in ``vouches_declined``. Without ``bind`` the claim
        can only be counted (``vouches_unused``), so the binding, which walks
        every block id of the params, is not computed. ``expected`` (with
        ``digest``): the producer's digest of this prompt under the same
        conditions, bound; a load without one is counted in ``digests_absent``
        (under sampling, most loads: their binding is not computed), one with
        a digest it cannot use in ``digests_skipped``."""
        params = request.kv_transfer_params
        # With a key the MAC covers the whole entry, dg included: walk it all.
        reading = entry.read(params, self._limits, digest=digest, walk_digest=self._key is not None)
        found, why = reading.entry, reading.why
        absent = why == "absent" if found is None else reading.digest_why == "absent"
        if found is not None and (bind or (digest and not absent)):
            why = self._bound(found, reading.raw, params)
        claim = None
        if claims and why != "absent":
            if found is None or why != "ok":
                decline(self._stats, request, why)
            elif found.tail_zero:
                if found.geometry == self._geometry:
                    claim = found.num_tokens
                else:
                    decline(self._stats, request, f"geometry {found.geometry} vs {self._geometry}")
            elif reading.raw is not None and "dg" not in reading.raw:
                decline(self._stats, request, "claims nothing")  # a digest alone claims no tail
        expected = None
        if digest:
            if found is not None and why == "ok" and found.digest is not None:
                # NIXL's producer stops short of the last prompt token(s) on
                # hybrids (the consumer recomputes them): n may be shorter.
                if found.num_tokens <= int(request.num_prompt_tokens):
                    expected = ExpectedDigest(found.num_tokens, found.digest)
                else:
                    why = "digest of a longer prompt"
            elif why == "ok":
                why = f"digest {reading.digest_why}"
            if expected is None and absent:
                self._stats.add("digests_absent", 1)
            elif expected is None:
                self._stats.add("digests_skipped", 1)
                logger.debug("kvtail: %s: no producer digest used (%s)", request.request_id, why)
        return Reading(claim, expected)

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
