"""MoRIIOConnector: synchronous READ loads land in blocks vLLM is zeroing."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .base import InnerAdapter


class MoRIIOAdapter(InnerAdapter):
    """In READ mode the load is synchronous, so vLLM records its destination
    blocks for zeroing; the zeroing kernel can run after the RDMA READ landed.
    The wrapper drops READ destinations from ``new_block_ids_to_zero``."""

    @property
    def sync_read(self) -> bool:
        # vLLM's get_moriio_mode: READ iff read_mode is "true" or "1".
        return str(self.inner_extra_config.get("read_mode", "false")).lower() in ("true", "1")

    @property
    def writes_past_the_fence(self) -> bool:
        # WRITE mode: the consumer's scheduler notifies the producer from
        # update_state_after_alloc, and the producer RDMA-writes at once.
        return not self.sync_read

    def carries_producer_tail(self, vllm_config: Any) -> bool:
        # READ: the consumer reads whole producer blocks after it has the
        # params. WRITE: the producer writes each layer during its forward,
        # before the wrapper's zeroing (and parallel WRITE never sends params).
        return self.sync_read

    def read_destinations(self, inner_metadata: Any) -> Iterable[tuple[str, Any]]:
        reqs = getattr(inner_metadata, "reqs_to_recv", None) or {}
        for req_id, meta in reqs.items():
            yield req_id, meta.local_block_ids
