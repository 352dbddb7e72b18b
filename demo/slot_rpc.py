"""The slot functions of ``slots`` as worker methods, for API servers.

An API server reaches its workers only through ``/collective_rpc`` (with
``VLLM_SERVER_DEV_MODE=1``), which calls a worker method *by name* with JSON
arguments. ``--worker-extension-cls demo.slot_rpc.SlotRPC``
mixes these methods into vLLM's worker class (vLLM's own extension point), so
the serving harness can poison and inspect a server's KV slots exactly as the
in-process harness does through ``LLM.collective_rpc``.

Values cross JSON: a fill value is a string (``"nan"``, ``"12345.0"``), and
block ids come back as string keys (JSON objects); ``api_server.APIServer``
converts them back.
"""

from __future__ import annotations

from typing import Any

from demo import slots


class SlotRPC:
    """Worker extension; ``self`` is the vLLM worker. Method names carry a prefix
    so they cannot collide with the worker's own."""

    def kvtail_fill_slots(
        self, block_ids: list[int], start: int, stop: int | None, value: str
    ) -> int:
        return slots.rpc_fill_slots(self, block_ids, int(start), stop, float(value))

    def kvtail_fill_state(self, block_ids: list[int], state: int, value: str) -> int:
        return slots.rpc_fill_state(self, block_ids, int(state), float(value))

    def kvtail_fill_all(self, value: str) -> int:
        return slots.rpc_fill_all(self, float(value))

    def kvtail_scrub_nan(self) -> int:
        return slots.rpc_scrub_nan(self)

    def kvtail_nan_census(self) -> dict[int, int]:
        return slots.rpc_nan_census(self)

    def kvtail_slot_counts(self, block_ids: list[int], kind: str) -> dict[str, Any]:
        return slots.rpc_slot_counts(self, block_ids, kind)

    def kvtail_layout(self) -> dict[str, dict[str, Any]]:
        return slots.rpc_layout(self)
