"""``verify_kv: digest`` on the real Scheduler (0.32 and 0.33): P sends the
digest of its prompt's KV in the ``kvtail`` entry, D checks what a load wrote
and reports a mismatch as a failed load.

P and D run the wrapper around the transport double; the "transfer" copies
P's blocks into D's (``transfer``), so D holds exactly P's bytes unless a test
changes one. Expected sums come from the plain reference
(``ops/digest/reference.py``), never from the code under test.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from kvtail_connector.extras import entry, entry_values
from kvtail_connector.extras.kv_verification import rank_digests as kv_digests_mod
from kvtail_connector.extras.kv_verification.placement import HeadPlacement
from kvtail_connector.extras.ops.digest.reference import ALGORITHM, reference_digest
from tests.helpers.lifecycle import BLOCK, Harness, routed
from tests.helpers.vllm_factories import run_step

# The worker gets its metadata both ways: pickled (TP > 1) and as built (TP 1).
pytestmark = pytest.mark.usefixtures("both_deliveries")

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
PROMPT = 37


def producer(zero_tails: str = "always", **kw: Any) -> Harness:
    return Harness(zero_tails, kv_role="kv_producer", verify_kv="digest", **kw)


def consumer(zero_tails: str = "always", **kw: Any) -> Harness:
    return Harness(zero_tails, kv_role="kv_consumer", verify_kv="digest", **kw)


def fill(h: Harness, seed: int) -> None:
    """Every layer's cache gets distinct random content (no NaN poison)."""
    g = torch.Generator().manual_seed(seed)
    for layer in LAYERS:
        view = h.caches.views[layer]
        view.copy_(torch.randn(view.shape, generator=g).to(view.dtype))


def finished(engine_outputs: dict[int, Any]) -> dict[str, Any]:
    return {
        o.request_id: o
        for outs in engine_outputs.values()
        for o in outs.outputs
        if o.finish_reason is not None
    }


def prefill(
    h: Harness, req_id: str = "p1", num_tokens: int = PROMPT, **params: Any
) -> dict[str, Any]:
    """P's prefill leg (``params``: what the client adds to its
    ``kv_transfer_params``); the params it returns (the entry added in place)."""
    h.add(req_id, num_tokens, max_tokens=1, do_remote_decode=True, **params)
    _, outputs = run_step(h.scheduler, h.worker)
    params = finished(outputs)[req_id].kv_transfer_params
    h.scheduler.schedule()
    return params


def reference(h: Harness, block_ids: list[int], start: int, end: int, segment: int) -> dict:
    caches = [h.caches.views[layer] for layer in LAYERS]
    (sums,) = reference_digest([{"caches": caches}], [[(block_ids, start, end)]], segment)[0]
    return sums


@pytest.fixture(scope="module")
def sent() -> tuple[Harness, dict[str, Any]]:
    """A producer that digested a 37-token prompt over random KV, and its params
    (``trust``: it vouches too, so a consumer has a claim beside the digest)."""
    p = producer(vouch_tails="trust")
    fill(p, seed=1)
    return p, prefill(p)


def test_the_producer_sends_the_sums_of_its_prompt_kv(sent):
    p, params = sent
    reading = entry.read(params)
    found = reading.entry
    assert reading.why == "ok" and found is not None and found.digest is not None
    dg = found.digest
    assert (dg.algorithm, dg.segment) == (ALGORITHM, 1024)
    (ids,) = params["remote_block_ids"]
    expected = reference(p, ids, 0, PROMPT, 1024)
    assert dg.sums == {0: {h: tuple(v) for h, v in expected.items()}}
    assert found.tail_zero  # vouch_tails "trust": P vouches too
    raw = params[entry.KEY]["dg"]["g"]["0"]["0"]
    assert len(raw) == 1 and len(raw[0]) == 16  # hex strings, one segment
    assert p.stats["digests_sent"] == 1 and p.stats["tails_vouched"] == 1


def test_by_default_the_producer_sends_its_digest_without_a_claim():
    # vouch_tails "auto": no claim where an auto consumer zeroes anyway (not
    # over this transport); the digest goes all the same.
    p = producer()
    fill(p, seed=3)
    params = prefill(p)
    found = entry.read(params).entry
    assert found is not None and found.digest is not None and not found.tail_zero
    assert "tail" not in params[entry.KEY]
    assert p.stats["digests_sent"] == 1 and p.stats["tails_vouched"] == 0
    assert p.worker.scheduler_state_is_empty()
    assert p.scheduler.connector.scheduler_state_is_empty()


def test_a_producer_that_does_not_zero_still_sends_its_digest():
    p = producer("off")
    fill(p, seed=2)
    params = prefill(p, num_tokens=48)  # block-aligned: three whole blocks
    found = entry.read(params).entry
    assert found is not None and not found.tail_zero and found.digest is not None
    (ids,) = params["remote_block_ids"]
    assert found.digest.sums[0] == {h: tuple(v) for h, v in reference(p, ids, 0, 48, 1024).items()}
    assert "tail" not in params[entry.KEY]
    assert p.stats["tails_vouched"] == 0 and p.stats["digests_sent"] == 1


def test_with_verify_kv_off_the_producer_sends_no_digest():
    p = Harness("always", kv_role="kv_producer", verify_kv="off", vouch_tails="trust")
    params = prefill(p)
    assert params[entry.KEY]["tail"] == "zero" and "dg" not in params[entry.KEY]
    assert p.stats["digests_sent"] == 0


def test_a_sampling_producer_digests_the_first_of_every_n_prefill_legs_by_arrival_alone():
    # verify_kv "sample": which requests are digested is P's decision alone,
    # by arrival order (one in every 4 here), whatever a request's params
    # or prompt: the same positions on two producers serving different
    # requests, the second's clients asking to be digested (a forged entry)
    # or to be left out.
    ask_in = {entry.KEY: {"v": 2, "n": 5, "dg": "please"}, "verify_kv": "digest"}
    ask_out = {"verify_kv": "off", "verify_kv_every": 1000}
    digested = []
    for lengths, steer in (
        ((37,) * 9, lambda i: {}),
        ((20, 50, 37, 64, 5, 40, 33, 17, 90), lambda i: ask_out if i % 4 == 0 else ask_in),
    ):
        p = Harness("always", kv_role="kv_producer", verify_kv="sample", verify_kv_every=4)
        fill(p, seed=4)
        sent_dg = []
        for i, n in enumerate(lengths):
            params = prefill(p, f"r{i}-{n}", n, **steer(i))
            found = entry.read(params).entry if entry.KEY in params else None
            sent_dg.append(found is not None and found.digest is not None)
        digested.append([i for i, dg in enumerate(sent_dg) if dg])
        assert p.stats["digests_sent"] == 3
        assert p.worker.scheduler_state_is_empty()
        assert p.scheduler.connector.scheduler_state_is_empty()
    assert digested == [[0, 4, 8], [0, 4, 8]]


# ------------------------------------------------------------------ consumer


def transfer(p: Harness, p_ids: list[int], d: Harness, req_id: str, num_tokens: int) -> None:
    """The transport: D's blocks of ``req_id`` get P's blocks' bytes."""
    d_ids = d.inner_scheduler.blocks_by_req[req_id][0]
    n_blocks = -(-num_tokens // BLOCK)
    for layer in LAYERS:
        for pb, db in zip(p_ids[:n_blocks], d_ids[:n_blocks], strict=True):
            d.caches.views[layer][db] = p.caches.views[layer][pb]


def consume(
    sent: tuple[Harness, dict[str, Any]],
    kvtail: Any,
    flip: tuple[int, int] | None = None,
    **kw: Any,
) -> tuple[Harness, dict[str, Any]]:
    """D loads P's 37 tokens with ``kvtail`` in its params; with ``flip``
    (layer, token) one byte of that token's received KV differs from P's.
    Returns D and the finished outputs by request."""
    p, params = sent
    d = consumer(**kw)
    load: dict[str, Any] = {"double_load_tokens": PROMPT, "double_finish_after_steps": 2}
    if kvtail is not None:
        load.update(routed(params, kvtail))
    d.add("c1", PROMPT, **load)
    outputs: dict[str, Any] = {}
    _, out = run_step(d.scheduler, d.worker)
    outputs.update(finished(out))
    (p_ids,) = params["remote_block_ids"]
    transfer(p, p_ids, d, "c1", PROMPT)
    if flip is not None:
        layer, token = flip
        d_ids = d.inner_scheduler.blocks_by_req["c1"][0]
        raw = d.caches.views[LAYERS[layer]][d_ids[token // BLOCK], 0, token % BLOCK]
        raw.view(torch.uint8)[3] ^= 0x10
    for _ in range(50):
        if not d.scheduler.has_requests():
            break
        _, out = run_step(d.scheduler, d.worker)
        outputs.update(finished(out))
    d.scheduler.schedule()
    assert d.scheduler.connector.scheduler_state_is_empty()
    assert d.worker.scheduler_state_is_empty()
    return d, outputs


def test_a_load_equal_to_what_the_producer_digested_is_verified(sent):
    d, outputs = consume(sent, sent[1][entry.KEY])
    assert d.stats["digests_verified"] == 1
    assert d.stats["digest_mismatches"] == 0 and d.stats["failed_loads"] == 0
    assert outputs["c1"].finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize("token", [0, 20, PROMPT - 1])
def test_one_flipped_byte_is_a_mismatch_and_the_request_is_recomputed(sent, token, caplog):
    d, outputs = consume(sent, sent[1][entry.KEY], flip=(1, token))
    assert d.stats["digest_mismatches"] == 1 and d.stats["digests_verified"] == 0
    assert d.stats["failed_loads"] == 1
    # One line for the request, on the scheduler side, naming the producer
    # and what differs (group, head, tokens).
    (line,) = [r for r in caplog.records if "differs from what the producer" in r.getMessage()]
    assert line.levelname == "WARNING"
    message = line.getMessage()
    engine = sent[1].get("remote_engine_id", "unknown")
    assert f"request c1: the KV loaded from producer engine {engine!r} differs" in message
    assert "KV cache group 0" in message and "tokens [0, 37)" in message
    # recompute: the request ran its prefill locally and finished normally.
    assert outputs["c1"].finish_reason == FinishReason.LENGTH


def test_with_the_fail_policy_a_mismatch_ends_the_request_with_an_error(sent):
    d, outputs = consume(sent, sent[1][entry.KEY], flip=(0, 5), kv_load_failure_policy="fail")
    assert d.stats["digest_mismatches"] == 1
    assert outputs["c1"].finish_reason == FinishReason.ERROR


def _edited_digest(kvtail: dict[str, Any], **dg: Any) -> dict[str, Any]:
    return {**kvtail, "dg": {**kvtail["dg"], **dg}}


@pytest.mark.parametrize(
    "kvtail",
    [
        None,
        "no-dg",
        {"alg": "mix64-2"},
        {"sig": "0" * 16},
        {"seg": 100},
        {"seg": 2**63},
        {"seg": 2048},
        {"g": {"0": {"0": ["xyz"]}}},
        {"g": {"0": {"0": ["0" * 16] * 40}}},
        {"g": {"0": {"0": 7}}},
        "huge-n",
        "huge-entry",
        "shorter-n",
    ],
    ids=[
        "no-entry",
        "no-digest",
        "other-algorithm",
        "other-layout",
        "bad-segment",
        # A power of two and a valid u64 that made ops/digest/plan.py raise
        # OverflowError inside get_transfer_results (the engine died): refused
        # by the model, the load completes and is zeroed.
        "seg-2**63",
        "not-the-segment-for-n",
        "malformed",
        "too-many-segments",
        "wrong-type",
        "huge-n",  # an entry's n from the network: skipped at once, never iterated over
        "huge-entry",  # megabytes of padding: refused by the size walk
        # A digest of fewer tokens than the load writes: the rest would go
        # uncompared, yet the load counted verified.
        "shorter-n",
    ],
)
def test_a_load_without_a_usable_digest_is_skipped_and_not_failed(sent, kvtail):
    good = sent[1][entry.KEY]
    if kvtail == "no-dg":
        kvtail = {k: v for k, v in good.items() if k != "dg"}
    elif kvtail == "huge-n":
        kvtail = {**good, "n": 2**62}
    elif kvtail == "shorter-n":
        kvtail = {**good, "n": good["n"] - 10}
    elif kvtail == "huge-entry":
        kvtail = {**good, "pad": ["0" * 200] * 30_000}  # 6 MB
    elif isinstance(kvtail, dict):
        kvtail = _edited_digest(good, **kvtail)
    d, outputs = consume(sent, kvtail, flip=(0, 3))  # a flip nobody can see
    # Without a digest (a plain producer, or one that did not sample this
    # request) the load counts as absent; with one it cannot use, as skipped.
    no_digest = kvtail is None or "dg" not in kvtail
    assert (d.stats["digests_absent"], d.stats["digests_skipped"]) == (
        (1, 0) if no_digest else (0, 1)
    )
    assert d.stats["digests_verified"] == 0 and d.stats["digest_mismatches"] == 0
    assert d.stats["failed_loads"] == 0
    assert outputs["c1"].finish_reason == FinishReason.LENGTH
    # The load completed and its stale tail was zeroed (by D: vouch_tails auto).
    assert d.stats["tails_zeroed"] == 1 and d.stats["tail_bytes_zeroed"] > 0
    assert d.stats["vouched_tails"] == 0
    if kvtail is not None and kvtail.get("tail") == "zero" and kvtail["n"] == good["n"]:
        if "pad" not in kvtail:
            # A malformed dg leaves the rest of the entry usable: the claim is checked.
            assert d.stats["vouches_unused"] == 1 and d.stats["vouches_declined"] == 0
        else:
            assert d.stats["vouches_declined"] == 1


def test_with_verify_kv_off_the_consumer_does_not_verify(sent):
    p, params = sent
    d = Harness("always", kv_role="kv_consumer", verify_kv="off")
    d.add("c1", PROMPT, double_load_tokens=PROMPT, **routed(params))
    run_step(d.scheduler, d.worker)
    transfer(p, params["remote_block_ids"][0], d, "c1", PROMPT)
    d.finish()
    assert all(r.expected is None for r in d.records())
    for counter in ("digests_verified", "digests_skipped", "digest_mismatches", "digests_absent"):
        assert d.stats[counter] == 0


class _LateEvent:
    """A CUDA event stand-in that fires after ``after`` queries."""

    def __init__(self, after: int) -> None:
        self.left = after
        self.synchronized = False

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0

    def synchronize(self) -> None:
        # Waiting on an event that fired already costs nothing; before, it blocks.
        self.synchronized = self.synchronized or self.left >= 0


def load_with_a_late_digest(
    sent: Any, monkeypatch: pytest.MonkeyPatch, after: int, steps: int
) -> tuple[Harness, list[_LateEvent], list[bool]]:
    """D loads ``c1`` with P's digest, whose sums reach the host ``after``
    queries after the digest launch; returns the consumer, the digests' events
    and, for each of ``steps`` steps after the transfer landed, whether ``c1``
    still waits for its remote KV."""
    events: list[_LateEvent] = []
    real = kv_digests_mod.KVDigester.digest

    def late(self: Any, requests: Any) -> Any:
        pending = real(self, requests)
        pending.event = _LateEvent(after=after)
        events.append(pending.event)
        return pending

    monkeypatch.setattr(kv_digests_mod.KVDigester, "digest", late)
    p, params = sent
    d = consumer()
    d.add(
        "c1",
        PROMPT,
        double_load_tokens=PROMPT,
        double_finish_after_steps=2,
        **routed(params),
    )
    run_step(d.scheduler, d.worker)
    transfer(p, params["remote_block_ids"][0], d, "c1", PROMPT)
    waiting = []
    for _ in range(steps):
        run_step(d.scheduler, d.worker)
        waiting.append(d.scheduler.requests["c1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS)
    return d, events, waiting


def test_the_completion_is_held_until_the_digest_is_on_the_host(sent, monkeypatch):
    d, events, waiting = load_with_a_late_digest(sent, monkeypatch, after=2, steps=4)
    # The load completes in the first of these steps; its digest reaches the
    # host at the third query, and only then does the scheduler see the load
    # (it promotes the request at its next schedule). Unheld: [True, False, ...].
    assert waiting == [True, True, True, False] and len(events) == 1
    assert not events[0].synchronized  # released by its event, never waited for
    d.finish()
    assert d.stats["digests_verified"] == 1


def test_a_digest_that_never_lands_is_waited_for_after_max_passes(sent, monkeypatch):
    d, events, _ = load_with_a_late_digest(sent, monkeypatch, after=10**6, steps=0)
    d.finish()
    assert events[0].synchronized and d.stats["digests_verified"] == 1


# ------------------------------------------------------------ ranks and wire


def rank_heads(rank: int, tp: int, total: int) -> list[int]:
    """The global KV heads vLLM gives TP rank ``rank`` of ``tp`` (replicated
    where TP exceeds the KV heads)."""
    if tp <= total:
        per = total // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // total)]


def rank_part(caches: list[Any], blocks: list[int], n: int, placement: Any = None) -> Any:
    """A producer rank's part of request ``r``'s digest: tokens ``[0, n)`` of
    ``blocks`` in group 0 (``caches``: its layers, views or region caches)."""
    from kvtail_connector.core.cache_sets import CacheSet
    from kvtail_connector.core.metadata import GroupLoad
    from kvtail_connector.extras.metadata import CheckedLoad

    sets = [CacheSet(0, 1, 1, list(caches))]
    digests = kv_digests_mod.RankDigests(sets, placement or HeadPlacement())
    record = CheckedLoad("r", 0, n, (GroupLoad(0, 0, tuple(blocks)),))
    return digests.digest_prompts([record])["r"]


def _rank_parts(full: list[torch.Tensor], tp: int, blocks: list[int], n: int) -> list[Any]:
    """Each TP rank's part of one request's digest, its heads sliced as vLLM
    shards them."""
    total = full[0].shape[1]
    parts = []
    for rank in range(tp):
        heads = rank_heads(rank, tp, total)
        local = [c[:, heads].clone() for c in full]
        placement = HeadPlacement(rank, tp, total)
        parts.append(rank_part(local, blocks, n, placement))
    return parts


@pytest.mark.parametrize("tp", [1, 2, 4, 8], ids=lambda t: f"tp{t}")
def test_the_ranks_parts_add_up_to_the_single_rank_digest_through_pickling(tp):
    import pickle

    g = torch.Generator().manual_seed(5)
    full = [torch.randn(6, 4, BLOCK, 8, generator=g) for _ in range(2)]  # 4 KV heads
    blocks, n = [4, 1, 5], 40
    parts = [pickle.loads(pickle.dumps(p)) for p in _rank_parts(full, tp, blocks, n)]
    merged = parts[0]
    for part in parts[1:]:
        merged = merged.merged(part)
    assert merged.ranks == tp
    (expected,) = reference_digest([{"caches": full}], [[(blocks, 0, n)]], 1024)[0]
    assert merged.digest().sums == {0: {h: tuple(v) for h, v in expected.items()}}


def test_parts_made_over_other_layouts_do_not_merge_into_a_digest():
    from kvtail_connector.extras.metadata import DigestPart

    a = DigestPart("mix64-1", 1024, "a" * 16, {0: {0: (1,)}})
    b = DigestPart("mix64-1", 1024, "b" * 16, {0: {1: (2,)}})
    assert a.merged(b).digest() is None
    assert a.merged(DigestPart("mix64-1", 1024, "a" * 16, {0: {1: (2,)}})).digest() is not None


def rank_verdict(caches, blocks, n, digest, num_local=0, placement=None):
    """A consumer rank's verdict on a load of tokens ``[num_local, n)`` of
    ``blocks`` in group 0 (planned at bind, compared at release), checked
    against ``digest``: a producer's ``entry_values.Digest``, or sums taken as made
    with this rank's own signature."""
    from kvtail_connector.core.cache_sets import CacheSet, cache_slots
    from kvtail_connector.core.metadata import GroupLoad
    from kvtail_connector.extras.metadata import CheckedLoad, ExpectedDigest

    digests = kv_digests_mod.RankDigests(
        [CacheSet(0, 1, 1, list(caches))], placement or HeadPlacement()
    )
    dg = digest
    if not isinstance(dg, entry_values.Digest):
        dg = entry_values.Digest(ALGORITHM, entry_values.segment_for(n), digests.signature, digest)
    first = num_local // cache_slots(caches[0])
    load = CheckedLoad(
        "r",
        num_local,
        n,
        (GroupLoad(0, first, tuple(blocks[first:])),),
        expected=ExpectedDigest(n, dg),
    )
    digests.plan_loads([load])
    digests.check_loads([load])
    digests.release()
    return digests.take_verdicts()["r"]


def test_a_head_the_producer_did_not_send_is_skipped_and_the_others_still_count():
    from kvtail_connector.extras.metadata import MISMATCH, UNVERIFIED, VERIFIED

    g = torch.Generator().manual_seed(7)
    caches = [torch.randn(6, 4, BLOCK, 8, generator=g) for _ in range(2)]
    blocks, n = [4, 1, 5], 40
    (ref,) = reference_digest([{"caches": caches}], [[(blocks, 0, n)]], 1024)[0]
    full = {0: {h: tuple(v) for h, v in ref.items()}}
    without_2 = {0: {h: v for h, v in full[0].items() if h != 2}}
    assert rank_verdict(caches, blocks, n, full) == VERIFIED
    assert rank_verdict(caches, blocks, n, without_2) == UNVERIFIED
    caches[1][blocks[1], 2, 3, 0] += 1  # in the head P did not send: not seen
    assert rank_verdict(caches, blocks, n, without_2) == UNVERIFIED
    caches[1][blocks[1], 0, 3, 0] += 1  # in one it sent: a mismatch
    assert rank_verdict(caches, blocks, n, without_2) == MISMATCH
    assert rank_verdict(caches, blocks, n, full) == MISMATCH


# ------------------------------------------------------------ the shared key


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_with_a_key_only_a_signed_digest_is_used(sent, signed, monkeypatch):
    monkeypatch.setenv("KVTAIL_TEST_KEY", "the shared key")
    if signed:
        p = producer(entry_key_env="KVTAIL_TEST_KEY")
        fill(p, seed=1)
        sent = (p, prefill(p))
        assert "mac" in sent[1][entry.KEY]
    d, outputs = consume(sent, sent[1][entry.KEY], entry_key_env="KVTAIL_TEST_KEY")
    assert d.stats["digests_verified"] == (1 if signed else 0)
    assert d.stats["digests_skipped"] == (0 if signed else 1)
    assert d.stats["failed_loads"] == 0
    assert outputs["c1"].finish_reason == FinishReason.LENGTH


def test_a_load_only_planned_leaves_the_completion_pass_idle():
    # A plan made at bind is used by the completion of its load (a pass with
    # that id in finished_recving, never the fast path) or dropped there:
    # loads in flight need no pass of their own.
    from kvtail_connector.core.cache_sets import CacheSet
    from kvtail_connector.core.metadata import GroupLoad
    from kvtail_connector.extras.kv_verification.worker import VerificationWorker
    from kvtail_connector.extras.metadata import CheckedLoad, ExpectedDigest

    g = torch.Generator().manual_seed(3)
    caches = [torch.randn(6, 2, BLOCK, 8, generator=g)]
    worker = VerificationWorker(HeadPlacement(), verifies_loads=True)
    worker.register([CacheSet(0, 1, 1, list(caches))])
    assert worker.idle
    n = 40
    digests = worker._digests
    assert digests is not None
    dg = entry_values.Digest(ALGORITHM, entry_values.segment_for(n), digests.signature, {0: {}})
    load = CheckedLoad("r", 0, n, (GroupLoad(0, 0, (4, 1, 5)),), expected=ExpectedDigest(n, dg))
    worker.bind((), (load,))
    assert worker.idle
    # Sleep mode with the load in flight: it completes while released and is
    # reported failed by the worker, with no pass that would drop its plan;
    # nothing of it comes back with the caches.
    assert digests.num_tracked == 1
    worker.release()
    worker.restore()
    assert digests.num_tracked == 0 and worker.num_tracked == 0


# A group whose layers hold fewer KV heads than the model reports (Gemma-4-style
# full-attention layers: 2 KV heads where the model's total is 8): vLLM gives a
# rank max(1, 2 // tp) of the layer's own heads.
_LAYER_HEADS, _MODEL_HEADS = 2, 8


def _group_parts(full, tp, blocks, n):
    parts = []
    for rank in range(tp):
        local = [c[:, rank_heads(rank, tp, _LAYER_HEADS)].clone() for c in full]
        placement = HeadPlacement(rank, tp, _MODEL_HEADS)
        parts.append(rank_part(local, blocks, n, placement))
    merged = parts[0]
    for part in parts[1:]:
        merged = merged.merged(part)
    return merged.digest()


def _group_case(seed):
    """Two layers of a group with the layer's own KV heads; three blocks, 40 tokens."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, _LAYER_HEADS, BLOCK, 8, generator=g) for _ in range(2)], [4, 1, 5], 40


def _group_verdicts(full, tp, blocks, n, digest):
    return [
        rank_verdict(
            [c[:, rank_heads(rank, tp, _LAYER_HEADS)].clone() for c in full],
            blocks,
            n,
            digest,
            placement=HeadPlacement(rank, tp, _MODEL_HEADS),
        )
        for rank in range(tp)
    ]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 4), (4, 1), (2, 4), (1, 2)])
def test_a_group_with_other_heads_than_the_model_is_not_compared_across_tp(p_tp, d_tp):
    from kvtail_connector.extras.metadata import UNVERIFIED

    full, blocks, n = _group_case(11)
    digest = _group_parts(full, p_tp, blocks, n)
    # Equal content: such a group is keyed by rank, so sums are not compared
    # across TP (keyed from the model's count, P TP 1 against D TP 4 was a false
    # mismatch on one D rank; some pairs happened to agree and are now skipped).
    assert _group_verdicts(full, d_tp, blocks, n, digest) == [UNVERIFIED] * d_tp


def test_a_digest_keyed_for_another_layout_is_said_once_per_rank(caplog):
    """Loads whose digest this rank cannot compare (here: a group keyed by rank,
    P at TP 1, D at TP 2) are skipped; the rank says so in one WARNING, not in
    one line per load."""
    from kvtail_connector.core.cache_sets import CacheSet, cache_slots
    from kvtail_connector.core.metadata import GroupLoad
    from kvtail_connector.extras.metadata import UNVERIFIED, CheckedLoad, ExpectedDigest

    full, blocks, n = _group_case(13)
    digest = _group_parts(full, 1, blocks, n)
    local = [c[:, rank_heads(0, 2, _LAYER_HEADS)].clone() for c in full]
    digests = kv_digests_mod.RankDigests(
        [CacheSet(0, 1, 1, local)], HeadPlacement(0, 2, _MODEL_HEADS)
    )
    assert digests.signature != digest.signature
    caplog.set_level(logging.DEBUG)
    for i in range(3):
        load = CheckedLoad(
            f"r{i}",
            0,
            n,
            (GroupLoad(0, 0, tuple(blocks[: -(-n // cache_slots(local[0]))])),),
            expected=ExpectedDigest(n, digest),
        )
        digests.plan_loads([load])
        digests.check_loads([load])
        digests.release()
        assert digests.take_verdicts()[f"r{i}"] == UNVERIFIED
    said = [r for r in caplog.records if "keyed for another layout" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 2), (4, 4), (8, 16), (16, 8)])
def test_a_group_with_other_heads_than_the_model_is_checked_where_keys_agree(p_tp, d_tp):
    from kvtail_connector.extras.metadata import MISMATCH, VERIFIED

    full, blocks, n = _group_case(12)
    digest = _group_parts(full, p_tp, blocks, n)
    assert _group_verdicts(full, d_tp, blocks, n, digest) == [VERIFIED] * d_tp
    full[1][blocks[1], 1, 3, 0] += 1  # head 1, inside the loaded range
    verdicts = _group_verdicts(full, d_tp, blocks, n, digest)
    holds_head_1 = [1 in rank_heads(r, d_tp, _LAYER_HEADS) for r in range(d_tp)]
    assert verdicts == [MISMATCH if h else VERIFIED for h in holds_head_1]


def test_the_alarm_names_a_bounded_producer_and_logs_each_request_once(caplog):
    """The mismatch line: the producer's ``remote_engine_id`` where it is a
    short string ('unknown' otherwise, whatever a client sent), what the first
    rank named, once per request however many ranks reported it."""
    from types import SimpleNamespace

    from kvtail_connector.core.metadata import KVTailWorkerMeta
    from kvtail_connector.core.stats import KVTailStats
    from kvtail_connector.extras.kv_verification.scheduler import VerificationScheduler
    from kvtail_connector.extras.metadata import MISMATCH, EntryReport

    stats = KVTailStats()
    verify = VerificationScheduler(SimpleNamespace(groups=()), stats, digests_prompts=False)
    params = {
        "a": {"remote_engine_id": "p-1"},
        "b": {"remote_engine_id": 7},
        "c": {"remote_engine_id": "x\n" * 100},
        "d": None,
    }
    for req_id, p in params.items():
        verify.expect(req_id, p)
    ranks = [
        KVTailWorkerMeta(
            inner=None,
            ranks=frozenset({r}),
            extra=EntryReport(
                verdicts=dict.fromkeys(params, MISMATCH), differs=dict.fromkeys(params, f"rank {r}")
            ),
        )
        for r in range(2)
    ]
    quiet = KVTailWorkerMeta(inner=None, ranks=frozenset({2}), extra=None)
    meta = ranks[0].aggregate(quiet).aggregate(ranks[1])
    assert meta.ranks == {0, 1, 2} and meta.extra.differs == dict.fromkeys(params, "rank 0")
    done = SimpleNamespace(finished_recving=set(params))
    verify.count_verdicts(done, meta, in_flight=set(params))
    lines = [
        r.getMessage() for r in caplog.records if "differs from what the producer" in r.getMessage()
    ]
    assert len(lines) == 4 and stats.data["digest_mismatches"] == 4
    named = {line.split(":")[1].split()[1]: line for line in lines}
    assert "engine 'p-1'" in named["a"] and "(rank 0)" in named["a"]
    assert all("engine 'unknown'" in named[r] for r in "bcd")
    assert verify.num_tracked == 0
    # A load that came with a digest no rank compared (a worker that could not
    # digest its pages) counts as skipped, not as nothing.
    verify.expect("e", {"remote_engine_id": "p-1"})
    verify.count_verdicts(SimpleNamespace(finished_recving={"e"}), None, in_flight={"e"})
    assert stats.data["digests_skipped"] == 1 and verify.num_tracked == 0
