"""What the model-specific page tests share: importing a model's modules on
this CPU machine, the spec a layer publishes, allocating its pages the way
vLLM does, and checking the wrapper's tail zeroing against pages written with
only the valid tokens.

The check (:func:`assert_tails_exact`): the pages of two layers are written
whole (every token of every block) over stale bytes; the expected backing is
that one with each tail block zeroed and re-written with only its valid
tokens; the wrapper's path (``cache_sets`` over layer objects naming the
backend, then ``KVZeroer``) must give that backing byte for byte, on every
zeroing path.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtail_connector import _compat
from kvtail_connector.core.cache_sets import cache_sets
from kvtail_connector.core.kvgroups import group_infos
from kvtail_connector.core.tails import first_stale_slot
from kvtail_connector.ops import KVZeroer
from kvtail_connector.pages import UnmappedPage, layer_cache
from tests.helpers.backend_walk import cpu_import_shims, real_triton_everywhere
from tests.helpers.stub_imports import import_with_stubs
from tests.helpers.vllm_triton import import_writer
from tests.ops.test_zero_kv_blocks import PATH_IDS, PATHS

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
VERSION = _compat.check_vllm_version()

# The zeroing paths every layout is checked on: (implementation, device).
ZERO_PATHS = pytest.mark.parametrize(("path", "device"), PATHS, ids=PATH_IDS)


def needs(version: tuple[int, int], why: str) -> pytest.MarkDecorator:
    """Skip on vLLM releases before ``version`` (the layout is not in them)."""
    return pytest.mark.skipif(version > VERSION, reason=f"vLLM {VERSION[0]}.{VERSION[1]}: {why}")


def before(version: tuple[int, int], why: str) -> pytest.MarkDecorator:
    """Skip on vLLM ``version`` and later (the class is gone there)."""
    return pytest.mark.skipif(version <= VERSION, reason=f"vLLM {VERSION[0]}.{VERSION[1]}: {why}")


def valid_counts(block_tokens: int) -> tuple[int, ...]:
    """The valid-token counts every layout is checked with, one tail block
    each: a single token, mid group, a group edge, all but one, none (the
    whole block); those a block of ``block_tokens`` can have."""
    counts = (1, 5, 8, block_tokens - 1, 0)
    return tuple(c for i, c in enumerate(counts) if c < block_tokens and c not in counts[:i])


def tail_items(block_tokens: int) -> list[tuple[int, int]]:
    """``(block, valid tokens)`` pairs: block 0 stays whole, as a guard."""
    return [(b + 1, v) for b, v in enumerate(valid_counts(block_tokens))]


def num_blocks(block_tokens: int) -> int:
    return len(valid_counts(block_tokens)) + 1


@dataclass
class ModelLayer:
    """A model's layer object as ``static_forward_context`` holds it, as far
    as the page maps read it.

    Attributes:
        attn_backend: the class ``get_attn_backend()`` returns.
        kv_cache_dtype: the layer's ``kv_cache_dtype`` string.
        block_size: the layer's own ``block_size`` attribute, where the model
            has one the writer reads (Inkling's conv state).
    """

    attn_backend: type
    kv_cache_dtype: str = "auto"
    block_size: int | None = None


def stand_in(path: str) -> type:
    """A class named ``path`` (``module.QualName``): the page maps key on the
    path, so this drives them where the real module cannot be imported here."""
    module, _, name = path.rpartition(".")
    return type(name, (), {"__module__": module, "__qualname__": name})


def class_at(path: str, *, writer: bool = False) -> type:
    """The class at ``path``, imported like :func:`import_model`."""
    module, _, name = path.rpartition(".")
    return getattr(import_model(module, writer=writer), name)


def _model_packages(module: str) -> list[str]:
    """``vllm.models.<model>`` and its platform package: their ``__init__``
    import the whole model (torchvision, CuTe-DSL, other platforms' ops)."""
    parts = module.split(".")
    if parts[:2] != ["vllm", "models"] or len(parts) < 4:
        return []
    return [".".join(parts[:3]), ".".join(parts[:4])][: len(parts) - 3]


@contextlib.contextmanager
def _bare_packages(names: Sequence[str]) -> Iterator[None]:
    """Make ``names`` importable packages without running their
    ``__init__``, for the duration; the submodules imported meanwhile stay."""
    added = []
    for name in names:
        if name in sys.modules:
            continue
        parent = importlib.import_module(name.rpartition(".")[0])
        path = os.path.join(next(iter(parent.__path__)), name.rpartition(".")[2])
        if not os.path.isdir(path):
            continue  # a module, not a package
        module = types.ModuleType(name)
        module.__path__ = [path]
        sys.modules[name] = module
        added.append(name)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def import_model(module: str, *, writer: bool = False) -> types.ModuleType:
    """Import a vLLM module on this machine: model packages skip their
    ``__init__``, missing GPU libraries are stubs (``cpu_import_shims``), and
    modules imported from now on see the real Triton (the scheduler suite
    tells 0.34's CPU platform Triton is there, so a placeholder would be
    used as Triton; kernels run under the interpreter). With ``writer`` the
    module is imported again if it was imported around the placeholder."""
    real_triton_everywhere()
    with _bare_packages(_model_packages(module)), cpu_import_shims():
        if writer:
            return import_writer(module, stubs=True)
        return import_with_stubs(module)


def published(backend: type, spec: Any) -> Any:
    """The spec vLLM keeps for a layer of ``backend`` whose model built
    ``spec``: ``customize_attention_spec`` (v1/worker/utils.py), which every
    runner's ``get_kv_cache_spec`` applies (gpu/attn_utils.py)."""
    from vllm.v1.worker.utils import customize_attention_spec

    return customize_attention_spec(backend, spec)


@dataclass
class Pages:
    """Two layers' views of one backing buffer, as vLLM allocates them."""

    raw: torch.Tensor  # int8, both layers
    views: dict[str, torch.Tensor]  # layer name -> [B, H, N, C]
    config: KVCacheConfig
    spec: Any


def allocate(
    spec: Any, layout: KVCacheLayout, blocks: int, seed: int = 0, stale: bool = True
) -> Pages:
    """The layers' views (``compute_layout_strides`` + ``create_kv_cache_views``)
    over a backing of random (stale) bytes, or of zeros."""
    layer_stride, block_stride, *_ = compute_layout_strides(spec, blocks, len(LAYERS), layout)
    tensor = KVCacheTensor(
        size=0, layers=list(LAYERS), layer_stride=layer_stride, block_stride=block_stride
    )
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (len(LAYERS) * blocks * spec.page_size_bytes,), generator=gen)
    raw = raw.to(torch.int8) if stale else torch.zeros_like(raw, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, blocks, layout, tensor)
    config = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )
    return Pages(raw, dict(zip(LAYERS, views, strict=True)), config, spec)


def rebase(views: Mapping[str, torch.Tensor], raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same views over another backing of the same size (a clone)."""
    return {
        name: torch.as_strided(raw.view(v.dtype), v.shape, v.stride(), v.storage_offset())
        for name, v in views.items()
    }


# write(layer, view, slots): stores tokens at flat slots block * B + t of
# ``view`` as the layout's writer does, with the token data of ``layer``.
Writer = Callable[[str, torch.Tensor, Sequence[int]], None]
# keep(expected_view, written_view, block, valid): copies back the bytes of the
# valid tokens no writer touches (row padding), which zeroing leaves as they are.
Keep = Callable[[torch.Tensor, torch.Tensor, int, int], None]


@dataclass
class Expectation:
    written: torch.Tensor  # the backing with every token written
    expected: torch.Tensor  # ... with the tails zeroed, as rewriting shows
    items: list[tuple[int, int]]  # (block, valid tokens)


def expect(pages: Pages, write: Writer, block_tokens: int, keep: Keep | None = None) -> Expectation:
    """Write every token of every block, then build the expected backing:
    each tail block zeroed and re-written with only its valid tokens.

    Args:
        block_tokens: tokens of one block (its slots address
            ``block * block_tokens + t``).
        keep: for layouts with bytes no writer touches (row padding).
    """
    blocks = pages.config.num_blocks
    for name, view in pages.views.items():
        write(name, view, range(blocks * block_tokens))
    written = pages.raw.clone()
    expected = pages.raw.clone()
    items = tail_items(block_tokens)
    before_views = rebase(pages.views, written)
    for name, view in rebase(pages.views, expected).items():
        for block, _ in items:
            view[block].zero_()
        write(name, view, [b * block_tokens + t for b, v in items for t in range(v)])
        if keep is not None:
            for block, valid in items:
                keep(view, before_views[name], block, valid)
    assert not torch.equal(written, expected), "the tails change nothing: a test that cannot fail"
    return Expectation(written, expected, items)


def zero_tails(
    views: Mapping[str, torch.Tensor],
    config: KVCacheConfig,
    layer: Any,
    items: Sequence[tuple[int, int]],
    path: str,
) -> list[Any]:
    """The wrapper's path: cache sets of the layers (``layer`` names their
    backend), the first stale slot of each tail (``tails.first_stale_slot``,
    which floors states of several tokens), one ``KVZeroer`` launch."""
    sets = cache_sets(views, config, group_infos(config, 1), dict.fromkeys(views, layer))
    assert len(sets) == 1, sets
    one = sets[0]
    rows = [
        (
            0,
            block,
            first_stale_slot(
                v,
                dcp_rank=0,
                dcp_world_size=1,
                interleave=1,
                tokens_per_state=one.tokens_per_state,
            ),
        )
        for block, v in items
    ]
    KVZeroer([(one.caches, one.pages_per_block)], implementation=path).zero(
        np.array(rows, dtype=np.int64)
    )
    return one.caches


def assert_tails_exact(pages: Pages, case: Expectation, layer: Any, path: str) -> list[Any]:
    """Zero the tails of a copy of the written backing through the wrapper
    and compare every byte with the expected backing; returns the caches the
    wrapper built."""
    raw = case.written.clone()
    caches = zero_tails(rebase(pages.views, raw), pages.config, layer, case.items, path)
    bad = (raw != case.expected).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} bytes differ, first at {bad[:8].tolist()}"
    return caches


def assert_refused(spec: Any, layer: ModelLayer, layout: KVCacheLayout, *words: str) -> str:
    """The layer is refused at start-up, naming the layer, its backend (name
    and class path) and ``words``; returns the message."""
    view = allocate(spec, layout, 2).views[LAYERS[0]]
    with pytest.raises(UnmappedPage) as err:
        layer_cache(LAYERS[0], view, spec, layer)
    text = str(err.value)
    backend = layer.attn_backend
    for part in (
        repr(LAYERS[0]),
        backend.get_name(),
        f"{backend.__module__}.{backend.__qualname__}",
        *words,
    ):
        assert part in text, f"{part!r} not in {text!r}"
    return text


def random_tokens(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Token data no byte of which is zero (so a zeroed byte always shows):
    bytes in [1, 255], or bf16 values in [1, 2) (exponent 127: both bytes
    nonzero, and nonzero once a writer converts them to fp8)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bfloat16:
        return (torch.rand(tuple(shape), generator=gen) + 1.0).clamp(max=1.99).to(dtype)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(1, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def fp8_view(view: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """An fp8 cache's uint8 pages as the backends view them to store."""
    if view.dtype != torch.uint8:
        return view
    return view.view(torch.float8_e5m2 if "e5m2" in kv_cache_dtype else torch.float8_e4m3fn)


def plain_kv_writer(head_size: int, heads: int, kv_cache_dtype: str, tokens: int) -> Writer:
    """FLASH_ATTN's store (flash_attn.py ``do_kv_cache_update``:
    ``reshape_and_cache_flash`` into ``kv_cache.transpose(1, 2).split(
    head_size, -1)``) by its index math: token ``slot`` at ``[slot // N,
    slot % N, h, :]`` of the K and V halves (``reshape_and_cache_kernel_flash``
    in v1/attention/ops/triton_reshape_and_cache_flash.py: ``block_idx *
    block_stride + block_offset * page_stride + cur_head * head_stride +
    cur_dim``). :func:`vllm_plain_kv_store` is vLLM's kernel itself, which
    ``test_model_writers`` checks this against. Each layer has its own data."""
    data = {
        name: tuple(
            random_tokens((tokens, heads, head_size), torch.bfloat16, seed=10 * i + side)
            for side in (0, 1)
        )
        for i, name in enumerate(LAYERS)
    }

    def write(layer: str, view: torch.Tensor, slots: Sequence[int]) -> None:
        keys, values = data[layer]
        index = torch.tensor(list(slots), dtype=torch.int64)
        key_cache, value_cache = (
            fp8_view(view, kv_cache_dtype).transpose(1, 2).split(head_size, dim=-1)
        )
        n = key_cache.shape[1]
        key_cache[index // n, index % n] = keys[index].to(key_cache.dtype)
        value_cache[index // n, index % n] = values[index].to(value_cache.dtype)

    return write


@contextlib.contextmanager
def _cuda_facts() -> Iterator[None]:
    """What ``triton_reshape_and_cache_flash`` asks the device before it
    launches (SM89+ for an fp8 store, SM9x tiling): answered as a Hopper GPU.
    The kernel itself runs under the interpreter."""
    from vllm.platforms import current_platform

    saved = (torch.cuda.get_device_capability, current_platform.has_device_capability)
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # type: ignore[assignment]
    current_platform.has_device_capability = lambda *a, **k: True  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.cuda.get_device_capability = saved[0]  # type: ignore[assignment]
        current_platform.has_device_capability = saved[1]  # type: ignore[method-assign]


def vllm_plain_kv_store(
    view: torch.Tensor,
    slots: Sequence[int],
    keys: torch.Tensor,
    values: torch.Tensor,
    kv_cache_dtype: str,
) -> None:
    """Store ``keys[i]``/``values[i]`` (``[T, heads, head_size]``) at
    ``slots[i]`` through vLLM's ``triton_reshape_and_cache_flash`` into
    ``view.transpose(1, 2).split(head_size, -1)``, under the interpreter."""
    ops = import_model("vllm.v1.attention.ops.triton_reshape_and_cache_flash", writer=True)
    scale = torch.ones((), dtype=torch.float32)
    key_cache, value_cache = (
        fp8_view(view, kv_cache_dtype).transpose(1, 2).split(keys.shape[-1], dim=-1)
    )
    index = torch.tensor(list(slots), dtype=torch.int64)
    with _cuda_facts():
        ops.triton_reshape_and_cache_flash(
            keys, values, key_cache, value_cache, index, kv_cache_dtype, scale, scale
        )
