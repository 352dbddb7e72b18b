"""Where an opt-in feature plugs into the core, on either side.

The core (:class:`~kvtail_connector.core.scheduler.TailScheduler`,
:class:`~kvtail_connector.core.worker.TailWorker`) records what async loads leave
stale, zeroes it, handles MoRIIO READs and contains failures on its own.
Features that need more (producer claims and the KV digest, which travel in
the ``kvtail`` entry: ``kvtail_connector.extras``) implement
:class:`SchedulerExtra` and :class:`WorkerExtra`; the assembly
(:func:`kvtail_connector.facade.assembly.assemble`) builds them where the policy
turns a feature on and hands them to the sides, which call each method at the
point its name says. The core imports no feature to do so. What a feature
ships per load travels in its own payload (``KVTailMetadata.extra``,
``KVTailWorkerMeta.extra``), keyed by request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kvtail_connector.core.metadata import KVTailWorkerMeta, LoadRecord

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    from kvtail_connector.core.cache_sets import CacheSet
    from kvtail_connector.core.parts.zeroing import StaleSlots

# The core's record of an async load: ``build(keep)`` is None where the load
# leaves nothing to zero (block-aligned, or the core zeroes no tails), unless
# ``keep``, which asks for a record all the same (a load to verify).
BuildRecord = Callable[[bool], "LoadRecord | None"]


class SchedulerExtra(Protocol):
    """The scheduler half of the features that travel in the ``kvtail`` entry."""

    def on_new_request(self, request: Any) -> None:
        """A request arrived (a producer notes the prefill legs it serves)."""

    def before_allocation(self, request: Any, is_async: bool) -> None:
        """Before the inner's ``update_state_after_alloc``, params as the producer sent them."""

    def async_load(
        self, request: Any, loaded: int, blocks: Any, groups: tuple[int, ...], build: BuildRecord
    ) -> LoadRecord | None:
        """An async load's record for the workers: ``build``'s, or None; what the
        feature adds to it goes in its step payload."""

    def sync_load(self, request: Any) -> Any:
        """A READ was allocated: what :meth:`read_load` gets back (opaque to the core)."""

    def read_load(self, request: Any, allocated: Any, record: LoadRecord) -> None:
        """A READ's tail record, at the metadata (``allocated``: :meth:`sync_load`'s)."""

    def step_payload(self, scheduler_output: Any, manager: Any) -> Any:
        """``KVTailMetadata.extra`` for this step's completing prompts and the loads
        recorded since the last call; None for nothing."""

    def request_finished(self, request: Any, params: dict[str, Any] | None) -> None:
        """``request`` finished; ``params`` go into its output."""

    def update_connector_output(
        self, connector_output: Any, worker_meta: KVTailWorkerMeta | None, in_flight: Any
    ) -> None:
        """The step's worker outcomes; ``in_flight``: the async loads in flight."""

    def loads_finished(self, req_ids: Iterable[str]) -> None:
        """These loads were reported finished."""

    def contain_alloc(self, req_id: str) -> None:
        """The allocation hook of ``req_id`` failed."""

    def contain_meta(self) -> None:
        """``build_connector_meta`` failed: what this step's payload held is dropped."""

    def contain_output(self, connector_output: Any) -> None:
        """``update_connector_output`` failed: no grant from this call."""

    def forget(self, req_id: str) -> None:
        """``on_new_request`` or ``request_finished`` failed for ``req_id``."""

    def held(self) -> AbstractSet[str]:
        """Requests held (the ``held_requests`` gauge)."""

    @property
    def num_tracked(self) -> int:
        """Entries held (0 when idle: the leak check)."""


class Completed(NamedTuple):
    """What a :class:`WorkerExtra` did with the clean loads of a completion pass.

    Attributes:
        settled: the loads whose tail the feature settles (the core does not
            zero it).
        to_zero: what the feature asks the pass's one launch to zero.
        num_tails: tails among ``to_zero`` (counted once the launch returned).
    """

    settled: AbstractSet[str] = frozenset()
    to_zero: Sequence[StaleSlots] = ()
    num_tails: int = 0


class WorkerExtra(Protocol):
    """The worker half of the features that travel in the ``kvtail`` entry."""

    def register(
        self, sets: list[CacheSet], kv_caches: Mapping[str, Any], kv_cache_config: Any
    ) -> None:
        """This rank's caches are mapped (``sets``: the zeroer's)."""

    def release(self) -> None:
        """Sleep mode released the KV memory."""

    def restore(self) -> None:
        """The KV memory is back."""

    def forget_released(self) -> None:
        """New caches supersede what sleep mode put away."""

    def bind(
        self, payload: Any, loads: tuple[LoadRecord, ...], read_loads: tuple[LoadRecord, ...]
    ) -> AbstractSet[str]:
        """This step's ``KVTailMetadata.extra`` and the core's new loads; returns the
        async loads the feature acts on in :meth:`completed`."""

    def produce(self) -> None:
        """The producer hook, after the core's work in it."""

    def reads_to_zero(self, records: list[LoadRecord], *, trusted: bool) -> list[LoadRecord]:
        """Those of ``records`` the core still zeroes (``trusted``: a claim may skip one)."""

    def completed(self, records: list[LoadRecord]) -> Completed:
        """A pass's clean loads (not failed, aborted or unmapped), before its launch."""

    def forget(self, req_ids: Iterable[str]) -> None:
        """These loads left the core: completed, dropped, failed, or READs zeroed on fallback."""

    def hold(self, results: KVConnectorTransferResults) -> KVConnectorTransferResults:
        """The pass's answer, with what the feature holds back or fails."""

    def reported(self) -> None:
        """What :meth:`hold` returned has reached vLLM."""

    def drop_held(self) -> set[str]:
        """After a contained failure: every load held, to report failed."""

    @property
    def idle(self) -> bool:
        """Nothing held: a pass with nothing completed has nothing here to do."""

    def report(self) -> Any:
        """This step's report (``KVTailWorkerMeta.extra``)."""

    def drop(self) -> None:
        """A contained failure: nothing of this step's producer work is reported."""

    def held(self) -> set[str]:
        """Requests held (the ``held_requests`` gauge)."""

    @property
    def num_tracked(self) -> int:
        """Entries held (0 when idle: the leak check)."""
