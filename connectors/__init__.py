"""Per-inner-connector adapters: what differs between the connectors we wrap.

Adapters are chosen by the inner connector class's ancestry (class names, so
that no optional transport is imported just to choose).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import InnerAdapter
from .mooncake_store import MooncakeStoreAdapter
from .moriio import MoRIIOAdapter
from .multi import MultiConnectorAdapter
from .nixl import NixlAdapter

_BY_CLASS_NAME: dict[str, type[InnerAdapter]] = {
    "NixlBaseConnector": NixlAdapter,
    "NixlConnector": NixlAdapter,
    "MooncakeStoreConnector": MooncakeStoreAdapter,
    "MoRIIOConnector": MoRIIOAdapter,
}

# pip extras by backend name prefix, for ImportErrors raised while loading one.
EXTRAS = {"Nixl": "nixl", "Mooncake": "mooncake", "MoRIIO": "moriio"}


def adapter_for(
    inner_cls: type,
    inner_extra_config: dict[str, Any],
    children: Sequence[tuple[str, InnerAdapter]] = (),
) -> InnerAdapter:
    """The adapter for ``inner_cls``. A MultiConnector gets its children's
    adapters (``(label, adapter)`` in ``connectors`` order), applied per child."""
    if any(klass.__name__ == "MultiConnector" for klass in inner_cls.__mro__):
        return MultiConnectorAdapter(inner_extra_config, children)
    for klass in inner_cls.__mro__:
        adapter = _BY_CLASS_NAME.get(klass.__name__)
        if adapter is not None:
            return adapter(inner_extra_config)
    return InnerAdapter(inner_extra_config)


def extra_for(backend_name: str) -> str | None:
    for prefix, extra in EXTRAS.items():
        if backend_name.startswith(prefix):
            return extra
    return None


__all__ = ["InnerAdapter", "MultiConnectorAdapter", "adapter_for", "extra_for"]
