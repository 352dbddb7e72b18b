"""Resolve and build the inner connector the way MultiConnector builds a child.

The inner connector gets the wrapper's ``kv_transfer_config`` with
``kv_connector``, ``kv_connector_module_path`` and
``kv_connector_extra_config`` replaced by ``backend``,
``backend_module_path`` and ``backend_extra_config``; every other field
(``kv_role``, ``engine_id``, ``kv_buffer_device``, ports, failure policy...)
is inherited unchanged.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, cast

from kvtail_connector import _compat
from kvtail_connector.config import PREFIX, KVTailConfig
from kvtail_connector.connectors import extra_for

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1


def inner_transfer_config(outer: Any, cfg: KVTailConfig) -> Any:
    """The inner connector's ``KVTransferConfig`` (a new object; ``outer`` is untouched)."""
    return _compat.replace_transfer_config(
        outer,
        kv_connector=cfg.backend,
        kv_connector_module_path=cfg.backend_module_path,
        kv_connector_extra_config=copy.deepcopy(cfg.backend_extra_config),
    )


def inner_vllm_config(vllm_config: Any, cfg: KVTailConfig) -> Any:
    """A shallow copy of ``vllm_config`` whose transfer config names the inner connector."""
    inner = copy.copy(vllm_config)
    inner.kv_transfer_config = inner_transfer_config(vllm_config.kv_transfer_config, cfg)
    return inner


def _missing_extra_hint(cfg: KVTailConfig, error: ImportError) -> str:
    extra = extra_for(cfg.backend)
    fix = f'pip install "kvtail-connector[{extra}]"' if extra else "install its transport"
    return (
        f"{PREFIX}.backend: {cfg.backend} could not be imported ({error}); {fix}, "
        "then start vLLM again."
    )


def resolve_backend_class(cfg: KVTailConfig, inner_ktc: Any) -> type[KVConnectorBase_V1]:
    """The inner connector class, or a ValueError/ImportError that says how to fix it."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        return cast("type[KVConnectorBase_V1]", KVConnectorFactory.get_connector_class(inner_ktc))
    except ImportError as e:
        missing = getattr(e, "name", None) or ""
        path = cfg.backend_module_path
        if path is not None and missing and (path == missing or path.startswith(missing + ".")):
            raise ValueError(
                f"{PREFIX}.backend_module_path: cannot import {cfg.backend_module_path!r} "
                f"({e}); check the module path and that it is installed"
            ) from None
        raise ImportError(_missing_extra_hint(cfg, e)) from e
    except AttributeError:
        raise ValueError(
            f"{PREFIX}.backend: {cfg.backend!r} is not defined in module "
            f"{cfg.backend_module_path!r}"
        ) from None
    except ValueError as e:
        if cfg.backend_module_path is not None:
            raise ValueError(f"{PREFIX}.backend: {e}") from None
        known = ", ".join(sorted(n for n in KVConnectorFactory._registry if n != "KVTailConnector"))
        raise ValueError(
            f"{PREFIX}.backend: unknown connector {cfg.backend!r}. Registered connectors: "
            f"{known}. For an out-of-tree connector also set {PREFIX}.backend_module_path."
        ) from None


def build_inner(
    cls: type, inner_config: Any, role: Any, kv_cache_config: Any, cfg: KVTailConfig
) -> Any:
    """Instantiate the inner connector; ImportErrors name the extra to install."""
    try:
        return cls(inner_config, role, kv_cache_config)
    except ImportError as e:
        raise ImportError(_missing_extra_hint(cfg, e)) from e
