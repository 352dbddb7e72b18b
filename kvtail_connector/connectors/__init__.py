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

_BUILT_IN = frozenset(_BY_CLASS_NAME)

# pip extras by inner connector name prefix, for ImportErrors raised while loading one.
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


def register_adapter(class_name: str, adapter: type[InnerAdapter]) -> None:
    """Use ``adapter`` for inner connectors with ``class_name`` in their
    ancestry: how an out-of-tree connector tells the wrapper what its loads
    and transfers do (e.g. ``carries_producer_tail``). Built-in names cannot
    be replaced."""
    if not (isinstance(adapter, type) and issubclass(adapter, InnerAdapter)):
        raise TypeError(f"adapter for {class_name!r}: expected a InnerAdapter subclass")
    known = _BY_CLASS_NAME.get(class_name)
    if known is not None and known is not adapter and class_name in _BUILT_IN:
        raise ValueError(f"{class_name} has a built-in adapter ({known.__name__})")
    _BY_CLASS_NAME[class_name] = adapter


def extra_for(inner_name: str) -> str | None:
    for prefix, extra in EXTRAS.items():
        if inner_name.startswith(prefix):
            return extra
    return None


__all__ = [
    "InnerAdapter",
    "MultiConnectorAdapter",
    "adapter_for",
    "extra_for",
    "register_adapter",
]
