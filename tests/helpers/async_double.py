"""A transport test double: an inner KV connector whose loads are async.

It stands in for NIXL / MoRIIO / MooncakeStore underneath the kvtail wrapper in
scheduler tests: the scheduler side announces external tokens as an async load,
the worker side reports the load finished (or failed) some steps later. It moves
no bytes and patches nothing in vLLM; it only answers the connector API the way a
real P/D transport does, and records what it was asked.

Per request, everything is driven by ``kv_transfer_params``:

* ``double_load_tokens: K``: K prompt tokens exist remotely. The scheduler side
  reports ``K - num_computed_tokens`` of them (if positive) as an async load,
  once: like NIXL's ``do_remote_prefill``, a consumed load is not offered again,
  so a failed load falls back to local recompute instead of looping.
* ``double_finish_after_steps: n`` (default: extra config
  ``finish_after_steps``, else 1): the worker reports the load in the n-th
  ``get_transfer_results`` call counting the one of the step that started it
  (1 = the same step).
* ``double_fail: True``: the load finishes as failed (``failed_recving``, which,
  as vLLM's contract says, is also in ``finished_recving``).
* ``double_invalid_block_indices: [i, ...]``: when the load finishes, the block
  ids at these indices of the request's first KV cache group are reported
  through ``get_block_ids_with_load_errors`` in the same step.
* ``double_invalid_late: True``: report those ids one pass *after* the load
  finished instead (a transport that breaks vLLM's "no later than the
  finishing pass" rule).

* ``do_remote_decode: True`` (a producer's request): ``request_finished``
  returns P/D params naming the request's blocks, as NIXL's producer does.

Its adapter (:class:`AsyncLoadDoubleAdapter`) says the transfer carries the
producer's whole blocks, as NIXL's does, so producer claims apply to it.

Tests holding the worker instance can also call ``fail_request`` or
``report_invalid_blocks`` directly.

Load it by registered name (``AsyncLoadDouble``, registered on import) or with
``kv_connector="AsyncLoadDouble"``,
``kv_connector_module_path="tests.helpers.async_double"``.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtail_connector.connectors import InnerAdapter, register_adapter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

CONNECTOR_NAME = "AsyncLoadDouble"
MODULE_PATH = "tests.helpers.async_double"

LOAD_TOKENS_KEY = "double_load_tokens"
FINISH_AFTER_KEY = "double_finish_after_steps"
FAIL_KEY = "double_fail"
INVALID_BLOCKS_KEY = "double_invalid_block_indices"
INVALID_LATE_KEY = "double_invalid_late"


@dataclass(frozen=True)
class LoadSpec:
    """One async load as shipped to the workers."""

    req_id: str
    block_ids: tuple[list[int], ...]  # per KV cache group, as allocated
    num_tokens: int  # external tokens to load
    finish_after_steps: int
    fail: bool
    invalid_block_indices: tuple[int, ...]
    invalid_late: bool = False


@dataclass
class AsyncLoadDoubleMetadata(KVConnectorMetadata):
    loads: dict[str, LoadSpec] = field(default_factory=dict)


@dataclass
class _InflightLoad:
    spec: LoadSpec
    steps_left: int


class AsyncLoadDouble(KVConnectorBase_V1, SupportsHMA):
    # A P/D transport: hits come from a peer engine.
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.default_finish_after_steps: int = int(extra.get("finish_after_steps", 1))

        # Every call, in order: (method, request id or "", details).
        self.calls: list[tuple[str, str, Any]] = []

        # Scheduler side.
        self.blocks_by_req: dict[str, tuple[list[int], ...]] = {}
        self._consumed: set[str] = set()  # loads already handed out
        self._pending_loads: dict[str, LoadSpec] = {}  # until the next metadata
        # Logs (never pruned): ids seen in update_connector_output.
        self.finished_recving_seen: set[str] = set()
        self.failed_recving_seen: set[str] = set()

        # Worker side.
        self._inflight: dict[str, _InflightLoad] = {}
        self._forced_failures: set[str] = set()
        self._forced_invalid: defaultdict[str, set[int]] = defaultdict(set)
        self._load_errors_to_report: set[int] = set()
        self._late_load_errors: set[int] = set()  # reported one pass late
        self.finished_req_ids_seen: set[str] = set()

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.calls.append(("get_num_new_matched_tokens", request.request_id, num_computed_tokens))
        params = request.kv_transfer_params or {}
        total = params.get(LOAD_TOKENS_KEY)
        if total is None or request.request_id in self._consumed:
            return 0, False
        if total > request.num_prompt_tokens:
            raise ValueError(
                f"{LOAD_TOKENS_KEY}={total} exceeds the prompt ({request.num_prompt_tokens} tokens)"
            )
        num_new = total - num_computed_tokens
        return (num_new, True) if num_new > 0 else (0, False)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # A transport restores every transferable group (as NIXL and MoRIIO
        # answer), not only the prefix-cacheable ones a hash store holds.
        return self._kv_cache_config.transfer_group_ids

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        block_ids = blocks.get_block_ids()
        self.calls.append(("update_state_after_alloc", req_id, (num_external_tokens, block_ids)))
        self.blocks_by_req[req_id] = block_ids
        if num_external_tokens == 0:
            return
        params = request.kv_transfer_params or {}
        self._consumed.add(req_id)
        self._pending_loads[req_id] = LoadSpec(
            req_id=req_id,
            block_ids=block_ids,
            num_tokens=num_external_tokens,
            finish_after_steps=int(params.get(FINISH_AFTER_KEY, self.default_finish_after_steps)),
            fail=bool(params.get(FAIL_KEY, False)),
            invalid_block_indices=tuple(params.get(INVALID_BLOCKS_KEY, ())),
            invalid_late=bool(params.get(INVALID_LATE_KEY, False)),
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> AsyncLoadDoubleMetadata:
        meta = AsyncLoadDoubleMetadata(loads=self._pending_loads)
        self._pending_loads = {}
        self.calls.append(("build_connector_meta", "", sorted(meta.loads)))
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        finished = set(connector_output.finished_recving or ())
        failed = set(connector_output.failed_recving or ())
        self.calls.append(("update_connector_output", "", (finished, failed)))
        self.finished_recving_seen |= finished
        self.failed_recving_seen |= failed

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("request_finished", request.request_id, block_ids))
        self._forget(request.request_id)
        return False, _producer_params(request, [block_ids])

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("request_finished_all_groups", request.request_id, block_ids))
        self._forget(request.request_id)
        return False, _producer_params(request, list(block_ids))

    def _forget(self, req_id: str) -> None:
        self.blocks_by_req.pop(req_id, None)
        self._consumed.discard(req_id)
        self._pending_loads.pop(req_id, None)

    def scheduler_state_is_empty(self) -> bool:
        """Whether no per-request state is left (for leak checks)."""
        return not (self.blocks_by_req or self._consumed or self._pending_loads)

    # --------------------------------------------------------------- worker side

    def fail_request(self, req_id: str) -> None:
        """Make the load of ``req_id`` finish as failed."""
        self._forced_failures.add(req_id)

    def report_invalid_blocks(self, req_id: str, block_ids: set[int]) -> None:
        """Report ``block_ids`` as load errors when ``req_id``'s load finishes."""
        self._forced_invalid[req_id] |= block_ids

    def start_load_kv(self, forward_context: ForwardContext | None, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, AsyncLoadDoubleMetadata)
        for req_id, spec in meta.loads.items():
            self._inflight[req_id] = _InflightLoad(spec, spec.finish_after_steps)
        self.calls.append(("start_load_kv", "", sorted(meta.loads)))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Aborted requests keep loading: like a real transport, the load is
        # reported finished anyway, and that is what frees their blocks.
        self.finished_req_ids_seen |= finished_req_ids
        self._load_errors_to_report |= self._late_load_errors
        self._late_load_errors = set()
        results = KVConnectorTransferResults()
        for req_id in list(self._inflight):
            load = self._inflight[req_id]
            load.steps_left -= 1
            if load.steps_left > 0:
                continue
            del self._inflight[req_id]
            results.finished_recving.add(req_id)
            if load.spec.fail or req_id in self._forced_failures:
                results.failed_recving.add(req_id)
            self._forced_failures.discard(req_id)
            first_group = load.spec.block_ids[0] if load.spec.block_ids else []
            errors = {first_group[i] for i in load.spec.invalid_block_indices}
            errors |= self._forced_invalid.pop(req_id, set())
            if load.spec.invalid_late:
                self._late_load_errors |= errors
            else:
                self._load_errors_to_report |= errors
        self.calls.append(
            (
                "get_transfer_results",
                "",
                (set(results.finished_recving), set(results.failed_recving)),
            )
        )
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors_to_report = self._load_errors_to_report, set()
        return errors

    def worker_state_is_empty(self) -> bool:
        return not (
            self._inflight
            or self._load_errors_to_report
            or self._late_load_errors
            or self._forced_invalid
            or self._forced_failures
        )


def _producer_params(request: Request, block_ids: list[list[int]]) -> dict[str, Any] | None:
    """A producer's P/D params for a remote-decode request (None otherwise),
    with what identifies the transfer as NIXL's producer returns it."""
    if not (request.kv_transfer_params or {}).get("do_remote_decode"):
        return None
    return {
        "do_remote_prefill": True,
        "remote_block_ids": [list(b) for b in block_ids],
        "remote_engine_id": "double-producer",
        "remote_request_id": request.request_id,
    }


class AsyncLoadDoubleAdapter(InnerAdapter):
    """The double stands in for a peer transport that copies whole blocks."""

    def carries_producer_tail(self, vllm_config: Any) -> bool:
        return True


def register() -> None:
    """Register the double by name; safe to call any number of times."""
    # ValueError means already registered: a re-import, or another test got there first.
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)
    register_adapter(CONNECTOR_NAME, AsyncLoadDoubleAdapter)


register()
