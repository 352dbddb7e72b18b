"""The hooks and questions the wrapper passes to the inner connector unchanged.

:class:`ForwardingConnector` is the base of
:class:`~kvtail_connector.facade.connector.KVTailConnector`: here vLLM sees the inner
connector as if unwrapped. Instance methods call ``self._inner``; the class
questions vLLM asks before any connector is built resolve the inner class from
the config (:func:`kvtail_connector.facade.inner.resolve`) and ask it.
``tests/scheduler/test_connector_surface.py`` checks, release by release, that
every public name of vLLM's connector base is either forwarded or answered by
the wrapper itself (``connector.OWN_ANSWERS``).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
)

from kvtail_connector import _compat
from kvtail_connector.facade.inner import Resolved, children_of, resolve, wrapper_fields

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def _resolved_with_children(kv_transfer_config: Any) -> Resolved:
    """:func:`resolve`, with an inner MultiConnector's children checked too:
    vLLM's own classmethods of MultiConnector iterate them (0.34 asks while
    it validates its config), and a bad child must be named by the wrapper's
    message, not fail inside vLLM."""
    resolved = resolve(kv_transfer_config)
    children_of(resolved.inner_cls, resolved.inner_transfer_config)
    return resolved


class ForwardingConnector(KVConnectorBase_V1):
    """Every hook and question the wrapper forwards unchanged to ``_inner``
    (the inner connector, which the subclass builds)."""

    _inner: KVConnectorBase_V1

    @property
    def inner(self) -> KVConnectorBase_V1:
        return self._inner

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._inner.supports_divergent_local_hybrid_hits

    @property
    def requires_kv_delivery(self) -> bool:
        return self._inner.requires_kv_delivery

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        return self._inner.get_mem_pool_context()

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self._inner.set_host_xfer_buffer_ops(copy_operation)

    def reset_capture_state(self) -> None:
        self._inner.reset_capture_state()

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def shutdown(self) -> None:
        self._inner.shutdown()

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self._inner.get_kv_connector_kv_cache_events()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._inner.get_handshake_metadata()

    def get_finished_count(self) -> int | None:
        return self._inner.get_finished_count()

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._inner.bind_gpu_block_pool(gpu_block_pool)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> Any:
        return self._inner.get_external_cache_hit_sources(request, num_external_tokens)

    def may_load_async(self, request: Any) -> bool:
        # vLLM 0.34 (--max-num-inflight-kv-loads); MultiConnector asks each child.
        return self._inner.may_load_async(request)  # type: ignore[attr-defined,no-any-return]

    def register_finished_partial_tail(
        self, request: Any, block_ids: tuple[list[int], ...], partial_tail_offloads: Any
    ) -> bool:
        return self._inner.register_finished_partial_tail(request, block_ids, partial_tail_offloads)

    def take_events(self) -> Iterable[Any]:
        return self._inner.take_events()

    def has_pending_block_frees(self) -> bool:
        return self._inner.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self._inner.has_pending_push_work()

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self._inner.set_xfer_handshake_metadata_pp_aware(metadata)

    def reset_cache(self) -> bool | None:
        return self._inner.reset_cache()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        _compat.check_vllm_version()  # asked before the connector is built
        assert vllm_config.kv_transfer_config is not None
        resolved = resolve(vllm_config.kv_transfer_config)
        return resolved.inner_cls.get_required_kvcache_layout(
            resolved.inner_vllm_config(vllm_config)
        )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        from vllm.config.kv_transfer import KVTransferConfig

        _compat.check_vllm_version()  # asked while vLLM builds its config
        # vLLM passes only the extra config (no role): only the class matters here.
        resolved = resolve(KVTransferConfig(kv_role="kv_both", **wrapper_fields(extra_config)))
        inner_extra_config = resolved.inner_transfer_config.kv_connector_extra_config
        return bool(resolved.inner_cls.requires_piecewise_for_cudagraph(inner_extra_config))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        _compat.check_vllm_version()  # asked while vLLM builds its config (0.33)
        resolved = resolve(kv_transfer_config)
        return _compat.inner_supports_sleep_mode(resolved.inner_cls, resolved.inner_transfer_config)

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        _compat.check_vllm_version()  # asked while vLLM builds its config (0.34)
        resolved = _resolved_with_children(kv_transfer_config)
        return bool(
            resolved.inner_cls.supports_lookahead_block_hashes(  # type: ignore[attr-defined]
                resolved.inner_transfer_config
            )
        )

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        # 0.34: decides how the extensible KV cache allocates (REGISTERS needs
        # single-chunk segments, EXPORTS_FABRIC fabric handles).
        _compat.check_vllm_version()
        resolved = _resolved_with_children(kv_transfer_config)
        return _compat.kv_cache_access(resolved.inner_transfer_config)
