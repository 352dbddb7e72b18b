"""Which bytes of a layer's KV page each token slot owns.

One module per family of layouts, each a :class:`~kvtail_connector.pages.maps.PageMap`
established from vLLM's own view helpers or writers; :func:`layer_cache` picks
a layer's map or refuses the layer at start-up (``maps.page_cache``).
"""

from __future__ import annotations

from typing import Any

import torch

from kvtail_connector.pages import (
    cpu,
    deepseek,
    dots3_note,
    flashinfer_nvfp4,
    inkling,
    kimi_k3,
    minimax_m3,
    minimax_m3_nvfp4,
    plain,
    quantized,
    qwen4_exp,
    rocm,
    step5,
)
from kvtail_connector.pages.layer import PLAIN_ENGINE, EngineFacts, LayerPage
from kvtail_connector.pages.maps import PageCache, PageMap, UnmappedPage, page_cache

# Every established layout, in no particular order: at most one covers a layer.
MAPS: tuple[PageMap, ...] = (
    *plain.MAPS,
    *cpu.MAPS,
    *rocm.MAPS,
    *minimax_m3.MAPS,
    *minimax_m3_nvfp4.MAPS,
    *step5.MAPS,
    *qwen4_exp.MAPS,
    *inkling.MAPS,
    *kimi_k3.MAPS,
    *dots3_note.MAPS,
    *deepseek.MAPS,
    *flashinfer_nvfp4.MAPS,
    *quantized.MAPS,
)


def layer_cache(
    name: str,
    view: torch.Tensor,
    spec: Any,
    layer: Any = None,
    engine: EngineFacts = PLAIN_ENGINE,
) -> PageCache:
    """The cache through which layer ``name``'s tails are zeroed, probed and
    digested: ``view`` itself, or a ``RegionCache`` over it.

    Raises:
        UnmappedPage: the layer's layout is not one the wrapper has mapped.
    """
    return page_cache(LayerPage(name, view, spec, layer, engine), MAPS)


__all__ = [
    "MAPS",
    "EngineFacts",
    "LayerPage",
    "PageCache",
    "PageMap",
    "UnmappedPage",
    "layer_cache",
]
