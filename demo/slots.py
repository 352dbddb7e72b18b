"""Worker-side KV slot access: poison and inspect token slots of a CPU engine's cache.

The ``rpc_*`` functions run on the vLLM worker through ``LLM.collective_rpc``
(``self`` = the worker). They only touch attention layers: Mamba state is not
paged per token.

Which bytes of a page belong to which token slot is NOT what the cache's
``[B, H, N, 2*D]`` shape suggests on the CPU backend: it views each head's page
as ``[2N, D]`` and splits it into K and V halves (cpu_attn.py), and its kernels
then pack them per ISA - "vec"/"vec16" write K column-major (``[D, N]``) and V
row-major (``[N, D]``) (csrc/cpu/cpu_attn_vec.hpp). Rather than re-encode each
packing, this module asks the backend's own cache writer
(``cpu_attn_reshape_and_cache``) to write each slot of a scratch page once and
records which elements changed: an "owner" map, element -> slot. The package
learns its zeroing regions the same way (``kvtail_connector.pages.cpu``); this
copy is kept independent on purpose, as the tests' oracle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

_OWNER_MAPS: dict[tuple[Any, ...], Any] = {}


@dataclass
class AttnLayer:
    name: str
    pages: Any  # [kernel blocks, page elements] view of the layer's cache
    owner: Any  # [page elements] int64: the slot each element belongs to
    block_size: int  # manager (scheduler) block size
    kernel_block_size: int  # slots per page
    isa: str  # the CPU attention kernel family ("vec", "vec16", "amx", ...)


class NoSlotMapError(ValueError):
    """The demo cannot map this cache's bytes to token slots (not CPU_ATTN,
    or a quantized cache): poisoning and inspection are unavailable for it."""


def slot_owner(kv: Any, isa: str, kv_cache_dtype: str) -> Any:
    """Element -> slot map of one CPU_ATTN page, from the backend's own writer."""
    import torch
    from vllm import _custom_ops as ops

    _, h, n, c = kv.shape
    key = (kv.dtype, h, n, c, isa, kv_cache_dtype)
    if key in _OWNER_MAPS:
        return _OWNER_MAPS[key]
    if kv_cache_dtype not in ("auto", None) or kv.dtype not in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ):
        raise NoSlotMapError(f"slot map for KV cache dtype {kv_cache_dtype}/{kv.dtype}")
    scratch = torch.zeros((1, h, n, c), dtype=kv.dtype)
    k_cache, v_cache = scratch.view(1, h, 2 * n, c // 2).chunk(2, dim=2)
    ones = torch.ones((1, h, c // 2), dtype=kv.dtype)
    flat = scratch.view(-1)
    owner = torch.full((flat.numel(),), -1, dtype=torch.int64)
    for s in range(n):
        ops.cpu_attn_reshape_and_cache(
            ones, ones, k_cache, v_cache, torch.tensor([s], dtype=torch.int64), isa
        )
        new = (flat != 0) & (owner < 0)
        owner[new] = s
    per_slot = torch.bincount(owner.clamp(min=0), minlength=n)
    if (owner < 0).any() or not bool((per_slot == c * h).all()):
        raise RuntimeError(f"CPU_ATTN slot map for isa {isa!r} is not a partition of the page")
    _OWNER_MAPS[key] = owner
    return owner


def attn_layers(worker: Any) -> list[AttnLayer]:
    """The attention layers of the worker's KV cache, with their slot maps."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    runner = worker.model_runner
    ctx = runner.compilation_config.static_forward_context
    kv_cache_dtype = str(runner.cache_config.cache_dtype)
    out: list[AttnLayer] = []
    seen: set[int] = set()
    for group in runner.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            continue
        for name in group.layer_names:
            layer = ctx.get(name)
            kv = getattr(layer, "kv_cache", None)
            if isinstance(kv, (list, tuple)):
                kv = kv[0] if kv else None
            if kv is None or not hasattr(kv, "shape") or kv.data_ptr() in seen:
                continue  # no cache, or a cache shared with an earlier layer
            seen.add(kv.data_ptr())
            backend = getattr(layer, "attn_backend", None)
            backend_name = backend.get_name() if backend is not None else ""
            if backend_name != "CPU_ATTN" or kv.dim() != 4 or not kv[0].is_contiguous():
                raise NoSlotMapError(
                    f"{name}: backend {backend_name!r}, cache shape {tuple(kv.shape)}"
                )
            owner = slot_owner(kv, str(layer.isa), kv_cache_dtype)
            # One row per kernel block; rows may be further apart than a page
            # (hybrid models pad attention pages to the Mamba page size).
            pages = kv.as_strided((kv.shape[0], owner.numel()), (kv.stride(0), 1))
            out.append(AttnLayer(name, pages, owner, spec.block_size, kv.shape[2], str(layer.isa)))
    return out


def _slot_ranges(
    block_ids: Sequence[int], start: int, stop: int, bs: int, kbs: int
) -> Iterator[tuple[int, int, int]]:
    """(kernel block, lo, hi) covering slots [start, stop) of each manager block."""
    ratio = bs // kbs
    for b in block_ids:
        for k in range(ratio):
            lo, hi = max(start, k * kbs), min(stop, (k + 1) * kbs)
            if lo < hi:
                yield b * ratio + k, lo - k * kbs, hi - k * kbs


def rpc_fill_slots(
    worker: Any,
    block_ids: Sequence[int],
    start: int,
    stop: int | None,
    value: float,
) -> int:
    """Set slots [start, stop) of the given blocks to ``value`` in every attention layer
    (K and V, all heads). Returns the number of (layer, block, slot) triples written."""
    n = 0
    for layer in attn_layers(worker):
        hi = layer.block_size if stop is None else min(stop, layer.block_size)
        for kb, lo, up in _slot_ranges(
            block_ids, start, hi, layer.block_size, layer.kernel_block_size
        ):
            elements = ((layer.owner >= lo) & (layer.owner < up)).nonzero().flatten()
            layer.pages[kb].index_fill_(0, elements, value)
            n += up - lo
    return n


def rpc_fill_all(worker: Any, value: float) -> int:
    """Set every slot of every block of every attention layer (engine must be idle)."""
    layers = attn_layers(worker)
    for layer in layers:
        layer.pages.fill_(value)
    return len(layers)


def rpc_scrub_nan(worker: Any) -> int:
    """Replace NaN with 0 everywhere, so poison cannot leak into later requests.
    Returns the number of NaN elements replaced."""
    import torch

    n = 0
    for layer in attn_layers(worker):
        for off in range(0, layer.pages.shape[0], 256):
            chunk = layer.pages[off : off + 256]
            mask = torch.isnan(chunk)
            n += int(mask.sum())
            chunk.masked_fill_(mask, 0.0)
    return n


def rpc_slot_counts(
    worker: Any, block_ids: Sequence[int], kind: str = "nan"
) -> dict[str, dict[int, list[int]]]:
    """Per layer, per (manager) block: in each slot, the number of NaN elements
    (``kind="nan"``) or of non-zero elements (``kind="nonzero"``)."""
    import torch

    test = torch.isnan if kind == "nan" else torch.Tensor.bool
    out: dict[str, dict[int, list[int]]] = {}
    for layer in attn_layers(worker):
        kbs, ratio = layer.kernel_block_size, layer.block_size // layer.kernel_block_size
        per_block: dict[int, list[int]] = {}
        for b in block_ids:
            counts: list[int] = []
            for kb in range(b * ratio, (b + 1) * ratio):
                hits = test(layer.pages[kb]).long()
                counts += (
                    torch.zeros(kbs, dtype=torch.long).scatter_add_(0, layer.owner, hits).tolist()
                )
            per_block[int(b)] = counts
        out[layer.name] = per_block
    return out


def rpc_nan_census(worker: Any) -> dict[int, int]:
    """Block id -> number of NaN elements (all attention layers), for blocks that have any."""
    import torch

    total: dict[int, int] = {}
    for layer in attn_layers(worker):
        ratio = layer.block_size // layer.kernel_block_size
        for off in range(0, layer.pages.shape[0], 256):
            counts = torch.isnan(layer.pages[off : off + 256]).sum(1)
            for i in counts.nonzero().flatten().tolist():
                b = (off + i) // ratio
                total[b] = total.get(b, 0) + int(counts[i])
    return total


def rpc_layout(worker: Any) -> dict[str, dict[str, Any]]:
    return {
        layer.name: {
            "pages": list(layer.pages.shape),
            "dtype": str(layer.pages.dtype),
            "kernel_block_size": layer.kernel_block_size,
            "block_size": layer.block_size,
            "elements_per_slot": layer.owner.numel() // layer.kernel_block_size,
            "isa": layer.isa,
        }
        for layer in attn_layers(worker)
    }


def rpc_fill_state(worker: Any, block_ids: Sequence[int], state: int, value: float) -> int:
    """Set element 0 of state ``state`` (index in the layer's ``MambaSpec.shapes``:
    0 the conv state, 1 the SSM / recurrent state) of the given blocks to
    ``value`` in every state (Mamba / linear-attention) layer, through the views
    the layer itself binds. Returns the number of (layer, block) pairs written."""
    from vllm.v1.kv_cache_interface import MambaSpec

    runner = worker.model_runner
    ctx = runner.compilation_config.static_forward_context
    n = 0
    for group in runner.kv_cache_config.kv_cache_groups:
        if not isinstance(group.kv_cache_spec, MambaSpec):
            continue
        for name in group.layer_names:
            views = getattr(ctx.get(name), "kv_cache", None)
            if not isinstance(views, tuple) or len(views) <= state:
                continue
            for b in block_ids:
                views[state][b].view(-1)[0] = value
                n += 1
    return n


RPCS: dict[str, Callable[..., Any]] = {
    "fill_state": rpc_fill_state,
    "fill_slots": rpc_fill_slots,
    "fill_all": rpc_fill_all,
    "scrub_nan": rpc_scrub_nan,
    "slot_counts": rpc_slot_counts,
    "nan_census": rpc_nan_census,
    "layout": rpc_layout,
}
