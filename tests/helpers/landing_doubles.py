"""Transport doubles that move bytes, and worker caches, for the differential run
(scripts/differential.py).

:class:`LandingLoadDouble` is the async transport double of
``tests/helpers/async_double.py`` whose loads also write the KV cache when they
complete, as NIXL's do: the producer's whole blocks (tail included) where the
driver filed them in :data:`SOURCES`, else deterministic noise with a NaN in
each block's last slot. A failed load writes its first half. Its adapter says
the transfer carries the producer's tail (NIXL-like).

:class:`ReadLoadDouble` is MoRIIO-READ-like: its loads are synchronous, land in
``start_load_kv`` (vLLM 0.33 and later) or layer by layer in
``wait_for_layer_load`` (0.32, as MoRIIO's do), are never reported finished,
and a failed READ reports every destination block as a load error. Its adapter
is a sync reader whose READ destinations are the metadata's loads.

Nothing here imports the wrapper's internals beyond ``kvtail_connector.connectors``
(its public adapter registry), and :func:`allocate` repeats
``worker_caches.allocate`` without that module's imports of the worker's parts:
the differential run imports this file against two versions of the package,
whose internal modules may differ.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from packaging.version import Version
from vllm import __version__ as vllm_version
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtail_connector.connectors import InnerAdapter, register_adapter
from tests.helpers.async_double import AsyncLoadDouble, AsyncLoadDoubleMetadata, LoadSpec

MODULE_PATH = "tests.helpers.landing_doubles"
# req id -> layer name -> the producer's pages, in load order: what a load of
# that request copies (filed by the driver when the producer finished it).
SOURCES: dict[str, dict[str, list[torch.Tensor]]] = {}
READS_LAND_AT_START = Version(vllm_version).release >= (0, 33)


@dataclass
class LayerDouble:
    """A layer object as ``static_forward_context`` holds it (worker_caches.LayerDouble)."""

    attn_backend: type = FlashAttentionBackend
    kv_cache_dtype: str = "auto"


@dataclass
class Caches:
    views: dict[str, torch.Tensor]  # layer name -> [B, H, N, C]
    raw: list[torch.Tensor]  # int8 backing, one per attention group
    layers: dict[str, LayerDouble]


def allocate(kv_cache_config: KVCacheConfig) -> Caches:
    """Every attention layer's view as vLLM makes it (LBHNC), NaN-poisoned."""
    views: dict[str, torch.Tensor] = {}
    raws = []
    num_blocks = kv_cache_config.num_blocks
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            continue
        layers = list(group.layer_names)
        layout = KVCacheLayout.LBHNC
        layer_stride, block_stride, *_ = compute_layout_strides(
            spec, num_blocks, len(layers), layout
        )
        tensor = KVCacheTensor(
            size=0, layers=layers, layer_stride=layer_stride, block_stride=block_stride
        )
        raw = torch.zeros(len(layers) * num_blocks * spec.page_size_bytes, dtype=torch.int8)
        made = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
        for name, view in zip(layers, made, strict=True):
            view.fill_(float("nan") if view.dtype.is_floating_point else 0x7F)
            views[name] = view
        raws.append(raw)
    return Caches(views, raws, {name: LayerDouble() for name in views})


def noise_page(shape: torch.Size, dtype: torch.dtype, key: str) -> torch.Tensor:
    """A page of deterministic noise for ``key``, NaN in its last slot (floats)."""
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    if not dtype.is_floating_point:
        return torch.randint(0, 256, shape, generator=gen).to(dtype)
    page = torch.randn(shape, generator=gen).to(dtype)
    page[..., -1, 0] = float("nan")
    return page


class LandingLoadDouble(AsyncLoadDouble):
    """The async double whose completed loads write the KV cache."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.views: dict[str, torch.Tensor] = {}
        self._started: dict[str, LoadSpec] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.views = kv_caches

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, AsyncLoadDoubleMetadata)
        self._started.update(meta.loads)
        super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        for req_id in sorted(results.finished_recving):
            spec = self._started.pop(req_id)
            self.land(spec, failed=req_id in results.failed_recving)
        return results

    def land(self, spec: LoadSpec, failed: bool = False, only: str | None = None) -> None:
        """Write the whole blocks ``spec`` loads (half of them if ``failed``),
        in every attention layer or ``only`` that one."""
        source = SOURCES.get(spec.req_id, {})
        groups = self._kv_cache_config.kv_cache_groups
        for group, block_ids in zip(groups, spec.block_ids, strict=True):
            block = group.kv_cache_spec.block_size
            count = min(len(block_ids), -(-spec.num_tokens // block))
            count = count // 2 if failed else count
            for layer in group.layer_names:
                view = self.views.get(layer)
                if view is None or (only is not None and layer != only):
                    continue
                pages = source.get(layer, [])
                for i, block_id in enumerate(block_ids[:count]):
                    if i < len(pages):
                        view[block_id] = pages[i]
                    else:
                        key = f"{spec.req_id}/{layer}/{i}"
                        view[block_id] = noise_page(view.shape[1:], view.dtype, key)


class ReadLoadDouble(LandingLoadDouble):
    """MoRIIO-READ-like: synchronous loads that land before the forward reads them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reads: dict[str, LoadSpec] = {}
        self._read_errors: set[int] = set()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        # As MoRIIO's READ: never the prompt's last token (a sync load leaves
        # vLLM a token to compute; only async loads get its full-hit rewind).
        count, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return max(0, min(count, request.num_prompt_tokens - 1 - num_computed_tokens)), False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, AsyncLoadDoubleMetadata)
        self._reads = dict(meta.loads)
        for spec in self._reads.values():
            first = spec.block_ids[0] if spec.block_ids else []
            bad = range(len(first)) if spec.fail else spec.invalid_block_indices
            self._read_errors |= {first[i] for i in bad if i < len(first)}
            if READS_LAND_AT_START:
                self.land(spec)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not READS_LAND_AT_START:
            for spec in self._reads.values():
                self.land(spec, only=layer_name)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self.finished_req_ids_seen |= finished_req_ids
        return KVConnectorTransferResults()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._read_errors = self._read_errors, set()
        return errors


class LandingAdapter(InnerAdapter):
    """A peer transport that copies whole blocks (NIXL-like)."""

    def carries_producer_tail(self, vllm_config: Any) -> bool:
        return True


class ReadAdapter(LandingAdapter):
    """Synchronous READs into blocks vLLM zeroes (MoRIIO-READ-like)."""

    @property
    def sync_read(self) -> bool:
        return True

    def read_destinations(self, inner_metadata: Any) -> Any:
        for req_id, spec in sorted(getattr(inner_metadata, "loads", {}).items()):
            yield req_id, spec.block_ids


def register() -> None:
    """Register both doubles and their adapters; safe to call again."""
    for cls, adapter in ((LandingLoadDouble, LandingAdapter), (ReadLoadDouble, ReadAdapter)):
        with contextlib.suppress(ValueError):
            KVConnectorFactory.register_connector(cls.__name__, MODULE_PATH, cls.__name__)
        register_adapter(cls.__name__, adapter)


register()
