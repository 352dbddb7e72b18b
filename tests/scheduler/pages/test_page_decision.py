"""The one decision every layer's page goes through (``pages.layer_cache``):
a layer is zeroed only through a map that covers its backend and spec;
anything else stops the engine at start-up, naming the layer.

Runs on every supported release (this folder is the scheduler suite): a spec
field a new vLLM adds fails here until it is sorted into ``spec_fields``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.v1 import kv_cache_interface as kvi
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtail_connector.pages import MAPS, EngineFacts, UnmappedPage, layer_cache
from kvtail_connector.pages.spec_fields import KNOWN_FIELDS, LEAVES_PAGE, SHAPES_PAGE
from tests.helpers.stub_imports import import_with_stubs
from tests.helpers.worker_caches import ErrorSource, LayerDouble, allocate, make_tail_worker

LAYER = "model.layers.0.self_attn.attn"


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def _spec(**changes):
    base = kvi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    return replace(base, **changes)


def _view(spec, layout=KVCacheLayout.LBHNC, num_blocks=4):
    config = kvi.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[kvi.KVCacheGroupSpec([LAYER], spec)],
    )
    return allocate(config, layout).views[LAYER]


def test_every_attention_spec_field_of_this_release_is_sorted():
    # A field vLLM adds may reshape pages: it must be read and sorted first.
    fields = {
        f.name
        for cls in (kvi.AttentionSpec, *_subclasses(kvi.AttentionSpec))
        for f in dataclasses.fields(cls)
    }
    assert fields <= KNOWN_FIELDS, f"unsorted AttentionSpec fields: {sorted(fields - KNOWN_FIELDS)}"
    assert not SHAPES_PAGE & LEAVES_PAGE


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC], ids=str)
def test_a_plain_backend_with_an_unpacked_spec_is_zeroed_through_its_view(layout):
    spec = _spec()
    view = _view(spec, layout)
    assert layer_cache(LAYER, view, spec, LayerDouble(FlashAttentionBackend)) is view


def test_an_unknown_backend_is_refused_naming_the_layer_backend_and_dtype():
    class OutOfTreeBackend:
        @staticmethod
        def get_name() -> str:
            return "MY_BACKEND"

    spec = _spec()
    with pytest.raises(UnmappedPage) as err:
        layer_cache(LAYER, _view(spec), spec, LayerDouble(OutOfTreeBackend, "fp8"))
    text = str(err.value)
    for part in (
        repr(LAYER),
        "MY_BACKEND",
        f"{__name__}.",  # the class path it is keyed on
        "kv_cache_dtype 'fp8'",
        "no page map covers",
        "zero_tails",
        "docs/compatibility.md",
    ):
        assert part in text, text


def test_a_layer_without_a_backend_is_refused():
    spec = _spec()
    for layer in (None, object()):
        with pytest.raises(UnmappedPage, match="names no attention backend"):
            layer_cache(LAYER, _view(spec), spec, layer)


@pytest.mark.parametrize(
    "packing",
    [
        {"num_head_slots": 4},
        {"state_content_bytes": 200},
        {"kv_quant_mode": kvi.KVQuantMode.NVFP4},
        {"kv_quant_mode": kvi.KVQuantMode.INT8_PER_TOKEN_HEAD},
    ],
    ids=lambda p: next(iter(p)),
)
def test_a_plain_backend_whose_spec_packs_its_pages_is_refused(packing):
    # FLASH_ATTN never publishes these; a spec that does is not one we read.
    spec = _spec(**packing)
    view = torch.zeros(4, spec.num_heads, 16, spec.state_content_size_bytes, dtype=torch.uint8)
    with pytest.raises(UnmappedPage) as err:
        layer_cache(LAYER, view, spec, LayerDouble(FlashAttentionBackend))
    name = next(iter(packing))
    assert name in str(err.value), str(err.value)


def test_a_spec_field_no_map_knows_is_refused_when_set():
    @dataclass(frozen=True, kw_only=True)
    class FutureSpec(kvi.FullAttentionSpec):
        interleaved_tokens: int = 0  # a field a later vLLM might add

    spec = FutureSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    view = _view(spec)
    layer = LayerDouble(FlashAttentionBackend)
    assert layer_cache(LAYER, view, spec, layer) is view  # at its default: reshapes nothing
    with pytest.raises(UnmappedPage, match=r"fields no page map knows \(interleaved_tokens=2\)"):
        layer_cache(LAYER, view, replace(spec, interleaved_tokens=2), layer)


def test_a_view_the_spec_could_not_have_made_is_refused():
    spec = _spec()
    wrong = torch.zeros(4, 2, 16, 48, dtype=torch.bfloat16)  # 96-byte cells, spec says 128
    with pytest.raises(UnmappedPage, match="does not match the spec"):
        layer_cache(LAYER, wrong, spec, LayerDouble(FlashAttentionBackend))


def test_maps_name_backends_by_class_path():
    for page_map in MAPS:
        assert page_map.backends, page_map.layout
        for path in page_map.backends:
            module, _, name = path.rpartition(".")
            assert module.startswith("vllm.") and name[:1].isupper(), path


def _unmapped_layer() -> tuple[kvi.KVCacheConfig, Any, dict[str, LayerDouble]]:
    """One attention layer's config, caches, and a backend no map knows."""
    config = kvi.KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[kvi.KVCacheGroupSpec([LAYER], _spec())],
    )

    class OutOfTreeBackend:
        pass

    return config, allocate(config), {LAYER: LayerDouble(OutOfTreeBackend)}


def test_an_unmapped_layer_stops_the_worker_at_registration():
    config, caches, layers = _unmapped_layer()
    worker = make_tail_worker(config)
    with pytest.raises(UnmappedPage, match=repr(LAYER)):
        worker.register_kv_caches(caches.views, config, layers)
    # Nothing zeroed, digested or probed: the layout is never read.
    idle = make_tail_worker(config, zeroes_tails=False, zeroes_read_tails=False)
    idle.register_kv_caches(caches.views, config, layers)


@pytest.mark.extras  # the digest's worker half is an opt-in layer
def test_the_default_sampled_digest_steps_aside_on_an_unmapped_layer(caplog):
    """``verify_kv`` "sample" (the default) or "auto" maps pages only for the
    digest: a layout it cannot map turns the digest off on that worker, with a
    WARNING, instead of stopping an engine that zeroes nothing; "digest" set by
    name, or any zeroing, still refuses."""
    config, caches, layers = _unmapped_layer()
    digest_only = dict(zeroes_tails=False, zeroes_read_tails=False, verifies_loads=True)
    sampled = make_tail_worker(config, **digest_only, digest_steps_aside=True)
    sampled.register_kv_caches(caches.views, config, layers)
    assert "verify_kv is off on this worker" in caplog.text and repr(LAYER) in caplog.text
    # It runs on without the digest: a load completes, unchecked.
    done = KVConnectorTransferResults(finished_recving={"r"})
    assert sampled.transfer_results(done, set(), ErrorSource()).finished_recving == {"r"}
    named = make_tail_worker(config, **digest_only, digest_steps_aside=False)
    with pytest.raises(UnmappedPage) as err:
        named.register_kv_caches(caches.views, config, layers)
    assert 'verify_kv "digest" maps the pages too' in " ".join(err.value.__notes__)
    zeroing = make_tail_worker(config, verifies_loads=True, digest_steps_aside=True)
    with pytest.raises(UnmappedPage, match=repr(LAYER)):
        zeroing.register_kv_caches(caches.views, config, layers)


_FUSABLE = (
    "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend",
    "vllm.v1.attention.backends.rocm_aiter_fa.AiterFlashAttentionBackend",
)


@pytest.mark.parametrize("path", _FUSABLE, ids=lambda p: p.rsplit(".", 1)[-1])
def test_a_backend_whose_writes_a_fused_aiter_op_takes_over_is_refused_under_that_pass(path):
    module, _, name = path.rpartition(".")
    backend = getattr(import_with_stubs(module), name)
    spec = _spec()
    view = _view(spec)
    assert layer_cache(LAYER, view, spec, LayerDouble(backend)) is view  # its own writer
    setting = '--compilation-config \'{"pass_config": {"fuse_rope_kvcache": false}}\''
    fused = EngineFacts(fused_kv_writer=setting)
    with pytest.raises(UnmappedPage) as err:
        layer_cache(LAYER, view, spec, LayerDouble(backend), fused)
    assert "fused AITER op" in str(err.value) and setting in str(err.value)


@pytest.mark.parametrize("flag", ["fuse_rope_kvcache", "fuse_qk_norm_rope_kvcache"])
def test_the_fused_writer_passes_are_read_only_on_rocm(monkeypatch, flag):
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from kvtail_connector import _compat

    passes = {f: False for f in ("fuse_rope_kvcache", "fuse_qk_norm_rope_kvcache")}
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(pass_config=SimpleNamespace(**{**passes, flag: True})),
        model_config=SimpleNamespace(architecture="LlamaForCausalLM"),
    )
    assert _compat.fused_kv_writer(config) is None  # this CPU platform runs no such pass
    monkeypatch.setattr(type(current_platform), "is_rocm", lambda self: True)
    assert flag in (_compat.fused_kv_writer(config) or "")
    config.compilation_config.pass_config = SimpleNamespace(**passes)
    assert _compat.fused_kv_writer(config) is None
