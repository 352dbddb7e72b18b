"""Per-layer KV views for a worker connector, made with vLLM's own view helpers.

Each attention group gets its own backing buffer (vLLM overlays groups in one
buffer; the tests here check one group's bytes at a time), poisoned with a
sentinel so untouched bytes are recognisable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtail_connector.core.kvgroups import group_infos
from kvtail_connector.core.parts.zeroing import RankPlacement
from kvtail_connector.core.policy import TailPolicy
from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.core.worker import TailWorker
from kvtail_connector.facade.assembly import build_worker

POISON = float("nan")


@dataclass
class LayerDouble:
    """A layer object as ``static_forward_context`` holds it, as far as the
    page maps read it: its attention backend and cache dtype."""

    attn_backend: type = FlashAttentionBackend
    kv_cache_dtype: str = "auto"


@dataclass
class WorkerCaches:
    views: dict[str, torch.Tensor]  # layer name -> [B, H, N, C]
    raw: dict[int, torch.Tensor]  # group id -> int8 backing
    layers: dict[str, Any]  # layer name -> its layer object (a LayerDouble)

    def publish(self, vllm_config: Any) -> dict[str, torch.Tensor]:
        """Put the layer objects where vLLM keeps them for the facade
        (``static_forward_context``); returns the views to register."""
        vllm_config.compilation_config.static_forward_context.update(self.layers)
        return self.views


def allocate(
    kv_cache_config: KVCacheConfig,
    layout: KVCacheLayout = KVCacheLayout.LBHNC,
    kernel_block_sizes: dict[int, int] | None = None,
    backend: type = FlashAttentionBackend,
) -> WorkerCaches:
    """Every attention layer's view, as vLLM allocates them, and a layer object
    per layer whose pages ``backend`` writes (FLASH_ATTN: plain pages)."""
    views: dict[str, torch.Tensor] = {}
    raws: dict[int, torch.Tensor] = {}
    num_blocks = kv_cache_config.num_blocks
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            continue
        layers = list(group.layer_names)
        layer_stride, block_stride, *_ = compute_layout_strides(
            spec, num_blocks, len(layers), layout
        )
        tensor = KVCacheTensor(
            size=0, layers=layers, layer_stride=layer_stride, block_stride=block_stride
        )
        raw = torch.zeros(len(layers) * num_blocks * spec.page_size_bytes, dtype=torch.int8)
        kbs = (kernel_block_sizes or {}).get(gid)
        for name, view in zip(
            layers,
            create_kv_cache_views(raw, spec, num_blocks, layout, tensor, kernel_block_size=kbs),
            strict=True,
        ):
            if view.dtype.is_floating_point:
                view.fill_(POISON)
            else:
                view.fill_(0x7F)
            views[name] = view
        raws[gid] = raw
    return WorkerCaches(views, raws, {name: LayerDouble(backend) for name in views})


def tail_policy(**duties: bool) -> TailPolicy:
    """A worker's policy: tail and READ-tail zeroing on, everything else off,
    unless ``duties`` (TailPolicy fields) say otherwise."""
    fields = {name: False for name in TailPolicy.__dataclass_fields__}
    fields.update(zeroes_tails=True, zeroes_read_tails=True)
    fields.update(duties)
    return TailPolicy(**fields)


def make_tail_worker(kv_cache_config: KVCacheConfig, **kw: Any) -> TailWorker:
    """A rank-0, no-DCP ``TailWorker``: :func:`tail_policy` with the TailPolicy
    fields in ``kw``; the other ``kw`` go to the worker."""
    duties = {k: kw.pop(k) for k in list(kw) if k in TailPolicy.__dataclass_fields__}
    kw.setdefault("stats", KVTailStats())
    return build_worker(
        group_infos(kv_cache_config, 1), RankPlacement(), tail_policy(**duties), **kw
    )


class ErrorSource:
    """The inner connector's ``get_block_ids_with_load_errors``, for worker tests:
    hands out the ids of each ``report`` once, like a transport."""

    def __init__(self) -> None:
        self._queued: set[int] = set()

    def report(self, *block_ids: int) -> None:
        self._queued |= set(block_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._queued = self._queued, set()
        return out
