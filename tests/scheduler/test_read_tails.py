"""MoRIIO READ tails: zeroed once the READ has landed, all at once or layer by layer.

A READ copies whole producer blocks, the producer's stale tail included. The
tests play the READ: they write "producer" bytes (NaN-laden) over a layer's
destination blocks at the moment vLLM would see them land, then check the
worker's zeroing against the reference, byte for byte over the whole backing
storage.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.config import CUDAGraphMode
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvtail_connector import _compat
from kvtail_connector.core.metadata import GroupLoad, KVTailMetadata, LoadRecord
from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.ops import reference_zero_kv_blocks
from tests.helpers.layouts import rebase
from tests.helpers.vllm_factories import make_kv_cache_config
from tests.helpers.worker_caches import allocate, make_tail_worker

LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(3))
# Two READ loads (valid token counts include the recomputed token): tails in
# block 6 from slot 5 and in block 3 from slot 1.
READS = (
    LoadRecord("a", 0, 37, (GroupLoad(0, 0, (4, 2, 6)),)),
    LoadRecord("b", 16, 33, (GroupLoad(0, 1, (5, 3)),)),
)
TAILS = [(6, 5), (3, 1)]
DEST_BLOCKS = (4, 2, 6, 5, 3)


@pytest.fixture
def setup():
    kv = make_kv_cache_config(block_size=16, num_blocks=8, dtype=torch.bfloat16, layer_names=LAYERS)
    caches = allocate(kv)
    stats = KVTailStats()
    worker = make_tail_worker(kv, probes=True, zeroes_reads_by_layer=True, stats=stats)
    worker.register_kv_caches(caches.views, kv, caches.layers)
    worker.bind(KVTailMetadata(inner=None, read_loads=READS))  # type: ignore[arg-type]
    return SimpleNamespace(kv=kv, caches=caches, worker=worker, stats=stats)


def _land_read(view: torch.Tensor, seed: int) -> None:
    """The producer's blocks arrive: random bits (NaN among them) in every slot."""
    gen = torch.Generator().manual_seed(seed)
    for block in DEST_BLOCKS:
        page = view[block].view(torch.int16)
        page.copy_(torch.randint(-(2**15), 2**15, page.shape, dtype=torch.int16, generator=gen))
        view[block, :, -1, 0] = float("nan")  # at least one NaN in each tail


def _broken(*_a: object, **_k: object) -> None:
    """Stands in for a zeroing that fails."""
    raise RuntimeError("injected")


def _expected(
    s: SimpleNamespace, zeroed: list[str], backing: torch.Tensor | None = None
) -> torch.Tensor:
    """``backing`` (default: the backing as it is now) with the tails of
    ``zeroed`` layers zeroed."""
    expected = (s.caches.raw[0] if backing is None else backing).clone()
    views = rebase([s.caches.views[name] for name in zeroed], expected)
    reference_zero_kv_blocks(views, (), TAILS)
    return expected


def test_each_layer_is_zeroed_right_after_its_reads_land(setup):
    s = setup
    s.worker.reads_started(landed=False)
    assert s.worker.num_tracked == len(LAYERS)  # one layer's work each, nothing yet
    for i, name in enumerate(LAYERS):
        _land_read(s.caches.views[name], seed=i)
        before_zeroing = s.caches.raw[0].clone()
        s.worker.layer_loaded(name)
        # Exactly this layer's tails; the layers still waiting are untouched.
        assert torch.equal(s.caches.raw[0], _expected(s, [name], before_zeroing))
        assert not s.caches.views[name][6, :, 5:].isnan().any()
        assert s.caches.views[name][6, :, :5].isnan().any()  # valid slots keep their bytes
    assert s.worker.num_tracked == 0
    s.worker.end_step()  # nothing left for the end of the step
    assert s.stats.data["tails_zeroed"] == 2
    assert s.stats.data["probed_tails"] == 2  # one report per request, not per layer
    assert s.stats.data["stale_nonfinite_values"] > 0


def test_a_second_wait_for_the_same_layer_zeroes_nothing_more(setup):
    s = setup
    s.worker.reads_started(landed=False)
    name = LAYERS[0]
    _land_read(s.caches.views[name], seed=0)
    s.worker.layer_loaded(name)
    after = s.caches.raw[0].clone()
    s.worker.layer_loaded(name)
    s.worker.layer_loaded("model.layers.9.unknown")  # not a layer with tails: ignored
    assert torch.equal(s.caches.raw[0], after)


def test_reads_landed_at_start_zero_every_layer_at_once(setup):
    s = setup
    for i, name in enumerate(LAYERS):
        _land_read(s.caches.views[name], seed=i)
    expected = _expected(s, list(LAYERS))
    s.worker.reads_started(landed=True)
    assert torch.equal(s.caches.raw[0], expected)
    assert s.worker.num_tracked == 0
    for name in LAYERS:  # the per-layer hooks that follow find nothing to do
        s.worker.layer_loaded(name)
    assert torch.equal(s.caches.raw[0], expected)


def test_layers_whose_hook_never_runs_are_zeroed_at_the_end_of_the_step(setup):
    s = setup
    s.worker.reads_started(landed=False)
    for i, name in enumerate(LAYERS):
        _land_read(s.caches.views[name], seed=i)
    s.worker.layer_loaded(LAYERS[1])
    expected = _expected(s, [LAYERS[0], LAYERS[2]])
    s.worker.end_step()
    assert torch.equal(s.caches.raw[0], expected)
    assert s.worker.num_tracked == 0


def test_without_per_layer_support_the_reads_are_zeroed_at_start():
    # 0.33 (read_tails_by_layer False): READs have always landed at start.
    kv = make_kv_cache_config(block_size=16, num_blocks=8, layer_names=LAYERS)
    caches = allocate(kv)
    worker = make_tail_worker(kv)
    worker.register_kv_caches(caches.views, kv, caches.layers)
    worker.bind(KVTailMetadata(inner=None, read_loads=READS))  # type: ignore[arg-type]
    expected = caches.raw[0].clone()
    reference_zero_kv_blocks(rebase(list(caches.views.values()), expected), (), TAILS)
    worker.reads_started(landed=False)
    assert torch.equal(caches.raw[0], expected)


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE])
def test_when_reads_have_landed_at_start(mode):
    landed = _compat.moriio_reads_landed_at_start(SimpleNamespace(cudagraph_runtime_mode=mode))
    if _compat.check_vllm_version() >= (0, 33):
        assert landed and not _compat.moriio_reads_may_land_per_layer()
    else:
        # 0.32 MoRIIO awaits every READ in start_load_kv only under FULL graphs.
        assert landed == (mode == CUDAGraphMode.FULL)
        assert _compat.moriio_reads_may_land_per_layer()


def test_wrapper_hooks_reach_the_worker_in_order():
    from tests.scheduler.test_forwarding import build

    wrapper, inner, _ = build(KVConnectorRole.WORKER)
    # As for a MoRIIO READ consumer (its worker needs ROCm): READ tails on.
    wrapper._sync_read = True
    wrapper._worker = make_tail_worker(make_kv_cache_config(block_size=16, num_blocks=8))
    order: list[tuple[str, object]] = []
    worker = wrapper._worker
    worker.reads_started = lambda landed: order.append(("reads_started", landed))
    worker.layer_loaded = lambda name: order.append(("layer_loaded", name))
    worker.end_step = lambda: order.append(("end_step", None))
    for hook in ("start_load_kv", "wait_for_layer_load", "clear_connector_metadata"):
        original = getattr(inner, hook)
        setattr(
            inner,
            hook,
            lambda *a, _h=hook, _o=original, **k: (order.append((_h, None)), _o(*a, **k))[1],
        )
    ctx = SimpleNamespace(cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE)
    worker.bind(KVTailMetadata(inner=None, read_loads=READS))  # type: ignore[arg-type]
    wrapper.start_load_kv(ctx)
    wrapper.wait_for_layer_load(LAYERS[0])
    wrapper.clear_connector_metadata()
    landed = _compat.moriio_reads_landed_at_start(ctx)
    assert order == [
        ("start_load_kv", None),
        ("reads_started", landed),
        ("wait_for_layer_load", None),
        ("layer_loaded", LAYERS[0]),
        ("end_step", None),
        ("clear_connector_metadata", None),
    ]


def test_when_the_launch_fails_the_landed_tails_are_zeroed_on_the_reference_path(setup):
    # Containment (issue 18): the facade runs contain_reads after an internal
    # error in reads_started; where the READs have landed the tails are zeroed
    # exactly, before the forward, without the zeroer.
    s = setup
    for i, name in enumerate(LAYERS):
        _land_read(s.caches.views[name], seed=i)
    expected = _expected(s, list(LAYERS))
    records = s.worker.read_loads

    s.worker._rank.zero = _broken
    with pytest.raises(RuntimeError):
        s.worker.reads_started(landed=True)
    # The fence's event is taken once the tails are zeroed (on a GPU it is
    # recorded behind that work: start_load_kv then waits for it).
    rank = s.worker._rank
    mark = rank.mark_zeroed
    marked: list[bool] = []
    rank.mark_zeroed = lambda: (marked.append(torch.equal(s.caches.raw[0], expected)), mark())
    s.worker.contain_reads(records, landed=True)
    assert torch.equal(s.caches.raw[0], expected)
    assert marked == [True]
    assert s.worker.num_tracked == 0


def test_a_fallback_failing_partway_still_fences_what_it_zeroed(setup, monkeypatch, caplog):
    # Record "a"'s tail is zeroed, then the reference path raises on "b"'s:
    # the fence's mark is still taken behind "a"'s zeroing, and an ERROR
    # names "b", whose tail is left as it was.
    from kvtail_connector.core.parts.read_tails import worker as read_worker

    s = setup
    for i, name in enumerate(LAYERS):
        _land_read(s.caches.views[name], seed=i)
    before = s.caches.raw[0].clone()
    expected = before.clone()
    reference_zero_kv_blocks(rebase(list(s.caches.views.values()), expected), (), TAILS[:1])
    records = s.worker.read_loads
    real = read_worker.reference_zero_kv_blocks
    calls: list[int] = []

    def fails_on_b(caches, tails=(), **kw):  # type: ignore[no-untyped-def]
        calls.append(tails[0][0])
        if tails[0][0] == TAILS[1][0]:
            raise RuntimeError("injected")
        real(caches, tails=tails, **kw)

    monkeypatch.setattr(read_worker, "reference_zero_kv_blocks", fails_on_b)
    rank = s.worker._rank
    mark = rank.mark_zeroed
    marked: list[bool] = []
    rank.mark_zeroed = lambda: (marked.append(torch.equal(s.caches.raw[0], expected)), mark())
    with pytest.raises(RuntimeError, match="injected"):
        s.worker.contain_reads(records, landed=True)
    assert calls == [TAILS[0][0], TAILS[1][0]]
    assert marked == [True]
    assert torch.equal(s.caches.raw[0], expected)
    stale = [r.getMessage() for r in caplog.records if "left stale" in r.getMessage()]
    assert stale == ["KVTailConnector: READ tails of b may be left stale"]
    assert not s.worker.has_read_loads


def test_a_mark_without_an_event_keeps_the_fence_s_event(setup):
    # A zeroer without a launcher (the torch path) records no event: the
    # fence keeps waiting on the last one it had, never on nothing.
    rank = setup.worker._rank
    earlier = object()
    rank.last_zeroing = earlier
    assert rank.zeroer is not None and rank.zeroer.last_launch_done is None  # CPU
    rank.mark_zeroed()
    assert rank.last_zeroing is earlier


def test_reads_not_landed_are_zeroed_by_the_fallback_layer_by_layer_as_they_land(setup):
    # Containment: reads_started failed before the READs landed. Each layer's
    # tails are zeroed on the reference path at its wait (its READs landed,
    # its attention not run yet), the fence's event recorded behind; a layer
    # whose wait never ran, after the forward.
    s = setup
    before = s.caches.raw[0].clone()
    s.worker.contain_reads(s.worker.read_loads, landed=False)
    assert torch.equal(s.caches.raw[0], before)  # nothing before the READs land
    assert not s.worker.has_read_loads
    assert s.worker.num_tracked == len(LAYERS)
    assert s.worker.held_requests() == 2  # a and b
    rank = s.worker._rank
    mark = rank.mark_zeroed
    marks: list[torch.Tensor] = []
    rank.mark_zeroed = lambda: (marks.append(s.caches.raw[0].clone()), mark())
    for i, name in enumerate(LAYERS):
        _land_read(s.caches.views[name], seed=i)
        landed = s.caches.raw[0].clone()
        if name == LAYERS[-1]:
            s.worker.end_step()  # its wait never ran
        else:
            s.worker.layer_loaded(name)
        assert torch.equal(s.caches.raw[0], _expected(s, [name], landed)), name
        view = s.caches.views[name]
        assert not view[6, :, 5:].any() and not view[3, :, 1:].any(), name
        assert view[6, :, :5].isnan().any(), name  # valid slots keep their bytes
        assert torch.equal(marks[-1], s.caches.raw[0]), name  # fenced behind it
    assert s.worker.num_tracked == 0
    assert s.worker.held_requests() == 0


def test_the_fallback_holds_nothing_for_reads_without_a_tail_or_after_a_failing_last_layer(
    setup, monkeypatch
):
    from kvtail_connector.core.parts.read_tails import on_reference

    s = setup
    records = s.worker.read_loads
    aligned = LoadRecord("z", 0, 32, (GroupLoad(0, 0, (4, 2)),))  # block-aligned: no tail
    s.worker.contain_reads([aligned], landed=False)
    assert s.worker.num_tracked == 0 and s.worker.held_requests() == 0
    s.worker.contain_reads(records, landed=False)
    for name in LAYERS[:-1]:
        s.worker.layer_loaded(name)

    monkeypatch.setattr(on_reference, "reference_zero_kv_blocks", _broken)
    with pytest.raises(RuntimeError):
        s.worker.layer_loaded(LAYERS[-1])
    assert s.worker.num_tracked == 0 and s.worker.held_requests() == 0


def test_fallback_layers_left_by_a_step_without_end_step_are_dropped_at_the_next_bind(
    setup, caplog
):
    s = setup
    s.worker.contain_reads(s.worker.read_loads, landed=False)
    s.worker.layer_loaded(LAYERS[0])
    after = s.caches.raw[0].clone()
    s.worker.bind(KVTailMetadata(inner=None))  # type: ignore[arg-type]  # the next step
    assert s.worker.num_tracked == 0
    for name in LAYERS:
        s.worker.layer_loaded(name)
    s.worker.end_step()
    assert torch.equal(s.caches.raw[0], after)  # nothing zeroed over the next step's KV
    assert "READ tails of a, b left stale (their step ended early)" in caplog.text


def test_a_fallback_layer_that_fails_at_its_wait_is_not_zeroed_again_later(
    setup, monkeypatch, caplog
):
    from kvtail_connector.core.parts.read_tails import on_reference

    s = setup
    s.worker.contain_reads(s.worker.read_loads, landed=False)

    monkeypatch.setattr(on_reference, "reference_zero_kv_blocks", _broken)
    with pytest.raises(RuntimeError):
        s.worker.layer_loaded(LAYERS[0])
    assert f"READ tails of a, b may be left stale ({LAYERS[0]})" in caplog.text
    monkeypatch.undo()
    before = s.caches.raw[0].clone()
    s.worker.layer_loaded(LAYERS[0])  # forgotten: no second zeroing
    assert torch.equal(s.caches.raw[0], before)
    assert s.worker.num_tracked == len(LAYERS) - 1
