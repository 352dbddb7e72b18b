"""``verify_kv: digest`` between real vLLM CPU engines over NIXL.

One producer (P) digests every remote-decode prompt; two consumers load from
it: D verifies (``kv_load_failure_policy: recompute``), D0 does not (verify_kv
off). A clean run verifies every request and decodes like one engine. A slot
of P's KV changed after P's digest and before the pull (``corrupt_slot``) is
what a torn or misrouted transfer hands D: D detects it, recomputes, and still
decodes like one engine; D0 decodes the corrupted KV into other tokens, so the
detection test can fail.

The engines are shared by the class and stopped when it is done.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from demo.engine import EngineProcess, start_engines
from demo.pd import PDPair, make_prompt, wrapped_kv_config
from kvtail_connector.extras import entry
from tests.e2e.support import require

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
PROMPTS = (make_prompt(45, seed=31), make_prompt(77, seed=32), make_prompt(64, seed=33))
CORRUPT = (3, 12345.0)  # token 3's slot, every layer, K and V: finite, far from real KV


@dataclass
class Engines:
    verifying: PDPair  # P -> D (verify_kv digest, recompute on failure)
    control: PDPair  # P -> D0 (verify_kv off)
    refs: dict[int, list[int]]  # prompt length -> P's own greedy output, no transfer


def _consumer(verify: str) -> dict:
    cfg = wrapped_kv_config("nixl", "consumer", "always", verify_kv=verify)
    cfg["kv_load_failure_policy"] = "recompute"
    return cfg


@pytest.fixture(scope="class")
def engines(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    require("nixl._api")
    logs = tmp_path_factory.mktemp("verify-kv")
    producer = wrapped_kv_config("nixl", "producer", "always", verify_kv="digest")
    verifying = PDPair(model, "nixl", producer, _consumer("digest"), log_dir=logs, name="v")
    control = PDPair(model, "nixl", producer, _consumer("off"), log_dir=logs, name="c")
    p_cfg, d_cfg = verifying.engine_configs()
    _, d0_cfg = control.engine_configs()
    started: list[EngineProcess] = []
    try:
        started = start_engines([p_cfg, d_cfg, d0_cfg], logs)
        p, d, d0 = started
        verifying.attach(p, d)
        control.attach(p, d0)
        outs = p.generate(list(PROMPTS), MAX_TOKENS)
        refs = {len(q): o.token_ids for q, o in zip(PROMPTS, outs, strict=True)}
        yield Engines(verifying, control, refs)
    finally:
        for e in started:
            e.close()


def _counter(counters: dict[str, int], name: str) -> int:
    return int(counters.get(name, 0))


class TestVerifyKV:
    def test_a_clean_run_verifies_every_request(self, engines: Engines) -> None:
        pd = engines.verifying
        assert pd.prefill is not None
        sent_before = _counter(pd.prefill.kvtail_counters(), "digests_sent")
        verified = 0
        for prompt in PROMPTS:
            r = pd.run(prompt, MAX_TOKENS)
            found = entry.read(r.prefill.kv_transfer_params).entry
            assert found is not None and found.digest is not None
            assert r.decode.token_ids == engines.refs[len(prompt)], len(prompt)
            k = r.kvtail
            assert _counter(k, "digest_mismatches") == 0 and _counter(k, "failed_loads") == 0, k
            verified += _counter(k, "digests_verified")
        assert verified == len(PROMPTS)
        sent = _counter(pd.prefill.kvtail_counters(), "digests_sent") - sent_before
        assert sent == len(PROMPTS)

    def test_kv_changed_after_the_digest_is_detected_and_recomputed(self, engines: Engines) -> None:
        prompt = PROMPTS[0]
        r = engines.verifying.run(prompt, MAX_TOKENS, corrupt_slot=CORRUPT)
        assert r.poisoned_slots > 0
        k = r.kvtail
        assert _counter(k, "digest_mismatches") == 1, k
        assert _counter(k, "failed_loads") == 1 and _counter(k, "digests_verified") == 0, k
        # recompute: D prefilled the prompt itself and decoded like one engine.
        assert r.decode.token_ids == engines.refs[len(prompt)]

    def test_without_verify_kv_the_same_change_decodes_wrong(self, engines: Engines) -> None:
        prompt = PROMPTS[0]
        r = engines.control.run(prompt, MAX_TOKENS, corrupt_slot=CORRUPT)
        assert r.poisoned_slots > 0
        k = r.kvtail
        assert _counter(k, "digests_verified") + _counter(k, "digest_mismatches") == 0, k
        assert _counter(k, "failed_loads") == 0, k
        assert r.decode.token_ids != engines.refs[len(prompt)]
