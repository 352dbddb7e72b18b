"""Producer claims on the real Scheduler (0.32 and 0.33): P zeroes and vouches,
D trusts only a claim made for its own load.

P runs the wrapper around the transport double as a producer: its
``request_finished`` returns P/D params for remote-decode requests, as NIXL's
producer does. The ``kvtail`` entry must reach the very params vLLM puts into
the request's ``EngineCoreOutput`` (the wrapper fills them in place, in the
same ``update_from_output`` call): a vLLM that reorders ``request_finished`` and
``update_connector_output`` fails here instead of silently dropping the claim.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

from kvtail_connector import _compat
from kvtail_connector._version import __version__
from kvtail_connector.core.metadata import KVTailMetadata
from kvtail_connector.extras import entry, trust
from tests.helpers.lifecycle import BLOCK, Harness, routed, slot_state
from tests.helpers.vllm_factories import (
    make_model_runner_output,
    make_worker_connector,
    run_step,
    run_worker_step,
    runs_v2_runner,
)
from tests.helpers.worker_caches import allocate

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def producer(**kw: Any) -> Harness:
    # Claims alone: the digest (verify_kv) has its own tests.
    # trust: an auto producer vouches only where an auto consumer skips on the
    # claim (READ tails zeroed per layer), not over this transport.
    kw.setdefault("verify_kv", "off")
    kw.setdefault("vouch_tails", "trust")
    return Harness("always", kv_role="kv_producer", **kw)


def finished_params(engine_outputs: dict[int, Any]) -> dict[str, Any]:
    return {
        o.request_id: o.kv_transfer_params
        for outs in engine_outputs.values()
        for o in outs.outputs
        if o.finish_reason is not None
    }


def step(h: Harness) -> dict[str, Any]:
    """One engine step; the params of the requests it finished."""
    out, engine_outputs = run_step(h.scheduler, h.worker)
    assert isinstance(out.kv_connector_metadata, KVTailMetadata)
    h.metas.append(out.kv_connector_metadata)
    return finished_params(engine_outputs)


def slot_bytes(view: torch.Tensor) -> int:
    return view.shape[1] * view.shape[3] * view.element_size()


def prefill_leg(h: Harness, req_id: str, num_tokens: int) -> dict[str, Any]:
    h.add(req_id, num_tokens, max_tokens=1, do_remote_decode=True)
    params = step(h)
    h.finish()
    return params[req_id]


# ------------------------------------------------------------------ producer


def test_a_remote_decode_prompt_leaves_with_a_claim_after_its_tail_is_zeroed():
    h = producer()
    h.add("p1", 37, max_tokens=1, do_remote_decode=True)
    params = step(h)["p1"]
    reading = entry.read(params)
    found = reading.entry
    assert reading.why == "ok" and found is not None
    assert found.num_tokens == 37 and found.tail_zero
    assert found.geometry.block_sizes == (BLOCK,) and found.geometry.dcp == 1
    assert params["do_remote_prefill"] is True  # the inner connector's params, kept
    # The producer's version, and the binding to this transfer's identity in the
    # same params (engine id, request id, block ids); no MAC without a key.
    assert found.producer_version == __version__ == "0.2.0"
    assert found.binding == trust.binding(params, 10**6) is not None
    assert found.mac is None and "mac" not in params[entry.KEY]
    (ids,) = params["remote_block_ids"]
    view = h.caches.views[LAYERS[0]]
    for layer in LAYERS:
        # The forward's slots are P's business (stale here: no forward ran);
        # exactly the slots past the prompt in its last block are zeroed.
        assert slot_state(h.caches.views[layer], ids[2]) == ["stale"] * 5 + ["zero"] * 11
        for b in ids[:2]:
            assert slot_state(h.caches.views[layer], b) == ["stale"] * BLOCK
    others = sorted(set(range(h.kv_cache_config.num_blocks)) - {ids[2]})
    assert torch.isnan(view[others]).all()
    h.finish()
    assert h.stats["tails_vouched"] == 1
    assert h.stats["producer_tail_bytes_zeroed"] == 11 * len(LAYERS) * slot_bytes(view)
    assert h.stats["tail_bytes_zeroed"] == 0


def test_by_default_a_producer_over_nixl_makes_no_claim_and_zeroes_nothing(caplog):
    # vouch_tails auto: an auto consumer zeroes every async load's tail itself,
    # so this producer (its transfer carries its whole blocks, as NIXL's does)
    # would zero for a claim nobody uses: it does neither, and says so at start-up.
    with caplog.at_level(logging.INFO):
        h = producer(vouch_tails="auto")
    assert "vouch_tails=auto -> not vouching (an auto consumer would not use" in caplog.text
    assert not h.scheduler.connector._policy.vouches_for_tails
    h.add("p1", 37, max_tokens=1, do_remote_decode=True)
    params = step(h)["p1"]
    assert params["do_remote_prefill"] is True and entry.KEY not in params
    view = h.caches.views[LAYERS[0]]
    assert torch.isnan(view).all()  # no slot of any block zeroed
    h.finish()
    assert h.stats["tails_vouched"] == 0 and h.stats["producer_tail_bytes_zeroed"] == 0


def producer_tails(meta: Any) -> tuple[Any, ...]:
    """The prompt tails a step's metadata ships (in the extras' payload)."""
    return meta.extra.producer_tails if meta.extra is not None else ()


def test_a_trust_producer_says_it_vouches_at_start_up(caplog):
    with caplog.at_level(logging.INFO):
        h = producer()
    # The hook of the runner this engine runs (V1 on 0.32/0.33 here, V2 on 0.34).
    hook = "finish_forward" if runs_v2_runner(h.vllm_config) else "wait_for_save"
    assert f"vouch_tails=trust -> vouching for prompt tails (zeroed in {hook})" in caplog.text


def test_a_block_aligned_prompt_is_vouched_for_with_nothing_to_zero():
    h = producer()
    params = prefill_leg(h, "p1", 48)
    found = entry.read(params).entry
    assert found is not None and (found.num_tokens, found.tail_zero) == (48, True)
    assert h.stats["tails_vouched"] == 1 and h.stats["producer_tail_bytes_zeroed"] == 0
    assert producer_tails(h.metas[0])[0].groups == ()


def test_a_chunked_prompt_is_recorded_in_the_step_that_completes_it():
    h = producer(max_num_batched_tokens=32)
    h.add("p1", 70, max_tokens=1, do_remote_decode=True)
    assert step(h) == {} and step(h) == {}  # chunks 0-31, 32-63
    params = step(h)["p1"]  # 64-69 completes the prompt
    assert [len(producer_tails(m)) for m in h.metas] == [0, 0, 1]
    assert entry.read(params).entry.num_tokens == 70
    h.finish()


@pytest.mark.parametrize(
    ("max_tokens", "remote_decode"), [(4, True), (1, False)], ids=["decodes-on-P", "plain"]
)
def test_no_claim_for_requests_that_are_not_single_token_prefill_legs(max_tokens, remote_decode):
    h = producer()
    kw = {"do_remote_decode": True} if remote_decode else {}
    h.add("p1", 37, max_tokens=max_tokens, **kw)
    params: dict[str, Any] = {}
    for _ in range(max_tokens):
        params.update(step(h))
    assert "p1" in params
    assert params["p1"] is None or entry.KEY not in params["p1"]
    assert all(not producer_tails(m) for m in h.metas)
    h.finish()
    assert h.stats["tails_vouched"] == 0 and h.stats["producer_tail_bytes_zeroed"] == 0


def test_a_drafter_on_the_producer_means_no_claim_and_no_zeroing():
    h = producer(num_speculative_tokens=2)
    params = prefill_leg(h, "p1", 37)
    assert entry.KEY not in params
    assert h.stats["producer_tail_bytes_zeroed"] == 0


def _step_without_the_hook(h: Harness, order: str) -> dict[str, Any]:
    """A worker step in another runner's order: ``v1-no-hook`` never calls
    ``wait_for_save`` (a runner that skipped the hook); ``v2`` calls
    ``finish_forward`` after the forward, as the V2 model runner does."""
    out = h.scheduler.schedule()
    worker, meta = h.worker, out.kv_connector_metadata
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)  # type: ignore[arg-type]
    if order == "v2":
        worker.finish_forward()
        worker.wait_for_save()
    results = worker.get_transfer_results(out.finished_req_ids)
    from vllm.v1.outputs import KVConnectorOutput

    kv_out = KVConnectorOutput(
        finished_sending=results.finished_sending,
        finished_recving=results.finished_recving,
        kv_connector_worker_meta=worker.build_connector_worker_meta(),
    )
    worker.clear_connector_metadata()
    runner = make_model_runner_output(out, scheduler=h.scheduler, kv_connector_output=kv_out)
    return finished_params(h.scheduler.update_from_output(out, runner))


def test_the_claim_needs_the_zeroing_to_have_run_in_the_runners_hook(monkeypatch):
    h = producer()
    h.add("p1", 37, max_tokens=1, do_remote_decode=True)
    params = _step_without_the_hook(h, "v1-no-hook")["p1"]
    assert entry.KEY not in params  # bound, never zeroed: never claimed
    h.finish()

    monkeypatch.setattr(_compat, "producer_tail_hook", lambda _cfg: "finish_forward")
    v2 = producer()
    v2.add("p2", 37, max_tokens=1, do_remote_decode=True)
    params = _step_without_the_hook(v2, "v2")["p2"]
    assert entry.read(params).why == "ok"
    (ids,) = params["remote_block_ids"]
    assert slot_state(v2.caches.views[LAYERS[0]], ids[2])[5:] == ["zero"] * 11
    v2.finish()


class TPProducer:
    """A real Scheduler and ``ranks`` producer workers through vLLM's aggregator."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, ranks: int) -> None:
        monkeypatch.setattr(_compat, "worker_count", lambda _p: ranks)
        self.h = producer()
        self.workers = [self.h.worker]
        for rank in range(1, ranks):
            with monkeypatch.context() as patch:
                patch.setattr(_compat, "worker_rank", lambda r=rank: r)
                w = make_worker_connector(self.h.vllm_config, self.h.kv_cache_config)
            w.register_kv_caches(allocate(self.h.kv_cache_config).publish(self.h.vllm_config))
            self.workers.append(w)
        self.aggregator = KVOutputAggregator(ranks)

    def step(self, replayed_for: tuple[int, int] | None = None) -> dict[str, Any]:
        """One step; ``replayed_for=(missing, replayed)``: the missing rank's
        metadata is replaced by another rank's, folded in twice (a degraded
        worker set whose saved output is replayed, as 0.33's fault-tolerant
        aggregation can)."""
        s = self.h.scheduler
        out = s.schedule()
        outputs = [
            make_model_runner_output(out, scheduler=s, kv_connector_output=run_worker_step(w, out))
            for w in self.workers
        ]
        metas = [o.kv_connector_output.kv_connector_worker_meta for o in outputs]
        if replayed_for is not None:
            missing, replayed = replayed_for
            metas[missing] = metas[replayed]
        folded = self.aggregator.aggregate(outputs)
        agg = metas[0]
        for m in metas[1:]:
            agg = agg.aggregate(m)
        folded.kv_connector_output.kv_connector_worker_meta = agg
        return finished_params(s.update_from_output(out, folded))


def test_every_rank_must_confirm_and_one_that_did_not_zero_withholds_the_claim(monkeypatch):
    tp = TPProducer(monkeypatch, ranks=4)
    tp.h.add("p1", 37, max_tokens=1, do_remote_decode=True)
    assert entry.read(tp.step()["p1"]).why == "ok"
    tp.workers[2].unregister_kv_caches()  # sleep mode on one rank
    tp.h.add("p2", 37, max_tokens=1, do_remote_decode=True)
    assert entry.KEY not in tp.step()["p2"]
    tp.workers[2].restore_kv_caches()
    tp.h.add("p3", 37, max_tokens=1, do_remote_decode=True)
    assert entry.read(tp.step()["p3"]).why == "ok"
    tp.h.scheduler.schedule()
    assert tp.h.scheduler.connector.scheduler_state_is_empty()
    assert all(w.scheduler_state_is_empty() for w in tp.workers)


def test_a_replayed_output_cannot_stand_in_for_a_rank_that_did_not_zero(monkeypatch):
    tp = TPProducer(monkeypatch, ranks=4)
    tp.workers[3].unregister_kv_caches()  # rank 3 zeroes nothing
    tp.h.add("p1", 37, max_tokens=1, do_remote_decode=True)
    # Rank 0's metadata folded in twice instead of rank 3's: four confirmations
    # from three ranks.
    assert entry.KEY not in tp.step(replayed_for=(3, 0))["p1"]


def test_no_claim_for_a_request_preempted_after_its_tail_was_zeroed():
    # Async scheduling can preempt a request after the step that zeroed its
    # tail was scheduled (its blocks freed); the output of that step still
    # finishes it. The claim must not survive the preemption.
    h = producer()
    h.add("p1", 37, max_tokens=1, do_remote_decode=True)
    out = h.scheduler.schedule()
    kv_out = run_worker_step(h.worker, out)
    request = h.scheduler.requests["p1"]
    request.num_preemptions += 1  # what _preempt_request does, with its num_computed_tokens = 0
    request.num_computed_tokens = 0
    # The step's token, as the runner sampled it (it ran before the preemption).
    runner = make_model_runner_output(out, kv_connector_output=kv_out)
    params = finished_params(h.scheduler.update_from_output(out, runner))
    assert "p1" in params, "the stale output still finishes the request"
    assert entry.KEY not in (params["p1"] or {})


# ------------------------------------------------------------------ consumer

KEY_ENV = "KVTAIL_TEST_ENTRY_KEY"


def _consume(
    params: dict[str, Any] | None,
    *,
    probe: bool = False,
    tail_zero_on_arrival: bool = False,
    **wrapper: Any,
) -> Harness:
    """D loads 37 tokens of ``c1`` with P's ``params`` as a router hands them
    over (None: no entry); the transport writes tokens 0-36 (and, with
    ``tail_zero_on_arrival``, zeroes in the tail the way a vouching
    producer's block arrives). ``wrapper``: D's settings (``vouch_tails``...)."""
    wrapper.setdefault("verify_kv", "off")  # claims alone (see producer())
    h = Harness("always", probe_stale_tails=probe, **wrapper)
    load: dict[str, Any] = {"double_load_tokens": 37, "double_finish_after_steps": 2}
    if params is not None:
        load.update(params)
    h.add("c1", 37, **load)
    h.step()
    h.land("c1", 0, 0, 37)
    ids = h.inner_scheduler.blocks_by_req["c1"][0]
    if tail_zero_on_arrival:
        for layer in LAYERS:
            h.caches.views[layer][ids[2], :, 5:, :] = 0
    h.step()
    h.tail_state = [slot_state(h.caches.views[layer], ids[2]) for layer in LAYERS]
    h.finish()
    return h


@pytest.fixture(scope="module")
def sent() -> dict[str, Any]:
    """A real producer's params for a 37-token prompt (the entry added in place)."""
    return prefill_leg(producer(), "p1", 37)


@pytest.fixture(scope="module")
def signed() -> dict[str, Any]:
    """The same from a producer holding the shared key."""
    mp = pytest.MonkeyPatch()
    mp.setenv(KEY_ENV, "a shared secret")
    try:
        return prefill_leg(producer(entry_key_env=KEY_ENV), "p1", 37)
    finally:
        mp.undo()


ZEROED = [["loaded"] * 5 + ["zero"] * 11] * 2
LEFT = [["loaded"] * 5 + ["stale"] * 11] * 2


def test_by_default_a_valid_claim_is_checked_and_counted_but_the_tail_is_zeroed(sent):
    h = _consume(routed(sent))
    assert h.tail_state == ZEROED
    assert h.vouched() == [False]
    assert h.stats["vouches_unused"] == 1 and h.stats["vouches_declined"] == 0
    assert h.stats["tails_zeroed"] == 1 and h.stats["vouched_tails"] == 0


def test_by_default_the_binding_is_not_computed_where_no_claim_can_be_used(sent, monkeypatch):
    # Under auto an async load's claim is only counted: its binding, a walk of
    # every block id in the params (milliseconds for a long prompt), and a MAC
    # are not computed. With trust they are (the claim can skip a zeroing).
    calls: list[int] = []
    original = trust.binding

    def counting(params: Any, max_nodes: int) -> Any:
        calls.append(1)
        return original(params, max_nodes)

    monkeypatch.setattr(trust, "binding", counting)
    copied = {**routed(sent), "remote_request_id": "another-request"}
    h = _consume(copied)
    assert calls == [] and h.tail_state == ZEROED
    assert h.stats["vouches_unused"] == 1 and h.stats["vouches_declined"] == 0
    h = _consume(copied, vouch_tails="trust")
    assert calls == [1] and h.tail_state == ZEROED
    assert h.stats["vouches_declined"] == 1 and h.stats["vouches_unused"] == 0


def test_with_trust_a_vouched_tail_is_not_zeroed_and_is_counted(sent):
    h = _consume(routed(sent), vouch_tails="trust")
    assert h.tail_state == LEFT  # left as it arrived
    assert h.vouched() == [True]
    assert h.stats["vouched_tails"] == 1 and h.stats["tails_zeroed"] == 0
    assert h.stats["vouches_unused"] == 0
    view = h.caches.views[LAYERS[0]]
    assert h.stats["vouched_tail_bytes"] == 11 * len(LAYERS) * slot_bytes(view)
    assert h.stats["tail_bytes_zeroed"] == 0


def _edited(kvtail: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(kvtail)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize(
    ("path", "value", "declined"),
    [
        (None, None, 0),  # no entry: nothing to decline
        (("n",), 36, 1),  # another length
        (("geom", "bs"), [32], 1),  # another block size
        (("geom", "dcp"), 2, 1),
        (("geom", "sig"), "0" * 16, 1),  # other specs
        (("v",), 3, 1),  # unknown version
        (("v",), 1, 1),  # a 0.1.0 producer's entry
        (("pv",), "0.1.0", 1),  # a known-wrong producer version
        (("tail",), "maybe", 1),  # no claim
        (("geom",), "16", 1),  # malformed
        (("bind",), "0" * 32, 1),  # bound to another transfer
        (("bind",), None, 1),  # unbound
        (("n",), 2**63, 1),  # out of the model
    ],
    ids=[
        "absent",
        "length",
        "block-size",
        "dcp",
        "signature",
        "version",
        "v1",
        "known-wrong",
        "no-claim",
        "malformed",
        "other-binding",
        "unbound",
        "huge-n",
    ],
)
def test_everything_but_a_bound_matching_claim_is_zeroed_even_with_trust(
    sent, path, value, declined
):
    if path is None:
        params = None
    elif value is None:
        params = routed(sent, {k: v for k, v in sent[entry.KEY].items() if k != path[-1]})
    else:
        params = routed(sent, _edited(sent[entry.KEY], path, value))
    h = _consume(params, vouch_tails="trust")
    assert h.tail_state == ZEROED
    assert h.stats["tails_zeroed"] == 1 and h.stats["vouched_tails"] == 0
    assert h.stats["vouches_declined"] == declined and h.stats["vouches_unused"] == 0


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("remote_request_id", "another-request"),
        ("remote_engine_id", "another-engine"),
        ("remote_block_ids", [[7, 8, 9]]),
    ],
)
def test_an_entry_copied_to_another_transfers_params_is_declined(sent, key, value):
    copied = {**routed(sent), key: value}
    h = _consume(copied, vouch_tails="trust")
    assert h.tail_state == ZEROED
    assert h.stats["vouches_declined"] == 1 and h.stats["vouched_tails"] == 0


def test_unknown_keys_in_the_entry_are_ignored(sent):
    h = _consume(routed(sent, {**sent[entry.KEY], "extra": 1}), vouch_tails="trust")
    assert h.stats["vouched_tails"] == 1 and h.stats["vouches_declined"] == 0


def test_the_producer_signs_its_entry_with_the_shared_key(signed):
    found = entry.read(signed).entry
    assert found is not None and found.mac is not None and len(found.mac) == 64
    assert trust.verifies(b"a shared secret", signed[entry.KEY])
    assert not trust.verifies(b"another secret", signed[entry.KEY])


def _with_key(monkeypatch: pytest.MonkeyPatch, params: dict[str, Any] | None) -> Harness:
    monkeypatch.setenv(KEY_ENV, "a shared secret")
    return _consume(params, vouch_tails="trust", entry_key_env=KEY_ENV)


def test_with_a_key_a_signed_claim_is_trusted(signed, monkeypatch):
    h = _with_key(monkeypatch, routed(signed))
    assert h.tail_state == LEFT
    assert h.stats["vouched_tails"] == 1 and h.stats["vouches_declined"] == 0


@pytest.mark.parametrize("change", ["unsigned", "tampered-n", "tampered-mac", "other-key"])
def test_with_a_key_an_unsigned_or_tampered_claim_is_declined(sent, signed, monkeypatch, change):
    if change == "unsigned":
        params = routed(sent)
    elif change == "tampered-n":
        # A longer claim with the MAC kept (and D's load made as long as it).
        params = routed(signed, {**signed[entry.KEY], "n": 36})
    elif change == "tampered-mac":
        mac = signed[entry.KEY]["mac"]
        flipped = ("0" if mac[0] != "0" else "1") + mac[1:]
        params = routed(signed, {**signed[entry.KEY], "mac": flipped})
    else:
        wire = {k: v for k, v in signed[entry.KEY].items() if k != "mac"}
        wire["mac"] = trust.sign(b"another secret", wire)
        params = routed(signed, wire)
    h = _with_key(monkeypatch, params)
    assert h.tail_state == ZEROED
    assert h.stats["vouches_declined"] == 1 and h.stats["vouched_tails"] == 0


def test_a_named_but_unset_key_variable_is_refused_at_start_up(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(
        ValueError,
        match=f"entry_key_env: names the environment variable {KEY_ENV}",
    ):
        Harness("always", entry_key_env=KEY_ENV)
    monkeypatch.setenv(KEY_ENV, "")
    with pytest.raises(ValueError, match="which is empty"):
        Harness("always", entry_key_env=KEY_ENV)


def test_the_probe_catches_a_false_claim_and_zeroes_it(sent, caplog):
    h = _consume(routed(sent), probe=True, vouch_tails="trust")  # the tail arrived stale
    assert h.tail_state == ZEROED
    assert h.stats["false_vouches"] == 1
    assert (h.stats["tails_zeroed"], h.stats["probed_tails"], h.stats["vouched_tails"]) == (1, 1, 0)
    assert "vouched for a zero tail" in caplog.text
    honest = _consume(routed(sent), probe=True, tail_zero_on_arrival=True, vouch_tails="trust")
    assert honest.stats["false_vouches"] == 0 and honest.stats["tail_bytes_zeroed"] == 0
    assert (honest.stats["vouched_tails"], honest.stats["tails_zeroed"]) == (1, 0)
    assert honest.tail_state == ZEROED


def test_by_default_a_stale_tail_under_a_claim_is_zeroed_not_trusted(sent):
    # What the default buys: a producer whose tail changed after its claim
    # (a producer bug, a block freed by P's timeout) cannot leave D stale.
    h = _consume(routed(sent), probe=True)
    assert h.tail_state == ZEROED
    assert h.stats["stale_nonfinite_values"] > 0 and h.stats["false_vouches"] == 0
    assert h.stats["vouches_unused"] == 1


def test_vouch_tails_off_on_the_consumer_checks_nothing(sent):
    h = _consume(routed(sent), vouch_tails="off")
    assert h.vouched() == [False]
    assert h.stats["tails_zeroed"] == 1 and h.stats["vouched_tails"] == 0
    assert h.stats["vouches_unused"] == 0 and h.stats["vouches_declined"] == 0


def test_a_block_aligned_load_has_no_tail_to_count_a_claim_for():
    # vouches_unused, like vouched_tails, counts tails: a block-aligned load has
    # none (its record exists only to zero a failed load's blocks).
    params = prefill_leg(producer(), "p1", 48)
    h = Harness("always")
    h.add("c1", 48, double_load_tokens=48, **routed(params))
    h.step()
    h.land("c1", 0, 0, 48)
    h.finish()
    assert len(h.records()) == 1  # recorded (zero_failed_loads), nothing to zero
    assert h.stats["vouches_unused"] == 0 and h.stats["vouches_declined"] == 0
    assert h.stats["tails_zeroed"] == 0 and h.stats["vouched_tails"] == 0
