"""MoRIIOConnector: synchronous READ loads land in blocks vLLM is zeroing."""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from .base import InnerAdapter


def runs_read_mode(inner_extra_config: dict[str, Any]) -> bool:
    """Whether MoRIIO runs in READ mode with this ``kv_connector_extra_config``,
    as MoRIIO decides it: by vLLM's own ``get_moriio_mode`` (the same function
    and module path in 0.32, 0.33 and 0.34), never by a copy of its parsing,
    which can drift (0.32's strips spaces: ``"true "`` is READ).

    ``get_moriio_mode`` reads only ``kv_connector_extra_config`` of the
    ``KVTransferConfig`` it is given, so a stand-in carrying that field (the
    adapter has no transfer config) gets the answer MoRIIO gets."""
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import (
        MoRIIOMode,
        get_moriio_mode,
    )

    config: Any = SimpleNamespace(kv_connector_extra_config=inner_extra_config)
    return bool(get_moriio_mode(config) == MoRIIOMode.READ)


class MoRIIOAdapter(InnerAdapter):
    """In READ mode the load is synchronous, so vLLM records its destination
    blocks for zeroing; the zeroing kernel can run after the RDMA READ landed.
    The wrapper drops READ destinations from ``new_block_ids_to_zero`` where
    MoRIIO does not (models without Mamba layers), and uses them to find the
    READs that overwrite a request's tail block.

    The mode is decided once, at construction, by :func:`runs_read_mode`
    (a MultiConnector asks each child's adapter every step)."""

    def __init__(self, inner_extra_config: dict[str, Any]) -> None:
        super().__init__(inner_extra_config)
        self._read = runs_read_mode(inner_extra_config)

    @property
    def sync_read(self) -> bool:
        return self._read

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
        # One list per transfer group: on a Mamba hybrid every attention group
        # first, then each Mamba group's running-state slot (never a
        # speculative scratch block: MoRIIO's clip_ssm_state_blocks).
        reqs = getattr(inner_metadata, "reqs_to_recv", None) or {}
        for req_id, meta in reqs.items():
            yield req_id, meta.local_block_ids
