"""The transfer-integrity alarm (``verify_kv``'s default) through API servers.

The wrapped pair runs with no ``verify_kv`` setting: P digests the first of
every ``verify_kv_every`` remote-decode requests it serves (32 by default).
Clients send 96 requests through ``vllm-router``; a tap between the router and
P changes one written slot of P's KV (prompt token 3, every layer, K and V)
after each prefill leg and before the router sends the decode leg: after P
computed its KV and its digest, a fault that hits every transfer. D (policy
``recompute``) must catch exactly the requests P digested, count and log each
once with P's engine id and what differs, and answer them like one engine.
The others carry no digest and decode the changed KV unchecked: the sample is
an alarm for systematic faults, not a check of every request.

The changed slots stay in P's freed blocks; a later prefill of those blocks
writes them again (prefix caching is reset afterwards, where it is on).
"""

from __future__ import annotations

import os

import pytest

from demo.faults import CorruptSlot
from demo.prefill_tap import PrefillTap
from demo.router import Router
from demo.workload import openai_client, send
from kvtail_connector.config import KVTailConfig
from kvtail_connector.extras import entry
from tests.serve.conftest import Servers
from tests.serve.support import (
    MAX_TOKENS,
    block_size,
    kvtail,
    references,
    served_prompts,
    wait_counts,
    wait_idle,
    wait_until,
)

pytestmark = pytest.mark.serve

REQUESTS = 96
TOKEN, VALUE = 3, 12345.0  # finite, far from any real KV
ALARM = "differs from what the producer digested"


def _every() -> int:
    """P's sampling period: the soak's override (conftest) or the default."""
    every = os.environ.get("KVTAIL_SOAK_VERIFY_EVERY")
    period = int(every) if every else KVTailConfig(backend="NixlConnector").verify_kv_every
    if period > REQUESTS:
        pytest.skip(f"P samples one in {period} requests: {REQUESTS} may hold none")
    return period


def _alarms(log: str) -> list[str]:
    return [line for line in log.splitlines() if ALARM in line]


def test_every_transfer_corrupted_the_default_sample_raises_the_alarm(servers: Servers) -> None:
    every = _every()
    pair = servers.wrapped
    p, d = pair.prefill, pair.decodes["recompute"]
    bs = block_size(d)
    ref = servers.reference

    prompts = served_prompts(ref, REQUESTS, bs, seed=38, low=TOKEN + 5, high=120)
    refs = references(ref, prompts)
    alarms_before = len(_alarms(d.log_text()))
    d_before, p_before = kvtail(d), kvtail(p)

    hook = CorruptSlot(p, bs, TOKEN, VALUE)
    answers = []
    with (
        PrefillTap(p.url) as tap,
        Router(f"{pair.name}-alarm", [tap.url], [d.url], servers.fleet.log_dir) as router,
    ):
        tap.after_prefill = hook
        client = openai_client(router.url)
        try:
            # One at a time: P's arrival order is the order sent.
            answers = [send(client, prompt, MAX_TOKENS) for prompt in prompts]
        finally:
            if "--enable-prefix-caching" in p.spec.args:
                # The changed slots must not be served from P's cache later;
                # vLLM refuses the reset while a block is held.
                wait_idle(p)
                wait_until(
                    lambda: p.post("/reset_prefix_cache", {})["success"], 60, "P's cache reset"
                )

    assert len(hook.answers) == REQUESTS and all(hook.planted), hook.planted
    # Which requests P digested, as P sent them (the decision is P's alone).
    digested = [
        i
        for i, answer in enumerate(hook.answers)
        if (found := entry.read(answer["kv_transfer_params"]).entry) is not None
        and found.digest is not None
    ]
    # P's count goes on from earlier tests on these servers: its first
    # sample here falls anywhere in the first period, then one every period.
    assert digested and digested[0] < every, digested
    assert digested == list(range(digested[0], REQUESTS, every)), digested

    # Counted: each digested load failed and was recomputed; the rest came
    # without a digest.
    caught = len(digested)
    got = wait_counts(
        d,
        d_before,
        {
            "digest_mismatches": caught,
            "failed_loads": caught,
            "digests_verified": 0,
            "digests_absent": REQUESTS - caught,
        },
    )
    assert got["held_requests"] == 0, got
    wait_counts(p, p_before, {"digests_sent": caught})
    # Recomputed: every caught request answers like one engine.
    for i in digested:
        a, r = answers[i], refs[i]
        assert a.error is None and a.token_ids == r.token_ids and a.text == r.text, (i, a, r)
    # The alarm: one WARNING per caught request, naming P's engine and what differs.
    engines = {answer["kv_transfer_params"]["remote_engine_id"] for answer in hook.answers}
    (engine,) = engines
    new = _alarms(d.log_text())[alarms_before:]
    assert len(new) == caught, new
    assert all("WARNING" in line and repr(engine) in line for line in new), new
    assert all("KV cache group 0" in line and "tokens [" in line for line in new), new
