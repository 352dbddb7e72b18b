"""Where an opt-in feature plugs into the scheduler side.

The core (:class:`~kvtail_connector.scheduler.TailScheduler`) records what
async loads leave stale, handles MoRIIO READs and contains failures on its
own. Features that need more (producer claims and the KV digest, which travel
in the ``kvtail`` entry) implement :class:`SchedulerExtra`; the assembly
(:func:`kvtail_connector.assembly.assemble`) builds one where the policy
turns a feature on and hands it to the scheduler, which calls each method at
the point its name says. The core imports no feature to do so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple, Protocol

from kvtail_connector.metadata import KVTailWorkerMeta, LoadRecord

# The core's record of an async load: ``build(keep)`` is None where the load
# leaves nothing to zero (block-aligned, or the core zeroes no tails), unless
# ``keep``, which asks for a record all the same (a load to verify).
BuildRecord = Callable[[bool], "LoadRecord | None"]


class StepRecords(NamedTuple):
    """What an extra ships to the workers with a step's metadata."""

    producer_tails: tuple[LoadRecord, ...] = ()
    producer_digests: tuple[LoadRecord, ...] = ()


class SchedulerExtra(Protocol):
    """The scheduler half of the features that travel in the ``kvtail`` entry."""

    def on_new_request(self, request: Any) -> None:
        """A request arrived (a producer notes the prefill legs it serves)."""

    def before_allocation(self, request: Any, is_async: bool) -> None:
        """A load is about to be allocated, before the inner connector's
        ``update_state_after_alloc``, while its params are as the producer sent them."""

    def async_load(
        self, request: Any, loaded: int, blocks: Any, groups: tuple[int, ...], build: BuildRecord
    ) -> LoadRecord | None:
        """The record the workers get for an async load of tokens up to
        ``loaded`` into ``blocks`` (the groups ``groups``): ``build``'s, kept,
        marked or attached to, or None."""

    def sync_load(self, request: Any) -> Any:
        """A synchronous READ was allocated: what :meth:`read_record` needs
        of it at the metadata (opaque to the core)."""

    def read_record(self, request: Any, allocated: Any, record: LoadRecord) -> LoadRecord:
        """A READ's tail record at the metadata (``allocated``: what
        :meth:`sync_load` returned), marked where the feature says."""

    def step_records(self, scheduler_output: Any, manager: Any) -> StepRecords:
        """What the workers do for this step's completing prompts."""

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

    def contain_output(self, connector_output: Any) -> None:
        """``update_connector_output`` failed: no grant from this call."""

    def forget(self, req_id: str) -> None:
        """``on_new_request`` or ``request_finished`` failed for ``req_id``."""

    def held(self) -> AbstractSet[str]:
        """Requests held (the ``held_requests`` gauge)."""

    @property
    def num_tracked(self) -> int:
        """Entries held (0 when idle: the leak check)."""
