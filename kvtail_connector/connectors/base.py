"""The adapter interface: what the wrapper does differently per inner connector
(the connector named by ``kv_connector_extra_config.backend``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class InnerAdapter:
    """Defaults for a connector that needs nothing special (any async loader)."""

    def __init__(self, inner_extra_config: dict[str, Any]) -> None:
        self.inner_extra_config = inner_extra_config

    def validate(self, vllm_config: Any, inner_name: str) -> None:
        """Refuse, at start-up, configurations this connector cannot run behind
        the wrapper (for out-of-tree adapters; vLLM's name-keyed checks are
        applied by :mod:`kvtail_connector.facade.name_keyed`). Raise ValueError naming
        the setting and the fix."""

    @property
    def sync_read(self) -> bool:
        """Loads complete synchronously by RDMA READ into blocks vLLM zeroes."""
        return False

    @property
    def writes_past_the_fence(self) -> bool:
        """A new owner's KV can arrive without the worker's ``start_load_kv``
        (the fence that orders it after earlier zeroing): the transfer is
        started from the scheduler side."""
        return False

    def carries_producer_tail(self, vllm_config: Any) -> bool:
        """The transfer copies the producer's whole blocks, and only after the
        producer's step output has left (the consumer asks for them with the
        request's ``kv_transfer_params``): a tail the producer zeroed in its
        step arrives zeroed. Producers vouch, and consumers trust, only then."""
        return False

    def read_destinations(self, inner_metadata: Any) -> Iterable[tuple[str, Any]]:
        """``(request id, per-group local block ids)`` the READs of this step write."""
        return ()
