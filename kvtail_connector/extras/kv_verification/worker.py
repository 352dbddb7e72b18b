"""KV verification (``verify_kv: digest``), worker half.

A producer digests the prompts whose tails the step completes, in the
producer hook after their zeroing (which writes only slots past them),
without waiting; the parts travel in the worker metadata. A consumer digests
each completed load that came with the producer's digest before anything
reads it, holds its completion out of ``finished_recving`` until the sums are
on the host and compared, and reports a mismatch in ``failed_recving``
(:mod:`~kvtail_connector.extras.kv_verification.rank_digests`).
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvtail_connector.core.cache_sets import CacheSet
from kvtail_connector.extras.kv_verification.placement import HeadPlacement
from kvtail_connector.extras.kv_verification.rank_digests import PlannedPrompt, RankDigests
from kvtail_connector.extras.kv_verification.rank_states import RankStates, StateSet
from kvtail_connector.extras.metadata import CheckedLoad, DigestPart, combined_verdict
from kvtail_connector.log import get_logger

logger = get_logger(__name__)


class VerificationWorker:
    """This rank's digests: a producer's prompts, a consumer's held loads.

    Args:
        heads: this rank's TP placement of the KV heads.
        verifies_loads: this rank checks loads (a consumer).
    """

    def __init__(self, heads: HeadPlacement, *, verifies_loads: bool) -> None:
        self._heads = heads
        self._verify_loads = verifies_loads
        self._digests: RankDigests | None = None
        self._released: RankDigests | None = None
        # State groups (hybrids): checked beside the attention digests; a
        # load both hold is released once both compared (``_waiting``
        # between), a mismatch of either fails it.
        self._states: RankStates | None = None
        self._released_states: RankStates | None = None
        self._waiting: set[str] = set()
        self._bad: set[str] = set()
        # A producer's prompts bound this step (planned, or records where no
        # caches were registered yet).
        self._records: list[PlannedPrompt | CheckedLoad] = []
        self._parts: dict[str, DigestPart] = {}  # and their sums, for the worker metadata

    def register(self, sets: list[CacheSet], states: list[StateSet] | None = None) -> None:
        self._released = self._released_states = None
        self._digests = self._states = None  # new caches: nothing of the old ones
        digests = RankDigests(sets, self._heads)
        ranks = RankStates(states or [], self._heads.tp_rank, self._heads.tp_size)
        digests.warmup()
        # Registered once built and compiled: a failure leaves the digest off.
        self._digests, self._states = digests, ranks if ranks else None

    def release(self) -> None:
        if self._digests is not None:
            # Loads completing while released are reported failed without a
            # pass that would drop their plans: none is kept for restore().
            self._digests.forget_all_plans()
        self._released, self._digests = self._digests, None
        self._released_states, self._states = self._states, None

    def restore(self) -> None:
        self._digests, self._released = self._released, None
        self._states, self._released_states = self._released_states, None

    def forget_released(self) -> None:
        """New caches supersede what sleep mode put away (never restored)."""
        self._released = self._released_states = None

    # -------------------------------------------------------------- producer

    def bind(
        self, producer_digests: Iterable[CheckedLoad], loads: Iterable[CheckedLoad] = ()
    ) -> None:
        """Plan this step's producer prompts and, on a consumer, its new loads
        carrying a digest, so that the hook and the completion only launch."""
        digests = self._digests
        records = list(producer_digests)
        if digests is None:
            self._records.extend(records)
            return
        try:
            self._records.extend(digests.plan_prompts(records))
        except Exception:  # planned (and failing, contained) in the hook, as unplanned
            self._records.extend(records)
        if self._verify_loads:
            digests.plan_loads(loads)

    def digest_prompts(self) -> None:
        """In the producer hook, after the tails' zeroing."""
        records, self._records = self._records, []
        if records and self._digests is not None:
            parts = self._digests.digest_prompts(records)
            if self._states is not None:
                plain = [r.record if isinstance(r, PlannedPrompt) else r for r in records]
                for req_id, state in self._states.digest_prompts(plain).items():
                    if req_id in parts:
                        parts[req_id].states = state
            self._parts.update(parts)

    def take_parts(self) -> dict[str, DigestPart]:
        """The sums since the last call (for the worker metadata); prompts
        bound but never digested (the hook did not run) are dropped."""
        if self._records:
            logger.debug("kvtail: %d producer prompt(s) not digested", len(self._records))
            self._records = []
        parts, self._parts = self._parts, {}
        return parts

    def drop(self) -> None:
        """A contained failure: nothing of this step is sent."""
        self._records = []
        self._parts = {}

    # -------------------------------------------------------------- consumer

    def check(self, records: list[CheckedLoad]) -> None:
        """Digest these completed loads (each with ``expected``), before the
        zeroing launch (disjoint slots) and before the scheduler can hand the
        blocks to a forward."""
        if records and self._digests is not None:
            self._digests.check_loads(records)
            if self._states is not None:
                self._states.check_loads(records)

    def hold(self, results: KVConnectorTransferResults) -> KVConnectorTransferResults:
        """Completions whose digest is on its way are held; those compared now
        (attention and state digests both, where both hold it) are released,
        a mismatch as a failed load."""
        digests, states = self._digests, self._states
        if not self._verify_loads or digests is None:
            return results
        # Completed loads never digested (failed, aborted) leave no plan behind.
        digests.forget_plans(results.finished_recving)
        digests.forget_plans(results.failed_recving)
        if self.idle:
            # No load checked in this pass or held from an earlier one: the
            # usual pass under sampling (bench_worker_gpu.py, "a step with no
            # sampled request").
            return results
        if states is None:
            held = {r for r in results.finished_recving if r in digests}
            released, mismatched = digests.release()
        else:
            held = {r for r in results.finished_recving if r in digests or r in states}
            done_a, bad_a = digests.release()
            done_s, bad_s = states.release()
            self._bad |= bad_a | bad_s
            done = done_a | done_s | self._waiting
            still = digests.held | states.held
            released = done - still
            self._waiting = done & still
            mismatched = released & self._bad
            self._bad -= released
        if not held and not released:
            return results
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=(set(results.finished_recving) - held) | released,
            failed_recving=(set(results.failed_recving) - held) | mismatched,
        )

    def reported(self) -> None:
        """What :meth:`hold` returned has reached vLLM."""
        if self._verify_loads and self._digests is not None:
            self._digests.reported()
            if self._states is not None:
                self._states.reported()

    def drop_held(self) -> set[str]:
        """Every load held or released unreported, uncompared (after a
        contained failure: the caller reports them failed)."""
        dropped = self._digests.drop_held() if self._digests is not None else set()
        if self._states is not None:
            dropped |= self._states.drop_held()
        dropped |= self._waiting
        self._waiting, self._bad = set(), set()
        return dropped

    def take_differs(self) -> dict[str, str]:
        """What differs in each mismatched load (the KV's finding first)."""
        differs = self._digests.take_differs() if self._digests is not None else {}
        if self._states is not None:
            differs = {**self._states.take_differs(), **differs}
        return differs

    def take_verdicts(self) -> dict[str, str]:
        verdicts = self._digests.take_verdicts() if self._digests is not None else {}
        if self._states is not None:
            for req_id, found in self._states.take_verdicts().items():
                have = verdicts.get(req_id)
                verdicts[req_id] = found if have is None else combined_verdict(have, found)
        return verdicts

    @property
    def has_report(self) -> bool:
        """Sums, verdicts or prompts to drop this step (else the take_* calls
        return nothing: skipped on the usual step under sampling)."""
        return bool(self._parts or self._records) or not self.idle

    @property
    def idle(self) -> bool:
        """No completion waits for a digest and no verdict is pending: a pass
        with nothing completed has nothing here to do (a conservative test:
        a pending verdict counts as not idle)."""
        digests, states = self._digests, self._states
        return (
            not self._waiting
            and (digests is None or not digests.busy)
            and (states is None or not states.num_tracked)
        )

    def held(self) -> set[str]:
        held = self._digests.held if self._digests is not None else set()
        if self._states is not None:
            held |= self._states.held
        return held | self._waiting

    @property
    def num_tracked(self) -> int:
        digests = self._digests.num_tracked if self._digests is not None else 0
        states = self._states.num_tracked + len(self._bad) if self._states is not None else 0
        return len(self._records) + len(self._parts) + digests + states + len(self._waiting)
