"""``resolve_policy``: every rule of what the wrapper does, without vLLM."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from kvtail_connector.config import KVTailConfig
from kvtail_connector.core.policy import resolve_policy

FACTS = (
    "needs_zeroing",
    "has_mamba",
    "is_consumer",
    "sync_read",
    "writes_past_the_fence",
    "reads_may_land_per_layer",
)


def _policy(zero_tails: str = "auto", probe: bool = False, **facts: bool):
    cfg = KVTailConfig(backend="NixlConnector", zero_tails=zero_tails, probe_stale_tails=probe)
    args = dict.fromkeys(FACTS, False)
    args.update(facts)
    return resolve_policy(cfg, **args)


def _every_case():
    for zero_tails in ("auto", "always", "off"):
        for values in itertools.product((False, True), repeat=len(FACTS)):
            yield zero_tails, dict(zip(FACTS, values, strict=True))


@pytest.mark.parametrize(
    ("zero_tails", "needs_zeroing", "expected"),
    [
        ("auto", True, True),
        ("auto", False, False),
        ("always", False, True),
        ("always", True, True),
        ("off", True, False),
        ("off", False, False),
    ],
)
def test_async_load_tails_follow_zero_tails_and_vllms_own_gate(zero_tails, needs_zeroing, expected):
    assert _policy(zero_tails, needs_zeroing=needs_zeroing).zeroes_tails is expected


def test_failed_loads_are_zeroed_only_where_vllm_does_not_rezero_them():
    assert _policy("always", needs_zeroing=False).zeroes_failed_loads
    assert not _policy("always", needs_zeroing=True).zeroes_failed_loads  # vLLM re-zeroes
    assert not _policy("auto", needs_zeroing=True).zeroes_failed_loads
    for zero_tails, facts in _every_case():
        p = _policy(zero_tails, **facts)
        assert p.records_every_load == p.zeroes_failed_loads  # block-aligned loads too


def test_no_setting_leaves_a_read_tail_neither_vllm_nor_the_wrapper_zeroes():
    # A READ destination kept from vLLM's zeroing (by the wrapper's exclusion,
    # or by vLLM's own filter on Mamba hybrids) must get its tail zeroed by the
    # wrapper on a consumer, whatever zero_tails says.
    for zero_tails, facts in _every_case():
        p = _policy(zero_tails, **facts)
        kept_from_vllm = facts["sync_read"] and facts["needs_zeroing"]
        if kept_from_vllm and facts["is_consumer"]:
            assert p.zeroes_read_tails, (zero_tails, facts)
        if not (facts["sync_read"] and facts["is_consumer"]):
            assert not p.zeroes_read_tails  # nothing is READ into this engine


def test_read_exclusion_only_for_sync_reads_on_zeroing_models_vllm_does_not_filter():
    assert _policy("off", sync_read=True, needs_zeroing=True).excludes_reads
    assert not _policy(sync_read=True, needs_zeroing=True, has_mamba=True).excludes_reads
    assert not _policy("always", sync_read=True, needs_zeroing=False).excludes_reads
    assert not _policy(needs_zeroing=True).excludes_reads


def test_a_producer_never_maps_caches_for_read_tails():
    p = _policy("off", sync_read=True, needs_zeroing=True, is_consumer=False)
    assert not p.zeroes_read_tails and not p.needs_caches


def test_per_layer_read_tails_only_where_reads_are_zeroed_and_land_per_layer():
    on = dict(sync_read=True, needs_zeroing=True, is_consumer=True)
    assert _policy(**on, reads_may_land_per_layer=True).zeroes_reads_by_layer
    assert not _policy(**on, reads_may_land_per_layer=False).zeroes_reads_by_layer
    assert not _policy(sync_read=True, reads_may_land_per_layer=True).zeroes_reads_by_layer


def test_completions_are_held_only_for_transfers_that_bypass_the_fence():
    for zero_tails, facts in _every_case():
        assert _policy(zero_tails, **facts).holds_completions is facts["writes_past_the_fence"]


def test_the_probe_is_the_users_setting_and_the_policy_is_frozen():
    p = _policy(probe=True)
    assert p.probes
    with pytest.raises(AttributeError):
        p.zeroes_tails = True  # type: ignore[misc]


def _claims(vouch: str = "auto", zero_tails: str = "always", **facts):
    cfg = KVTailConfig(
        backend="NixlConnector", zero_tails=zero_tails, vouch_tails=vouch, verify_kv="off"
    )
    args = dict.fromkeys(FACTS, False)
    args.update(is_producer=False, carries_producer_tail=True, producer_hook="wait_for_save")
    args.update(facts)
    return resolve_policy(cfg, **args)


def test_a_producer_vouches_only_where_its_transfer_carries_the_zeroed_tail():
    p = _claims("trust", is_producer=True)
    assert p.vouches_for_tails and p.producer_hook == "wait_for_save" and p.needs_caches
    assert not _claims("trust", is_producer=True, carries_producer_tail=False).vouches_for_tails
    drafter = _claims("trust", is_producer=True, producer_hook=None)  # no ordered hook
    assert not drafter.vouches_for_tails and drafter.producer_hook is None
    assert not _claims("trust", is_producer=False).vouches_for_tails
    assert not _claims("off", is_producer=True).vouches_for_tails


def test_by_default_a_producer_vouches_only_where_a_consumer_skips_on_the_claim():
    # auto: an auto consumer zeroes every async load's tail anyway (NIXL, Mooncake):
    # the producer's zeroing would buy nothing, so it makes no claim...
    assert not _claims(is_producer=True).vouches_for_tails
    assert not _claims(is_producer=True, needs_zeroing=True, sync_read=True).vouches_for_tails
    # A vLLM that lands READs per layer, but no READ: NIXL's transfer.
    assert not _claims(is_producer=True, reads_may_land_per_layer=True).vouches_for_tails
    # kv_both over NIXL: neither vouches nor trusts by default.
    both = _claims(is_producer=True, is_consumer=True, needs_zeroing=True)
    assert not (both.vouches_for_tails or both.trusts_some_claim) and both.checks_claims
    # ...but where READ tails are zeroed layer by layer (vLLM 0.32), it does.
    per_layer = _claims(
        is_producer=True, needs_zeroing=True, sync_read=True, reads_may_land_per_layer=True
    )
    assert per_layer.vouches_for_tails and per_layer.producer_hook == "wait_for_save"
    # There the consumer zeroes READ tails whatever zero_tails says: so P vouches.
    read_off = _claims(
        zero_tails="off",
        is_producer=True,
        needs_zeroing=True,
        sync_read=True,
        reads_may_land_per_layer=True,
    )
    assert read_off.vouches_for_tails
    # Where it vouches it is what a consumer with the same settings trusts.
    consumer = _claims(reads_may_land_per_layer=True, **READ)
    assert consumer.trusts_read_claims


def test_a_producer_vouches_where_its_consumer_would_zero():
    # Tails matter where zero_tails zeroes, or where READ tails are zeroed anyway.
    assert not _claims("trust", zero_tails="auto", is_producer=True).vouches_for_tails  # none
    assert _claims(
        "trust", zero_tails="auto", is_producer=True, needs_zeroing=True
    ).vouches_for_tails
    off = _claims("trust", zero_tails="off", is_producer=True, needs_zeroing=True)
    assert not off.vouches_for_tails and not off.needs_caches
    read = _claims("trust", zero_tails="off", is_producer=True, needs_zeroing=True, sync_read=True)
    assert read.vouches_for_tails and read.needs_caches


def test_a_consumer_checks_claims_only_over_a_transfer_that_carries_them():
    for vouch in ("auto", "trust"):
        assert _claims(vouch, is_consumer=True).checks_claims
        assert not _claims(vouch, is_consumer=True, carries_producer_tail=False).checks_claims
        assert not _claims(vouch, is_consumer=False).checks_claims
    off = _claims("off", is_consumer=True)
    assert not (off.checks_claims or off.trusts_some_claim)
    both = _claims("trust", is_consumer=True, is_producer=True)  # kv_both
    assert both.trusts_load_claims and both.vouches_for_tails


READ = {"sync_read": True, "needs_zeroing": True, "is_consumer": True}


def test_by_default_claims_skip_work_only_on_per_layer_read_tails():
    # auto: an async load's tail is always zeroed by the consumer itself...
    assert not _claims(is_consumer=True).trusts_some_claim
    # ...a READ tail zeroed per layer (vLLM 0.32) is skipped on a bound claim,
    per_layer = _claims(reads_may_land_per_layer=True, **READ)
    assert per_layer.zeroes_reads_by_layer and per_layer.trusts_read_claims
    assert not per_layer.trusts_load_claims
    # ...and a READ tail zeroed once per step (0.33) is not.
    at_start = _claims(**READ)
    assert at_start.checks_claims and not at_start.trusts_some_claim
    # trust: every path; off: none.
    assert _claims("trust", **READ).trusts_read_claims
    assert _claims("trust", is_consumer=True).trusts_load_claims
    assert not _claims("off", reads_may_land_per_layer=True, **READ).trusts_some_claim


def _verify(verify: str = "digest", **facts):
    cfg = KVTailConfig(backend="NixlConnector", zero_tails="auto", verify_kv=verify)
    args = dict.fromkeys(FACTS, False)
    args.update(is_producer=False, carries_producer_tail=True, producer_hook="wait_for_save")
    args.update(facts)
    return resolve_policy(cfg, **args)


def test_verify_kv_digests_on_producers_and_verifies_on_consumers():
    p = _verify(is_producer=True)
    assert p.digests_prompts and not p.verifies_loads and p.needs_caches
    assert (
        p.producer_hook == "wait_for_save" and not p.vouches_for_tails
    )  # the model needs no zeroing
    d = _verify(is_consumer=True)
    assert d.verifies_loads and not d.digests_prompts and d.needs_caches
    both = _verify(is_producer=True, is_consumer=True)
    assert both.digests_prompts and both.verifies_loads
    off = _verify("off", is_producer=True, is_consumer=True)
    assert not (off.digests_prompts or off.verifies_loads or off.needs_caches)
    assert off.producer_hook is None


@pytest.mark.parametrize(
    ("facts", "why"),
    [
        ({"is_consumer": True, "carries_producer_tail": False}, "store backends"),
        ({"is_producer": True, "carries_producer_tail": False}, "store backends"),
        ({"is_consumer": True, "sync_read": True}, "MoRIIO READ"),
        ({"is_consumer": True, "dcp_world_size": 2}, "decode context parallelism"),
        ({"is_producer": True, "pipeline_parallel_size": 2}, "pipeline parallelism"),
        ({"is_producer": True, "producer_hook": None}, "drafter"),
        ({"is_producer": True, "prefill_context_parallel_size": 2}, "prefill context parallel"),
    ],
    ids=["store-consumer", "store-producer", "sync-read", "dcp", "pp", "drafter", "pcp"],
)
def test_verify_kv_is_refused_at_start_up_where_it_cannot_work(facts, why):
    with pytest.raises(ValueError, match="kv_connector_extra_config.verify_kv") as e:
        _verify(**facts)
    assert why in str(e.value) and '"off"' in str(e.value) and '"auto"' in str(e.value)
    _verify("off", **facts)  # off: never refused
    # auto: off on this engine, never refused; the start-up line says why.
    auto = _verify("auto", **facts)
    assert not (auto.digests_prompts or auto.verifies_loads)
    assert auto.verify_kv_off is not None and why in auto.verify_kv_off


def test_verify_kv_samples_one_in_32_by_default_where_the_digest_works():
    cfg = KVTailConfig(backend="NixlConnector")
    assert (cfg.verify_kv, cfg.verify_kv_every) == ("sample", 32)
    args = dict.fromkeys(FACTS, False)
    args.update(carries_producer_tail=True, producer_hook="wait_for_save")
    p = resolve_policy(cfg, **{**args, "is_producer": True})
    d = resolve_policy(cfg, **{**args, "is_consumer": True})
    assert p.digests_prompts and p.digest_every == 32 and p.verify_kv_off is None
    assert d.verifies_loads and d.verify_kv_off is None
    # Off, with the reason for the start-up line, where it cannot work.
    store = resolve_policy(cfg, **{**args, "is_consumer": True, "carries_producer_tail": False})
    assert not (store.digests_prompts or store.verifies_loads)
    assert "per-request producer parameters" in store.verify_kv_off


def test_verify_kv_auto_is_digest_wherever_digest_works():
    for facts in (
        {"is_producer": True},
        {"is_consumer": True},
        {"is_producer": True, "is_consumer": True},
        {"is_producer": True, "is_consumer": True, "producer_hook": None},
    ):
        auto, digest = _verify("auto", **facts), _verify("digest", **facts)
        assert dataclasses.replace(auto, digest_steps_aside=False) == digest, facts
        assert auto.verify_kv_off is None and auto.digest_steps_aside
        assert not digest.digest_steps_aside


def test_a_moriio_read_producer_digests_only_when_asked_by_name():
    # No MoRIIO READ consumer can check a digest (it refuses one): by default
    # a READ producer does not digest in vain.
    for setting in ("auto", "sample"):
        p = _verify(setting, is_producer=True, sync_read=True)
        assert not p.digests_prompts and "MoRIIO READ" in p.verify_kv_off
    assert _verify("digest", is_producer=True, sync_read=True).digests_prompts


def test_verify_kv_sample_is_auto_digesting_one_in_every_n():
    cfg = dict(backend="NixlConnector", zero_tails="auto", verify_kv="sample")
    args = dict.fromkeys(FACTS, False)
    args.update(carries_producer_tail=True, producer_hook="wait_for_save")
    for facts in (
        {"is_producer": True},
        {"is_consumer": True},
        {"is_producer": True, "is_consumer": True},
        {"is_producer": True, "carries_producer_tail": False},  # refused by digest: off here
        {"is_consumer": True, "dcp_world_size": 2},
    ):
        for every in (1, 7, 32):
            sample = resolve_policy(KVTailConfig(**cfg, verify_kv_every=every), **{**args, **facts})
            auto = _verify("auto", **facts)
            assert dataclasses.replace(sample, digest_every=1) == auto, facts
            assert sample.digest_every == every
    # The other settings digest every request, whatever verify_kv_every says.
    for setting in ("auto", "digest"):
        policy = resolve_policy(
            KVTailConfig(**{**cfg, "verify_kv": setting}, verify_kv_every=7),
            **{**args, "is_producer": True},
        )
        assert policy.digest_every == 1


def test_a_kv_both_engine_with_a_drafter_verifies_what_it_loads_and_digests_nothing():
    # vLLM's NIXL examples run decode engines as kv_both; decode engines run MTP/EAGLE.
    both = _verify(is_producer=True, is_consumer=True, producer_hook=None)
    assert both.verifies_loads and not both.digests_prompts


def test_a_consumer_with_prefill_context_parallelism_still_verifies():
    # PCP alone replicates the KV cache: each rank checks its own copy.
    assert _verify(is_consumer=True, prefill_context_parallel_size=2).verifies_loads
    # kv_both: verifies what it loads, digests nothing it sends (as with a drafter).
    both = _verify(is_producer=True, is_consumer=True, prefill_context_parallel_size=2)
    assert both.verifies_loads and not both.digests_prompts


def test_a_producer_with_sync_reads_may_digest():
    # MoRIIO READ producers: their consumer reads P's blocks after the params.
    assert _verify(is_producer=True, sync_read=True).digests_prompts
