"""MultiConnector: every per-connector duty applies to each child, at its index.

MultiConnector builds one connector per entry of its ``connectors`` list, in
that order, and its metadata (``MultiKVConnectorMetadata.metadata``) is one
entry per child in the same order; each child keeps its own extra config.
So a child's adapter sees exactly what it would see as the inner connector: its
own metadata for READ destinations, its own settings for READ mode. vLLM's
name-keyed checks (``has_connector`` looks into a plain MultiConnector's
children, never through the wrapper) are applied to the children by
:mod:`kvtail_connector.facade.name_keyed`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .base import InnerAdapter


class MultiConnectorAdapter(InnerAdapter):
    """The children's adapters, by index in ``connectors``.

    Args:
        inner_extra_config: the MultiConnector's own extra config.
        children: ``(label, adapter)`` per child, in ``connectors`` order.
    """

    def __init__(
        self, inner_extra_config: dict[str, Any], children: Sequence[tuple[str, InnerAdapter]]
    ) -> None:
        super().__init__(inner_extra_config)
        self.children = tuple(children)

    def validate(self, vllm_config: Any, inner_name: str) -> None:
        for label, child in self.children:
            child.validate(vllm_config, f"{inner_name} child {label}")

    @property
    def sync_read(self) -> bool:
        return any(child.sync_read for _, child in self.children)

    @property
    def writes_past_the_fence(self) -> bool:
        return any(child.writes_past_the_fence for _, child in self.children)

    def read_destinations(self, inner_metadata: Any) -> Iterable[tuple[str, Any]]:
        # MultiKVConnectorMetadata: one entry per child, in connectors order.
        for (_, child), meta in zip(self.children, inner_metadata.metadata, strict=True):
            if child.sync_read:
                yield from child.read_destinations(meta)
