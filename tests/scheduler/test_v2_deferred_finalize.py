"""vLLM 0.33's V2 model runner with deferred finalization (issue 18, item 6).

With a drafter the V2 runner calls ``post_forward(..., defer_finalize=True)``
(transfer results, worker metadata) and only after the drafter
``finalize_step()`` (``wait_for_save`` and ``clear_connector_metadata``). The
real :class:`ActiveKVConnector` drives the wrapper here, in the runner's order:
``pre_forward`` (bind), the forward's KV writes, ``finish_forward``,
``post_forward``, the drafter's writes, ``finalize_step``.

- P: the claim and the digest come from ``finish_forward``, ordered after the
  forward's last KV write and before ``post_forward`` builds the step's worker
  metadata, deferred or not; with a drafter (the only case vLLM defers) P
  claims nothing, as the drafter writes past the prompt after the forward.
- D: load records live in the worker from ``bind`` to the load's completion,
  not in the step's metadata, so a metadata cleared one step late (or early)
  loses none; the tail is zeroed and the digest checked at completion.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from kvtail_connector import _compat
from kvtail_connector.extras import entry
from tests.helpers.lifecycle import BLOCK, LOADED, Harness, routed, slot_state
from tests.helpers.vllm_factories import make_model_runner_output
from tests.scheduler.test_kv_digest import reference, transfer

kv_connector = pytest.importorskip(
    "vllm.v1.worker.gpu.kv_connector", reason="the V2 runner's ActiveKVConnector"
)
if (
    "defer_finalize"
    not in inspect.signature(kv_connector.ActiveKVConnector.post_forward).parameters
):
    pytest.skip("deferred finalization is vLLM 0.33's", allow_module_level=True)

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
PROMPT = 37


def active(h: Harness, monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's ActiveKVConnector around the harness's worker connector."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", h.worker)
    return kv_connector.ActiveKVConnector(h.vllm_config, h.caches.views)


def v2_step(
    h: Harness,
    runner: Any,
    *,
    defer: bool,
    forward: Any = None,
    drafter: Any = None,
    calls: list[str] | None = None,
) -> dict[str, Any]:
    """One V2 execute_model, in GPUModelRunner's order; the finished requests'
    params. ``forward``/``drafter``: callables writing KV at those points."""
    s = h.scheduler
    out = s.schedule()
    h.metas.append(out.kv_connector_metadata)
    runner.pre_forward(out)
    if forward is not None:
        forward(out)
    runner.finish_forward()
    kv_out = runner.post_forward(out.finished_req_ids, defer_finalize=defer)
    if calls is not None:
        calls.append("post_forward returned")
    if drafter is not None:
        drafter(out)
    if defer:
        runner.finalize_step()
    model_out = make_model_runner_output(out, scheduler=s, kv_connector_output=kv_out)
    outputs = s.update_from_output(out, model_out)
    return {
        o.request_id: o.kv_transfer_params
        for outs in outputs.values()
        for o in outs.outputs
        if o.finish_reason is not None
    }


def _record_calls(h: Harness, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    worker = h.worker._worker
    for name in ("produce", "worker_meta"):
        original = getattr(worker, name)

        def traced(*args: Any, _name: str = name, _f: Any = original, **kw: Any) -> Any:
            calls.append(_name)
            return _f(*args, **kw)

        monkeypatch.setattr(worker, name, traced)
    for name in ("wait_for_save", "clear_connector_metadata"):
        original = getattr(h.worker, name)

        def traced_hook(*args: Any, _name: str = name, _f: Any = original, **kw: Any) -> Any:
            calls.append(_name)
            return _f(*args, **kw)

        monkeypatch.setattr(h.worker, name, traced_hook)
    return calls


def _prompt_writer(h: Harness, req_id: str, seed: int) -> Any:
    """The forward: writes random KV for the prompt's tokens (and nothing past)."""

    def forward(out: Any) -> None:
        if req_id not in out.num_scheduled_tokens:
            return
        ids = h.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        g = torch.Generator().manual_seed(seed)
        for layer in LAYERS:
            view = h.caches.views[layer]
            for t in range(PROMPT):
                view[ids[t // BLOCK], :, t % BLOCK, :] = torch.randn(
                    view[ids[0], :, 0, :].shape, generator=g
                ).to(view.dtype)

    return forward


@pytest.mark.parametrize("defer", [False, True], ids=["finalize-in-post_forward", "deferred"])
def test_p_claims_and_digests_what_the_forward_wrote_before_the_step_metadata(monkeypatch, defer):
    monkeypatch.setattr(_compat, "producer_tail_hook", lambda _cfg: "finish_forward")
    # trust: an auto producer makes no claim over this transport.
    h = Harness("always", kv_role="kv_producer", verify_kv="digest", vouch_tails="trust")
    runner = active(h, monkeypatch)
    calls = _record_calls(h, monkeypatch)
    h.add("p1", PROMPT, max_tokens=1, do_remote_decode=True)
    params = v2_step(h, runner, defer=defer, forward=_prompt_writer(h, "p1", 3), calls=calls)["p1"]
    reading = entry.read(params)
    found, why = reading.entry, reading.why
    assert why == "ok" and found is not None and found.tail_zero and found.digest is not None
    (ids,) = params["remote_block_ids"]
    # The digest is over what the forward wrote; the tail is zero.
    assert found.digest.sums[0] == {
        k: tuple(v) for k, v in reference(h, ids, 0, PROMPT, found.digest.segment).items()
    }
    for layer in LAYERS:
        assert slot_state(h.caches.views[layer], ids[2])[PROMPT % BLOCK :] == ["zero"] * 11
    # Order: zeroing (finish_forward) before the step's worker metadata, and
    # both before post_forward returned; finalize_step's hooks after it.
    assert calls.index("produce") < calls.index("worker_meta")
    assert calls.index("worker_meta") < calls.index("post_forward returned")
    if defer:
        assert calls.index("wait_for_save") > calls.index("post_forward returned")
        assert calls.index("clear_connector_metadata") > calls.index("post_forward returned")
    h.scheduler.schedule()
    assert h.worker.scheduler_state_is_empty()
    assert h.stats["tails_vouched"] == 1 and h.stats["digests_sent"] == 1


def test_with_a_drafter_v2_defers_and_p_claims_nothing(monkeypatch):
    h = Harness("always", kv_role="kv_producer", num_speculative_tokens=2)
    runner = active(h, monkeypatch)
    h.add("p1", PROMPT, max_tokens=1, do_remote_decode=True)

    def drafter(out: Any) -> None:
        # Draft KV past the prompt, after the forward (EAGLE/MTP style).
        ids = h.scheduler.kv_cache_manager.get_block_ids("p1")[0]
        for layer in LAYERS:
            h.caches.views[layer][ids[2], :, PROMPT % BLOCK, :] = LOADED

    params = v2_step(h, runner, defer=True, forward=_prompt_writer(h, "p1", 4), drafter=drafter)
    assert entry.KEY not in (params["p1"] or {})
    h.scheduler.schedule()
    assert h.worker.scheduler_state_is_empty()
    assert h.stats["tails_vouched"] == 0 and h.stats["producer_tail_bytes_zeroed"] == 0


@pytest.mark.parametrize("defer", [False, True], ids=["finalize-in-post_forward", "deferred"])
def test_d_records_outlive_deferred_metadata_and_are_used_at_completion(monkeypatch, defer):
    # P: a real producer's KV and entry (claim and digest) for the prompt.
    monkeypatch.setattr(_compat, "producer_tail_hook", lambda _cfg: "finish_forward")
    p = Harness("always", kv_role="kv_producer", verify_kv="digest")
    p_runner = active(p, monkeypatch)
    p.add("p1", PROMPT, max_tokens=1, do_remote_decode=True)
    params = v2_step(p, p_runner, defer=False, forward=_prompt_writer(p, "p1", 5))["p1"]

    d = Harness("always", kv_role="kv_consumer", verify_kv="digest")
    runner = active(d, monkeypatch)
    load = {"double_load_tokens": PROMPT, "double_finish_after_steps": 3}
    d.add("c1", PROMPT, **routed(params), **load)
    v2_step(d, runner, defer=defer)  # bound, load started in post_forward
    assert d.records() and d.records()[0].req_id == "c1"
    (p_ids,) = params["remote_block_ids"]
    transfer(p, p_ids, d, "c1", PROMPT)
    v2_step(d, runner, defer=defer)  # metadata of the step that bound it: cleared
    d_ids = d.inner_scheduler.blocks_by_req["c1"][0]
    for _ in range(50):
        if not d.scheduler.has_requests():
            break
        v2_step(d, runner, defer=defer)
    d.scheduler.schedule()
    for layer in LAYERS:
        assert slot_state(d.caches.views[layer], d_ids[2])[PROMPT % BLOCK :] == ["zero"] * 11
        assert torch.equal(
            d.caches.views[layer][d_ids[2], :, : PROMPT % BLOCK],
            p.caches.views[layer][p_ids[2], :, : PROMPT % BLOCK],
        )
    assert d.worker.scheduler_state_is_empty()
    assert d.stats["digests_verified"] == 1 and d.stats["failed_loads"] == 0
    # vouch_tails auto on both sides: no claim made, D zeroed the tail itself.
    assert (d.stats["tails_zeroed"], d.stats["vouched_tails"]) == (1, 0)
