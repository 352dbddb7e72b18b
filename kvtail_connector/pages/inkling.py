"""Inkling's short-convolution state (``INKLING_SCONV_SWA``): plain cells with
unwritten padding.

``InklingConvState`` publishes a ``SlidingWindowSpec`` whose block is the
conv kernel (``block_size = kernel_size``) and whose cell packs, per KV head,
the K, V, attention-output and MLP-output streams at ``stream_ranges``,
padded to a power of two (``sconv_swa_attn.py``, ``get_kv_cache_spec``).
``fused_sconv`` (``ops/sconv.py``, ``_fused_sconv_kernel``) stores token
``slot`` of each stream at ``cache[slot // N, h, slot % N, off_s + d]`` for
every head ``h`` (and reads the window back the same way), so token ``n`` owns
``view[b, :, n, :]``; the padding columns are written by no one and read by no
one, and zeroing them with the tail changes nothing any kernel sees.

``N`` is what the model's ``InklingShortConv.forward`` passes: the NVIDIA
model passes ``owner.block_size`` (the conv kernel size), the ROCm model
``owner.cache_block_size`` (the bound view's ``N``), in 0.32-0.34. vLLM's page
unifier (``unify_kv_cache_spec_page_size``) may enlarge the spec's block (the
ROCm model's comment: "W=4 becomes 32 when --block-size=128"), and the slot
mapping follows the enlarged block; the NVIDIA writer then addresses
``slot // kernel_size``, rows of other blocks. So on NVIDIA the view's ``N``
must be the layer's ``block_size``, read from the layer object (the spec's
``block_size`` is the enlarged one and always equals the view's ``N``).
"""

from __future__ import annotations

from kvtail_connector.pages.layer import LayerPage
from kvtail_connector.pages.maps import PageCache, PageMap
from kvtail_connector.pages.plain import unpacked
from kvtail_connector.pages.views import check_view

NVIDIA_BACKEND = "vllm.models.inkling.nvidia.sconv_swa_attn.InklingSconvBackend"  # 0.32-0.34
AMD_BACKEND = "vllm.models.inkling.amd.sconv_swa_attn.InklingSconvBackend"  # 0.32-0.34


def _covers(page: LayerPage) -> bool:
    """All four streams in one cell per head (``head_size_v == 0``), bf16."""
    return (
        unpacked(page) and page.field("head_size_v") == 0 and page.field("tokens_per_state", 1) == 1
    )


def _kernel_block_view(page: LayerPage) -> PageCache:
    """NVIDIA: the writer's ``N`` is the layer's ``block_size`` (the kernel)."""
    check_view(page)
    view = page.view
    writer_n = getattr(page.layer, "block_size", None)
    if not isinstance(writer_n, int) or view.shape[2] != writer_n:
        raise ValueError(
            f"the view's pages hold {view.shape[2]} tokens, but the NVIDIA conv writer "
            f"addresses slot // owner.block_size ({writer_n}): an enlarged conv block "
            "(the page unifier's) would place tokens in other blocks' rows"
        )
    return view


def _bound_block_view(page: LayerPage) -> PageCache:
    """ROCm: the writer's ``N`` is the bound view's own ``N``."""
    check_view(page)
    return page.view


SCONV_NVIDIA = PageMap(
    layout="Inkling sconv window (plain cells, padded)",
    backends=frozenset({NVIDIA_BACKEND}),
    covers=_covers,
    cache=_kernel_block_view,
)

SCONV_AMD = PageMap(
    layout="Inkling sconv window, ROCm (plain cells, padded)",
    backends=frozenset({AMD_BACKEND}),
    covers=_covers,
    cache=_bound_block_view,
)

MAPS = (SCONV_NVIDIA, SCONV_AMD)
