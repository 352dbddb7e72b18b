"""One layer's KV page as the page maps judge it: the view vLLM hands the
connector, the spec that shaped it, and the backend that writes and reads it.

The backend is identified by its class path, not by ``get_name()``: vLLM's
ROCm AITER FlashAttention backend, for one, reports ``"FLASH_ATTN"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def _backend_class(layer: Any) -> type | None:
    backend = getattr(layer, "attn_backend", None)
    if isinstance(backend, type):
        return backend
    get_backend = getattr(layer, "get_attn_backend", None)
    if callable(get_backend):
        try:
            backend = get_backend()
        except Exception:  # a layer that cannot name its backend has none we know
            return None
        if isinstance(backend, type):
            return backend
    return None


@dataclass(frozen=True)
class EngineFacts:
    """What the engine's configuration says about who writes the pages.

    Attributes:
        fused_kv_writer: the setting that turns off the compile pass under
            which vLLM's ROCm graph writes the KV pages with a fused AITER op
            (QK-norm/RoPE/cache insert) instead of the backend's own writer,
            whose addressing of a strided page is not in vLLM's source; None
            where no such pass runs (``_compat.fused_kv_writer``).
    """

    fused_kv_writer: str | None = None


# The facts of an engine that names none of the writers above.
PLAIN_ENGINE = EngineFacts()


@dataclass(frozen=True)
class LayerPage:
    """What decides which bytes of a layer's page each token slot owns.

    Attributes:
        name: the layer (a ``kv_cache_groups[*].layer_names`` entry).
        view: the layer's ``[B, H, N, C]`` view from ``register_kv_caches``.
        spec: the layer's ``AttentionSpec`` (after the backend's
            ``customize_spec``).
        layer: the layer object (``static_forward_context[name]``), None
            where vLLM gave none.
        engine: what the engine's configuration says about its writers.
    """

    name: str
    view: torch.Tensor
    spec: Any
    layer: Any = None
    engine: EngineFacts = PLAIN_ENGINE

    @property
    def backend(self) -> type | None:
        """The layer's attention backend class, None where it names none."""
        return _backend_class(self.layer)

    @property
    def backend_path(self) -> str | None:
        """``module.QualName`` of the backend class: what the maps key on."""
        cls = self.backend
        return None if cls is None else f"{cls.__module__}.{cls.__qualname__}"

    @property
    def backend_name(self) -> str | None:
        """The backend's ``get_name()``, for messages."""
        cls = self.backend
        get_name = getattr(cls, "get_name", None)
        if not callable(get_name):
            return None
        try:
            return str(get_name())
        except Exception:
            return None

    @property
    def kv_cache_dtype(self) -> str:
        """The layer's ``kv_cache_dtype`` string ("auto" where none is set)."""
        for value in (
            getattr(self.layer, "kv_cache_dtype", None),
            getattr(self.spec, "cache_dtype_str", None),
        ):
            if isinstance(value, str) and value:
                return value
        return "auto"

    @property
    def quant_mode(self) -> str:
        """``spec.kv_quant_mode``'s member name ("NONE" where unset)."""
        mode = getattr(self.spec, "kv_quant_mode", None)
        return str(getattr(mode, "name", "NONE"))

    def field(self, name: str, default: Any = None) -> Any:
        """A spec field, ``default`` where this release's spec has none."""
        return getattr(self.spec, name, default)

    def describe(self) -> str:
        """The layer, its backend and dtype, for messages."""
        backend = self.backend_name or "no attention backend"
        if self.backend_path and self.backend_name:
            backend = f"{self.backend_name} ({self.backend_path})"
        return (
            f"layer {self.name!r} (backend {backend}, kv_cache_dtype {self.kv_cache_dtype!r}, "
            f"{type(self.spec).__name__})"
        )
