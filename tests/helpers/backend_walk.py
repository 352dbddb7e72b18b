"""Every attention backend of the installed vLLM, and the pages it publishes.

For the page-map inventory test: the backends vLLM can select
(``AttentionBackendEnum``) and every other class of the vLLM tree that
reshapes pages (defines ``customize_spec``), each asked for the spec of every
``kv_cache_dtype`` it declares, with the view vLLM allocates from it. Classes
are found by reading the source (``ast``), imported with missing GPU
libraries stubbed (``stub_imports``); one that cannot be imported here is
reported, not skipped silently.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import vllm
from vllm.v1 import kv_cache_interface as kvi
from vllm.v1.kv_cache_layout import KVCacheLayout

from tests.helpers.stub_imports import import_with_stubs

_ROOT = Path(vllm.__file__).parent

# Names vLLM's ``fa_utils`` defines only on CUDA, XPU and ROCm (its module body
# branches on the platform); backends import them at the top. For reading
# class-level facts they are stubs, like a missing GPU library.
_PLATFORM_NAMES = {
    "vllm.v1.attention.backends.fa_utils": (
        "compile_flash_attn_varlen_func_from_specs",
        "flash_attn_varlen_func",
        "get_scheduler_metadata",
        "reshape_and_cache_flash",
    ),
}


# vLLM packages wrapping a GPU extension that raise ImportError on a machine
# without it (``vllm_flash_attn``: "requires the CUDA flash attention
# extensions"): stubs, like ``vllm._C`` in ``stub_imports``.
_GPU_PACKAGES = ("vllm.vllm_flash_attn",)


def _stub(*args: object, **kwargs: object) -> None:
    raise RuntimeError("a GPU-only vLLM function, stubbed on this CPU machine")


class _GpuPackage(types.ModuleType):
    """A GPU-extension package: every attribute is :func:`_stub`."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub


def _once_per_name(register: Callable[..., object]) -> Callable[..., object]:
    """``direct_register_custom_op`` that registers each op name once: vLLM's
    NVIDIA and ROCm trees of one model register the same ``vllm::`` op (a GPU
    machine imports one of them; reading both here would abort the second)."""

    def register_once(op_name: str, *args: object, **kwargs: object) -> object:
        import torch

        if hasattr(torch.ops.vllm, op_name):
            return None
        return register(op_name, *args, **kwargs)

    return register_once


@contextlib.contextmanager
def cpu_import_shims() -> Iterator[None]:
    """For importing backends on this CPU machine (never for running them):
    the GPU-only ``fa_utils`` names are stubs, and a ``vllm::`` op already
    registered by a model's other platform tree is not registered again.
    Modules imported meanwhile keep what they bound."""
    import importlib

    from vllm.utils import torch_utils

    added: list[tuple[object, str]] = []
    for module_name, names in _PLATFORM_NAMES.items():
        module = importlib.import_module(module_name)
        for name in names:
            if not hasattr(module, name):
                setattr(module, name, _stub)
                added.append((module, name))
    stubbed = []
    for name in _GPU_PACKAGES:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            package = _GpuPackage(name)
            package.__path__ = []
            sys.modules[name] = package
            stubbed.append(name)
    register = torch_utils.direct_register_custom_op
    torch_utils.direct_register_custom_op = _once_per_name(register)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch_utils.direct_register_custom_op = register  # type: ignore[assignment]
        for name in stubbed:
            sys.modules.pop(name, None)
        for module, name in added:
            delattr(module, name)


@dataclass(frozen=True)
class Published:
    """What one backend publishes for one ``kv_cache_dtype``.

    Attributes:
        backend: the backend class.
        kv_cache_dtype: the cache dtype asked for.
        spec: the spec after the backend's ``customize_spec``.
        view: one layer's view vLLM allocates from it.
    """

    backend: type
    kv_cache_dtype: str
    spec: Any
    view: torch.Tensor

    @property
    def key(self) -> tuple[str, str]:
        cls = self.backend
        return (f"{cls.__module__}.{cls.__qualname__}", self.kv_cache_dtype)


def _reshaping_classes() -> list[str]:
    """``module.Class`` of every module-level class in the vLLM tree defining
    ``customize_spec`` (a class a factory makes per layer, like
    ``composite.create_composite_attention_backend``'s, has no importable
    path: its layers name a ``<locals>`` class no map lists, and are refused)."""
    found = []
    for path in sorted(_ROOT.rglob("*.py")):
        source = path.read_text(errors="replace")
        if "def customize_spec" not in source:
            continue
        module = ".".join(("vllm", *path.relative_to(_ROOT).with_suffix("").parts))
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef) and any(
                isinstance(item, ast.FunctionDef) and item.name == "customize_spec"
                for item in node.body
            ):
                found.append(f"{module}.{node.name}")
    return found


def backend_paths() -> list[str]:
    """The selectable backends and every reshaping class, by class path."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    paths = {m.value for m in AttentionBackendEnum if m.value}
    paths |= set(_reshaping_classes())
    return sorted(paths)


def real_triton_everywhere() -> None:
    """Point ``vllm.triton_utils`` at the real Triton (kernels run under the
    interpreter), and every vLLM module already imported around its
    placeholder too: the scheduler suite tells 0.34's CPU platform Triton is
    there (``HAS_TRITON``), so a module bound to the placeholder, like
    ``jit_warmup_triton_helper``, would break every later import using it."""
    import triton
    import triton.language as tl
    from vllm.triton_utils import importing

    from tests.helpers.vllm_triton import _real_triton

    _real_triton()
    placeholders = {
        "triton": importing.TritonPlaceholder,
        "tl": importing.TritonLanguagePlaceholder,
    }
    for name, module in list(sys.modules.items()):
        if not name.startswith("vllm.") or module is None:
            continue
        for attr, real in (("triton", triton), ("tl", tl)):
            if isinstance(getattr(module, attr, None), placeholders[attr]):
                setattr(module, attr, real)


def load(path: str) -> type:
    """The class at ``path``, imported with missing GPU libraries stubbed.

    Raises:
        ImportError / AttributeError / AssertionError: it cannot be imported
            here (a CUDA-only module body, a module vLLM lists but lacks).
    """
    real_triton_everywhere()
    module, _, name = path.rpartition(".")
    with cpu_import_shims():
        try:
            imported = import_with_stubs(module)
        except ImportError as e:
            # A model's platform module importing its model, which imports
            # it back (qwen4_exp/<platform>/qsa.py): its model imports first.
            if "partially initialized" not in str(e):
                raise
            import_with_stubs(module.rpartition(".")[0] + ".model")
            imported = import_with_stubs(module)
        cls = getattr(imported, name)
    if not isinstance(cls, type):
        raise ImportError(f"{path} is not a class here ({type(cls).__name__})")
    return cls


_ALL_DTYPES = tuple(typing.get_args(__import__("vllm.config.cache", fromlist=["x"]).CacheDType))


def _kv_dtypes(backend: type) -> tuple[str, ...]:
    declared = getattr(backend, "supported_kv_cache_dtypes", None)
    return tuple(declared) if declared else _ALL_DTYPES


# Head sizes tried first: the common GQA head, the MLA latent (kv_lora_rank
# 512 + rope 64, every DeepSeek-style model's), then the rest.
_PREFERRED_HEADS = (128, 576)


def _head_size(backend: type, mla: bool) -> int:
    """A head size the backend takes (``supports_head_size``)."""
    try:
        sizes = [int(s) for s in backend.get_supported_head_sizes()]
    except Exception:
        sizes = []
    preferred = (576, 128) if mla else _PREFERRED_HEADS
    for size in (*preferred, *sizes, 64, 192, 256):
        try:
            if backend.supports_head_size(size):
                return size
        except Exception:
            break
    return sizes[0] if sizes else 128


def _block_size(backend: type) -> int:
    try:
        sizes = backend.get_supported_kernel_block_sizes()
    except Exception:
        sizes = []
    for size in sizes:
        if isinstance(size, int):
            return size
        base = getattr(size, "base", None)
        if isinstance(base, int):
            return max(base, 16)
    return 16


def _base_spec(backend: type, kv_cache_dtype: str) -> Any:
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    mla = bool(getattr(backend, "is_mla", lambda: False)())
    dtype = (
        torch.bfloat16
        if kv_cache_dtype in ("auto", "bfloat16")
        else STR_DTYPE_TO_TORCH_DTYPE.get(kv_cache_dtype, torch.uint8)
    )
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        dtype = torch.uint8
    fields = dict(
        block_size=_block_size(backend),
        num_kv_heads=1 if mla else 2,
        head_size=_head_size(backend, mla),
        dtype=dtype,
        kv_quant_mode=kvi.get_kv_quant_mode(kv_cache_dtype),
    )
    if mla:
        return kvi.MLAAttentionSpec(cache_dtype_str=kv_cache_dtype, **fields)
    return kvi.FullAttentionSpec(**fields)


def _view(spec: Any, backend: type) -> torch.Tensor:
    from vllm.v1.kv_cache_interface import KVCacheTensor, compute_layout_strides

    layouts: tuple = ()
    try:
        layouts = tuple(backend.supported_kv_cache_layouts() or ())
    except Exception:
        layouts = ()
    layout = layouts[0] if layouts else KVCacheLayout.LBHNC
    num_blocks = 3
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, 1, layout)
    tensor = KVCacheTensor(
        size=0, layers=["l0"], layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.zeros(num_blocks * spec.page_size_bytes, dtype=torch.int8)
    return kvi.create_kv_cache_views(raw, spec, num_blocks, layout, tensor)[0]


# The rotary dim Octave formats are sized with: vLLM registers the model's at
# start-up (rocm_octave.register_rope_dim, from partial_rotary_factor).
_OCTAVE_ROPE_DIM = 64


def _register_rope_dim(head_size: int) -> None:
    from vllm.v1.attention.ops import rocm_octave

    if head_size not in rocm_octave._rope_dim_by_head_size:
        rocm_octave.register_rope_dim(head_size, _OCTAVE_ROPE_DIM)


def customize_attention_spec(backend: type, spec: Any) -> Any:
    """The spec the runners keep for a layer of ``backend``
    (v1/worker/utils.py ``customize_attention_spec``: the backend's
    ``customize_spec``, then whole-kernel-block alignment)."""
    from vllm.v1.worker.utils import customize_attention_spec as customize

    return customize(backend, spec)


def published(backend: type) -> Iterator[Published | tuple[str, str, str]]:
    """What ``backend`` publishes per ``kv_cache_dtype``; a ``(path, dtype,
    why)`` triple where vLLM itself rejects the combination (its
    ``customize_spec`` raises: the backend cannot allocate it)."""
    path = f"{backend.__module__}.{backend.__qualname__}"
    for kv_cache_dtype in _kv_dtypes(backend):
        try:
            base = _base_spec(backend, kv_cache_dtype)
            if kv_cache_dtype.startswith("octave_"):
                _register_rope_dim(base.head_size)
            spec = customize_attention_spec(backend, base)
            if not dataclasses.is_dataclass(spec):
                raise TypeError(f"customize_spec returned {type(spec).__name__}")
            view = _view(spec, backend)
        except Exception as e:  # vLLM's own refusal of the combination
            yield (path, kv_cache_dtype, f"{type(e).__name__}: {e}"[:200])
            continue
        yield Published(backend, kv_cache_dtype, spec, view)


CPU_ATTN = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


def layer_for(pub: Published) -> Any:
    """The layer object a layer of ``pub``'s backend has, as far as the page
    maps read it: a ``LayerDouble`` naming the backend and dtype; for
    CPU_ATTN also the ISA its metadata builder sets on every layer
    (cpu_attn.py ``_set_isa_to_layers``: ``_get_attn_isa(model dtype, block
    size, head size, kv_cache_dtype)``, the host's own detection) and the
    model dtype.

    Raises:
        NotImplementedError: vLLM's ISA choice refuses the combination on
            this host (an fp8 cache without AVX-512 or AMX).
    """
    from tests.helpers.worker_caches import LayerDouble

    layer = LayerDouble(pub.backend, pub.kv_cache_dtype)
    path, _ = pub.key
    if path == CPU_ATTN:
        from vllm.v1.attention.backends import cpu_attn

        model_dtype = pub.spec.dtype if pub.spec.dtype.is_floating_point else torch.bfloat16
        layer.isa = cpu_attn._get_attn_isa(  # type: ignore[attr-defined]
            model_dtype, pub.spec.block_size, pub.spec.head_size, pub.kv_cache_dtype
        )
        layer.dtype = model_dtype  # type: ignore[attr-defined]
    return layer
