"""The inner connector (``kv_connector_extra_config.backend``): resolved,
validated and built the way MultiConnector builds a child.

The inner connector gets the wrapper's ``kv_transfer_config`` with
``kv_connector``, ``kv_connector_module_path`` and
``kv_connector_extra_config`` replaced by ``backend``,
``backend_module_path`` and ``backend_extra_config``; every other field
(``kv_role``, ``engine_id``, ``kv_buffer_device``, ports, failure policy...)
is inherited unchanged.

:func:`resolve` is the one resolution (the config parsed, the inner transfer
config, the inner class) that the facade's build and its classmethods share.
Every way an inner connector can be wrong ends here, at start-up, in one
ValueError (ImportError for a missing transport) that names the field and the
fix. This module does not import the facade (which builds through it).
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

from kvtail_connector.config import PREFIX, KVTailConfig
from kvtail_connector.connectors import InnerAdapter, adapter_for, extra_for
from kvtail_connector.plugin import CONNECTOR_NAME

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

# The user's fields that name the inner connector, as messages name them.
BACKEND_FIELD = f"{PREFIX}.backend"
BACKEND_MODULE_PATH_FIELD = f"{PREFIX}.backend_module_path"
CHILDREN_FIELD = f"{PREFIX}.backend_extra_config.connectors"

WRAPPER_MARK = "is_kvtail_wrapper"
"""The class attribute ``KVTailConnector`` sets to True: a connector class that
has it (the wrapper or a subclass) cannot be wrapped. Looked up by name, so that
this module needs no import of the facade."""


def wrapper_fields(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``kv_transfer_config`` fields that name ``KVTailConnector``, with
    ``extra_config`` (a copy) as its ``kv_connector_extra_config``. Every other
    field (``kv_role``, ``kv_buffer_device``...) is the caller's."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": "kvtail_connector",
        "kv_connector_extra_config": dict(extra_config),
    }


def wrap_kv_transfer_config(plain: Mapping[str, Any], **options: Any) -> dict[str, Any]:
    """``plain`` (a plain connector's ``kv_transfer_config`` as a dict) with
    ``KVTailConnector`` around its connector: the inverse of
    :func:`inner_transfer_config`. The connector's name, module path and extra
    config move to ``backend``, ``backend_module_path`` and
    ``backend_extra_config``; ``options`` are the wrapper's other fields
    (``zero_tails``, ``probe_stale_tails``); every other field stays."""
    cfg = dict(plain)
    extra: dict[str, Any] = {"backend": cfg.pop("kv_connector")}
    module_path = cfg.pop("kv_connector_module_path", None)
    if module_path is not None:
        extra["backend_module_path"] = module_path
    if "kv_connector_extra_config" in cfg:
        extra["backend_extra_config"] = cfg.pop("kv_connector_extra_config")
    return {**cfg, **wrapper_fields({**extra, **options})}


def inner_transfer_config(outer: Any, cfg: KVTailConfig) -> Any:
    """The inner connector's ``KVTransferConfig`` (a new object; ``outer`` is untouched)."""
    return replace(
        outer,
        kv_connector=cfg.backend,
        kv_connector_module_path=cfg.backend_module_path,
        kv_connector_extra_config=copy.deepcopy(cfg.backend_extra_config),
    )


@dataclass(frozen=True)
class Resolved:
    """The wrapper's config and the connector inside it, resolved once.

    Attributes:
        cfg: the wrapper's settings (``kv_connector_extra_config``, parsed).
        inner_cls: the inner connector's class.
        inner_transfer_config: its ``KVTransferConfig`` (see
            :func:`inner_transfer_config`).
    """

    cfg: KVTailConfig
    inner_cls: type[KVConnectorBase_V1]
    inner_transfer_config: Any

    def inner_vllm_config(self, vllm_config: Any) -> Any:
        """A shallow copy of ``vllm_config`` whose transfer config names the inner
        connector: what the inner connector and its classmethods are given. Its
        transfer config is a new one each call (the inner connector owns its copy)."""
        inner = copy.copy(vllm_config)
        inner.kv_transfer_config = inner_transfer_config(vllm_config.kv_transfer_config, self.cfg)
        return inner


def resolve(kv_transfer_config: Any) -> Resolved:
    """Parse the wrapper's ``kv_transfer_config`` and resolve the inner class.

    Raises:
        ValueError: a bad setting or an inner connector that cannot be
            resolved or wrapped, naming the field and the fix.
        ImportError: the inner connector's transport is missing, naming the
            extra to install.
    """
    cfg = KVTailConfig.from_extra_config(kv_transfer_config.kv_connector_extra_config)
    transfer_config = inner_transfer_config(kv_transfer_config, cfg)
    cls = _resolve(cfg.backend, cfg.backend_module_path, transfer_config, _Fields.of_inner())
    return Resolved(cfg, cast("type[KVConnectorBase_V1]", cls), transfer_config)


@dataclass(frozen=True)
class _Fields:
    """Where a connector was named, for messages: the name's and the module path's field."""

    name: str
    module_path: str

    @classmethod
    def of_inner(cls) -> _Fields:
        return cls(BACKEND_FIELD, BACKEND_MODULE_PATH_FIELD)

    @classmethod
    def of_child(cls, index: int) -> _Fields:
        here = f"{CHILDREN_FIELD}[{index}]"
        return cls(f"{here}.kv_connector", f"{here}.kv_connector_module_path")


def _missing_extra_hint(name: str, field: str, error: ImportError) -> str:
    extra = extra_for(name)
    fix = f'pip install "kvtail-connector[{extra}]"' if extra else "install its transport"
    return f"{field}: {name} could not be imported ({error}); {fix}, then start vLLM again."


def _import_module_path(name: str, path: str, fields: _Fields) -> Any:
    try:
        return importlib.import_module(path)
    except ImportError as e:
        missing = getattr(e, "name", None) or ""
        if missing and (path == missing or path.startswith(missing + ".")):
            raise ValueError(
                f"{fields.module_path}: cannot import {path!r} ({e}); check the module path "
                "and that it is installed"
            ) from None
        raise ImportError(_missing_extra_hint(name, fields.name, e)) from e
    except Exception as e:
        # A module that fails at import for any other reason (a transport that
        # raises OSError while loading, a syntax error...): its own error is
        # chained below this one.
        raise ValueError(
            f"{fields.module_path}: importing {path!r} failed with {type(e).__name__}: {e}. "
            "Fix that module, or point the field at one that imports."
        ) from e


def _describe(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__name__}"


def _check_connector_class(obj: Any, name: str, path: str | None, fields: _Fields) -> type:
    """``obj`` if it is a connector class the wrapper can wrap, else one clear ValueError."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    where = f"{name!r} in module {path!r}" if path is not None else repr(name)
    if not isinstance(obj, type) or not issubclass(obj, KVConnectorBase_V1):
        raise ValueError(
            f"{fields.name}: {where} is {_describe(obj)}, not a vLLM KV connector (a subclass "
            "of KVConnectorBase_V1). Name the connector class to wrap."
        )
    if getattr(obj, WRAPPER_MARK, False) is True:
        what = "KVTailConnector" if WRAPPER_MARK in vars(obj) else "a subclass of KVTailConnector"
        raise ValueError(
            f"{fields.name}: {where} is {what}, and the wrapper cannot wrap itself. Name the "
            'connector it should wrap (e.g. "NixlConnector"); for several, wrap a '
            f"MultiConnector and list them in {CHILDREN_FIELD}."
        )
    return obj


def _resolve(name: str, path: str | None, transfer_config: Any, fields: _Fields) -> type:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if path is not None:
        # vLLM would getattr and inspect the attribute's signature first, which
        # ends in "no signature found" or "... is not a callable object" for
        # anything but a class: check what it is before vLLM looks.
        module = _import_module_path(name, path, fields)
        if not hasattr(module, name):
            raise ValueError(f"{fields.name}: {name!r} is not defined in module {path!r}")
        _check_connector_class(getattr(module, name), name, path, fields)
    try:
        cls = KVConnectorFactory.get_connector_class(transfer_config)
    except ImportError as e:
        raise ImportError(_missing_extra_hint(name, fields.name, e)) from e
    except ValueError as e:
        if path is not None:  # vLLM's own checks of an out-of-tree class
            raise ValueError(f"{fields.name}: {e}") from None
        known = ", ".join(sorted(n for n in KVConnectorFactory._registry if n != "KVTailConnector"))
        raise ValueError(
            f"{fields.name}: unknown connector {name!r}. Registered connectors: {known}. "
            f"For an out-of-tree connector also set {fields.module_path}."
        ) from None
    except Exception as e:
        raise ValueError(
            f"{fields.name}: loading the registered connector {name!r} failed with "
            f"{type(e).__name__}: {e}. Fix its installation (the error is chained below)."
        ) from e
    return _check_connector_class(cls, name, path, fields)


@dataclass(frozen=True)
class Child:
    """One connector an inner MultiConnector builds, at its index in ``connectors``.

    Attributes:
        label: the child as messages name it (its field and connector name).
        cls: its connector class.
        transfer_config: the ``KVTransferConfig`` MultiConnector builds it with.
        children: its own children, if it is a MultiConnector too.
    """

    label: str
    cls: type
    transfer_config: Any
    children: tuple[Child, ...]


def _is_multi(cls: type) -> bool:
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    return issubclass(cls, MultiConnector)


def children_of(cls: type, transfer_config: Any) -> tuple[Child, ...]:
    """The children an inner MultiConnector builds (``()`` for any other connector).

    Each gets the ``KVTransferConfig`` MultiConnector gives it: its own entry
    of ``connectors``, with the parent's ``engine_id`` unless it sets one.

    Raises:
        ValueError: naming ``backend_extra_config.connectors[i]`` for an entry
            vLLM could not build (not an object, bad fields, unknown or
            non-connector class, a KVTailConnector inside the wrapper).
    """
    if not _is_multi(cls):
        return ()
    from vllm.config.kv_transfer import KVTransferConfig

    entries = (transfer_config.kv_connector_extra_config or {}).get("connectors")
    if not isinstance(entries, list) or not entries:
        raise ValueError(
            f"{CHILDREN_FIELD}: a MultiConnector backend needs a non-empty list of connector "
            'configs, e.g. [{"kv_connector": "NixlConnector", "kv_role": "kv_both"}, ...]'
        )
    children = []
    for i, entry in enumerate(entries):
        fields = _Fields.of_child(i)
        here = f"{CHILDREN_FIELD}[{i}]"
        if not isinstance(entry, Mapping) or not entry.get("kv_connector"):
            raise ValueError(
                f'{here}: expected a connector config with "kv_connector" and "kv_role"; '
                f"got {entry!r}"
            )
        try:
            child_ktc = KVTransferConfig(**{"engine_id": transfer_config.engine_id, **entry})
        except Exception as e:  # noqa: BLE001 - pydantic, TypeError: all are the user's input
            raise ValueError(f"{here}: vLLM refuses this connector config: {e}") from None
        name = str(entry["kv_connector"])
        child_cls = _resolve(name, child_ktc.kv_connector_module_path, child_ktc, fields)
        children.append(
            Child(f"{here} ({name})", child_cls, child_ktc, children_of(child_cls, child_ktc))
        )
    return tuple(children)


def build_inner_adapter(
    cls: type, transfer_config: Any, children: tuple[Child, ...]
) -> InnerAdapter:
    """The adapter of ``cls``; a MultiConnector gets its children's, one per index."""
    return adapter_for(
        cls,
        dict(transfer_config.kv_connector_extra_config or {}),
        [(c.label, build_inner_adapter(c.cls, c.transfer_config, c.children)) for c in children],
    )


def hma_blocker(label: str, transfer_config: Any, children: tuple[Child, ...]) -> str | None:
    """The label of a connector that cannot run with the hybrid KV cache manager, or None.

    vLLM's own rule, ``KVConnectorFactory.supports_hma_config`` (the same in
    0.32 and 0.33): a connector supports HMA if its class does, a
    MultiConnector if every child does. vLLM applies it to the top-level
    connector only, where it sees the wrapper (which always supports HMA);
    this applies it to the inner connector and names the innermost child at fault.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for child in children:
        found = hma_blocker(child.label, child.transfer_config, child.children)
        if found is not None:
            return found
    return None if KVConnectorFactory.supports_hma_config(transfer_config) else label


def build_inner(
    resolved: Resolved, vllm_config: Any, role: Any, kv_cache_config: Any
) -> KVConnectorBase_V1:
    """Instantiate the inner connector; ImportErrors name the extra to install."""
    try:
        return resolved.inner_cls(resolved.inner_vllm_config(vllm_config), role, kv_cache_config)
    except ImportError as e:
        raise ImportError(_missing_extra_hint(resolved.cfg.backend, BACKEND_FIELD, e)) from e
