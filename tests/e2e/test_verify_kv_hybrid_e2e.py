"""``verify_kv: digest`` on the Mamba hybrid between real vLLM CPU engines over NIXL.

The tiny Granite hybrid (one Mamba2 layer, one attention layer, float32). One
producer (P) digests every remote-decode prompt, its attention KV and its
Mamba state; two consumers load from it: D (``kv_load_failure_policy:
recompute``) and Df (``fail``). A clean run verifies every request and
decodes like one engine. A byte of P's Mamba state, or of one attention slot,
changed after P's digest and before the pull (``corrupt_state``,
``corrupt_slot``: what a torn or misrouted transfer hands D) is caught on D
and recomputed (D then decodes like one engine), and fails the request
cleanly on Df.

The engines are shared by the module and stopped when it is done.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from demo.engine import EngineProcess, start_engines
from demo.pd import PDPair, make_prompt, wrapped_kv_config
from demo.tiny_model import ensure_tiny_hybrid
from kvtail_connector.extras import entry
from tests.e2e.support import require

pytestmark = pytest.mark.e2e

MAX_TOKENS = 6
PROMPTS = (make_prompt(45, seed=41), make_prompt(70, seed=42))
SSM_STATE = (1, 12345.0)  # element 0 of the SSM state, every Mamba layer
CONV_STATE = (0, -777.0)  # element 0 of the conv state
ATTN_SLOT = (3, 12345.0)  # token 3's attention slot, K and V


@dataclass
class Engines:
    recompute: PDPair  # P -> D (recompute on a failed load)
    fail: PDPair  # P -> Df (fail on a failed load)
    refs: dict[int, list[int]]  # prompt length -> P's own greedy output


def _consumer(policy: str) -> dict:
    cfg = wrapped_kv_config("nixl", "consumer", "auto", verify_kv="digest")
    cfg["kv_load_failure_policy"] = policy
    return cfg


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    require("nixl._api")
    model = str(ensure_tiny_hybrid(kind="granite"))
    logs = tmp_path_factory.mktemp("verify-kv-hybrid")
    producer = wrapped_kv_config("nixl", "producer", "auto", verify_kv="digest")
    recompute = PDPair(model, "nixl", producer, _consumer("recompute"), log_dir=logs, name="r")
    fail = PDPair(model, "nixl", producer, _consumer("fail"), log_dir=logs, name="f")
    p_cfg, d_cfg = recompute.engine_configs()
    _, df_cfg = fail.engine_configs()
    started: list[EngineProcess] = []
    try:
        started = start_engines([p_cfg, d_cfg, df_cfg], logs)
        p, d, df = started
        recompute.attach(p, d)
        fail.attach(p, df)
        outs = p.generate(list(PROMPTS), MAX_TOKENS)
        refs = {len(q): o.token_ids for q, o in zip(PROMPTS, outs, strict=True)}
        yield Engines(recompute, fail, refs)
    finally:
        for e in started:
            e.close()


def _count(counters: dict[str, int], name: str) -> int:
    return int(counters.get(name, 0))


def test_a_clean_run_verifies_attention_and_state(engines: Engines) -> None:
    pd = engines.recompute
    for prompt in PROMPTS:
        r = pd.run(prompt, MAX_TOKENS)
        found = entry.read(r.prefill.kv_transfer_params).entry
        assert found is not None and found.digest is not None
        states = found.digest.states
        assert states is not None and states.sums, found.digest
        # The Mamba group, TP shard 0; the attention digest beside it.
        assert all(set(shards) == {0} for shards in states.sums.values())
        assert found.digest.sums
        assert r.decode.token_ids == engines.refs[len(prompt)], len(prompt)
        k = r.kvtail
        assert _count(k, "digest_mismatches") == 0 and _count(k, "failed_loads") == 0, k
        assert _count(k, "digests_verified") == 1, k


@pytest.mark.parametrize(
    "change",
    [{"corrupt_state": SSM_STATE}, {"corrupt_state": CONV_STATE}, {"corrupt_slot": ATTN_SLOT}],
    ids=["ssm-state", "conv-state", "attention-slot"],
)
def test_a_changed_byte_is_caught_and_recomputed(engines: Engines, change: dict) -> None:
    prompt = PROMPTS[0]
    r = engines.recompute.run(prompt, MAX_TOKENS, **change)
    assert r.poisoned_slots > 0
    k = r.kvtail
    assert _count(k, "digest_mismatches") == 1, k
    assert _count(k, "failed_loads") == 1 and _count(k, "digests_verified") == 0, k
    # recompute: D prefilled the prompt itself and decoded like one engine.
    assert r.decode.token_ids == engines.refs[len(prompt)]


@pytest.mark.parametrize(
    "change",
    [{"corrupt_state": SSM_STATE}, {"corrupt_slot": ATTN_SLOT}],
    ids=["ssm-state", "attention-slot"],
)
def test_a_changed_byte_fails_the_request_under_fail(engines: Engines, change: dict) -> None:
    prompt = PROMPTS[1]
    r = engines.fail.run(prompt, MAX_TOKENS, **change)
    assert r.poisoned_slots > 0
    k = r.kvtail
    assert _count(k, "digest_mismatches") == 1 and _count(k, "failed_loads") == 1, k
    assert r.decode_failed, r.decode
    # The engine still serves: the next clean run verifies.
    again = engines.fail.run(prompt, MAX_TOKENS)
    assert again.decode.token_ids == engines.refs[len(prompt)]
    assert _count(again.kvtail, "digests_verified") == 1, again.kvtail
