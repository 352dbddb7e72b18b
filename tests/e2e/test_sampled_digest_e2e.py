"""``verify_kv``'s default between real vLLM CPU engines over NIXL: the alarm.

P and D are wrapped with no ``verify_kv`` setting, so P digests the first of
every 32 remote-decode requests it serves (``"sample"``). Every one of 96
transfers has a slot of P's KV changed after P computed it (and after its
digest) and before D pulls (``corrupt_slot``): a fault that hits every
transfer. The sampled requests (P's 1st, 33rd and 65th remote-decode legs,
by P's own count) are caught: counted, logged once each on D with P's engine
id and what differs, and recomputed (``kv_load_failure_policy: recompute``),
so they decode like one engine. The others carry no digest and decode the
changed KV unchecked: the sample is an alarm for systematic faults, not a
check of every request.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from demo.engine import EngineProcess, start_engines
from demo.pd import PDPair, make_prompt, wrapped_kv_config
from kvtail_connector.config import KVTailConfig
from kvtail_connector.extras import entry
from tests.e2e.support import require

pytestmark = pytest.mark.e2e

REQUESTS = 96
EVERY = KVTailConfig(backend="NixlConnector").verify_kv_every  # the default, 32
MAX_TOKENS = 4
CORRUPT = (3, 12345.0)  # token 3's slot, every layer, K and V: finite, far from real KV
ALARM = "differs from what the producer digested"


@dataclass
class Pair:
    pd: PDPair
    producer: EngineProcess
    consumer: EngineProcess


@pytest.fixture(scope="module")
def pair(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    require("nixl._api")
    logs = tmp_path_factory.mktemp("sampled-digest")
    producer = wrapped_kv_config("nixl", "producer", "always")
    consumer = wrapped_kv_config("nixl", "consumer", "always")
    consumer["kv_load_failure_policy"] = "recompute"
    for cfg in (producer, consumer):
        assert "verify_kv" not in cfg["kv_connector_extra_config"]
    pd = PDPair(model, "nixl", producer, consumer, log_dir=logs, name="s")
    started: list[EngineProcess] = []
    try:
        started = start_engines(list(pd.engine_configs()), logs)
        p, d = started
        pd.attach(p, d)
        yield Pair(pd, p, d)
    finally:
        for e in started:
            e.close()


def test_every_transfer_corrupted_the_default_sample_catches_and_recomputes(pair: Pair) -> None:
    pd = pair.pd
    assert pd.prefill is not None
    prompts = [make_prompt(40 + i % 24, seed=1000 + i) for i in range(REQUESTS)]
    # P alone, no transfer (not a remote-decode leg: not counted by the sample).
    refs = [o.token_ids for o in pd.prefill.generate(prompts, MAX_TOKENS)]
    sent_before = int(pd.prefill.kvtail_counters().get("digests_sent", 0))
    caught, engines = [], set()
    for i, prompt in enumerate(prompts):
        r = pd.run(prompt, MAX_TOKENS, corrupt_slot=CORRUPT)
        assert r.poisoned_slots > 0, i
        k = r.kvtail
        found = entry.read(r.prefill.kv_transfer_params).entry
        if k.get("digest_mismatches", 0):
            assert found is not None and found.digest is not None, i
            assert k.get("failed_loads", 0) == 1, (i, k)
            # Recomputed: D prefilled the prompt itself and decoded like P alone.
            assert r.decode.token_ids == refs[i], i
            caught.append(i)
            engines.add(r.prefill.kv_transfer_params["remote_engine_id"])
        else:
            assert found is None or found.digest is None, i
            assert k.get("failed_loads", 0) == 0, (i, k)
        assert k.get("digests_verified", 0) == 0, (i, k)
    # P decided the sample by its own arrival count: the first of every EVERY.
    sent = int(pd.prefill.kvtail_counters().get("digests_sent", 0)) - sent_before
    assert caught == list(range(0, REQUESTS, EVERY)) and sent == len(caught)
    # The alarm: one WARNING per caught request on D, naming P's engine and
    # what differs.
    lines = [line for line in pair.consumer.log_path.read_text().splitlines() if ALARM in line]
    assert len(lines) == len(caught), lines
    (engine,) = engines
    assert all("WARNING" in line and repr(engine) in line for line in lines), lines
    assert all("KV cache group 0" in line and "tokens [" in line for line in lines), lines
