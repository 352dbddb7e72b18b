"""The Mamba hybrid served P/D over NIXL, ``KVTailConnector`` on both sides.

The tiny Granite hybrid (one Mamba2 layer, one attention layer, float32) in two
API servers with the wrapper around NixlConnector and default settings, with
no variable set by hand: vLLM's CPU platform picks the DS Mamba conv-state
layout NIXL needs only for a NIXL connector it sees by name, and the wrapper's
plugin sets it from the server's ``--kv-transfer-config`` (issue 23: both
servers failed at start-up). Clients go through vllm-router, with a
:class:`~demo.prefill_tap.PrefillTap` between the router and
the prefill server (the faults between the legs happen there, as in
``test_faults.py``); one fleet and one router for the module.

* Prompts ending inside an attention block and on its boundary, completions and
  chats, streamed and not, get the single-engine server's greedy answers;
  nothing non-finite is left in the decode server's cache; no load failed.
* The prefill server SIGKILLed after its answer to two streamed requests (a
  completion and a chat), before the decode server pulled: under
  ``kv_load_failure_policy: recompute`` the decode server computes the prompts
  itself and answers like one engine (for a hybrid, vLLM fails the whole load,
  ``failed_recving``: the Mamba state cannot be resumed mid-prompt), both loads
  are counted failed, the wrapper holds nothing, nothing non-finite is left.
  Then the router with its prefill server dead behaves as for the Llama pair
  (``test_faults.py``, docs/serving.md), and the restarted prefill server
  serves again: mixed prompts through the router answer like one engine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from demo.api_server import APIServer
from demo.faults import AfterPrefill
from demo.prefill_tap import PrefillTap
from demo.router import Router
from demo.serving import Fleet, ServePair
from demo.tiny_model import ensure_tiny_hybrid
from demo.workload import Prompt, openai_client, send_all
from kvtail_connector.facade.name_keyed import CONV_STATE_LAYOUT_ENV
from tests.e2e.support import require
from tests.serve.support import (
    CONCURRENCY,
    MAX_TOKENS,
    kvtail,
    mismatches,
    references,
    router_with_prefill_dead,
    served_prompts,
    wait_counts,
)

pytestmark = pytest.mark.serve


@dataclass
class Hybrid:
    reference: APIServer
    pair: ServePair
    fleet: Fleet
    tap: PrefillTap
    router: Router
    attn_block: int

    def prompts(self, count: int, seed: int) -> list[Prompt]:
        """``mixed_prompts``: completions and chats, streamed and not, mid-block
        and on the boundary of an attention block."""

        return served_prompts(self.reference, count, self.attn_block, seed=seed)

    def ensure_prefill(self) -> None:
        """The prefill server up (a test before may have killed it), the tap passing
        everything through, the router seeing both servers healthy."""
        if not self.pair.prefill.alive:
            self.pair.prefill.start().wait_ready()
        self.tap.reset(self.pair.prefill.url)
        self.router.wait_ready()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hybrid]:
    require("nixl._api")
    # The servers inherit this process's environment: nothing set by hand.
    assert CONV_STATE_LAYOUT_ENV not in os.environ
    model = str(ensure_tiny_hybrid(kind="granite"))
    fleet = Fleet(tmp_path_factory.mktemp("hybrid-nixl-logs"))
    reference = fleet.add_reference(model)
    # verify_kv at its default ("sample"); the soak may have P digest every
    # request (KVTAIL_SOAK_VERIFY_EVERY=1), to look for false alarms.
    every = os.environ.get("KVTAIL_SOAK_VERIFY_EVERY")
    producer = {"verify_kv_every": int(every)} if every else {}
    pair = fleet.add_pair(
        "hybrid", model, wrapped=True, zero_tails="auto", producer_options=producer
    )
    with fleet.start(), PrefillTap(pair.prefill.url) as tap:
        (attn_block,) = {v["block_size"] for v in pair.decode.layout().values()}
        with Router(pair.name, [tap.url], [pair.decode.url], fleet.log_dir) as router:
            yield Hybrid(reference, pair, fleet, tap, router, attn_block)


def _kinds(prompts: list[Prompt]) -> set[tuple[str, bool]]:
    return {(p.kind, p.stream) for p in prompts}


def test_wrapped_hybrid_pair_starts_and_answers_like_one_engine(hybrid: Hybrid) -> None:
    for server in hybrid.pair.servers:
        text = server.log_path.read_text(errors="replace")
        # vLLM's own line: the layout it read from the environment.
        assert "Setting SSM conv state layout to DS" in text, server.spec.name
    hybrid.ensure_prefill()
    prompts = hybrid.prompts(8, seed=23)
    assert any(p.mid_block(hybrid.attn_block) for p in prompts)
    assert _kinds(prompts) == {(k, s) for k in ("completion", "chat") for s in (False, True)}
    refs = references(hybrid.reference, prompts)
    answers = send_all(openai_client(hybrid.router.url), prompts, MAX_TOKENS, CONCURRENCY)
    assert mismatches(answers, refs) == []
    got = wait_counts(hybrid.pair.decode, {}, {"failed_loads": 0})
    assert got["held_requests"] == 0, got
    assert hybrid.pair.decode.nan_census() == {}


def test_prefill_killed_after_its_answer(hybrid: Hybrid) -> None:
    """SIGKILL after the prefill legs of two streamed requests answered, before the
    decode server pulled; then the router with its prefill server dead, and the
    restart."""
    pair, decode = hybrid.pair, hybrid.pair.decode
    hybrid.ensure_prefill()
    streamed = [p for p in hybrid.prompts(4, seed=24) if p.stream]  # completion, chat
    assert _kinds(streamed) == {("completion", True), ("chat", True)}
    assert all(p.mid_block(hybrid.attn_block) for p in streamed)
    refs = references(hybrid.reference, streamed)
    # A router straight in front of P (no tap) for the time P is dead; it must
    # see P healthy once, so it starts now.
    with Router("hybrid-direct", [pair.prefill.url], [decode.url], hybrid.fleet.log_dir) as direct:
        before = kvtail(decode)
        hybrid.tap.after_prefill = AfterPrefill(pair.prefill.kill, parties=len(streamed))
        client = openai_client(hybrid.router.url)
        answers = send_all(client, streamed, MAX_TOKENS, len(streamed))
        assert not pair.prefill.alive
        assert mismatches(answers, refs) == []
        got = wait_counts(decode, before, {"failed_loads": len(streamed)}, timeout=120)
        assert got["held_requests"] == 0, got
        assert decode.nan_census() == {}
        hybrid.tap.reset()
        # Not streamed, as for the Llama pair: the router's error is an HTTP status.
        (plain,) = hybrid.prompts(1, seed=26)
        router_with_prefill_dead(hybrid.reference, pair.prefill, direct, decode, plain)

    hybrid.ensure_prefill()  # the restarted prefill server, behind the module's router
    prompts = hybrid.prompts(4, seed=25)
    refs = references(hybrid.reference, prompts)
    before = kvtail(decode)
    answers = send_all(openai_client(hybrid.router.url), prompts, MAX_TOKENS, CONCURRENCY)
    assert mismatches(answers, refs) == []
    got = wait_counts(decode, before, {"failed_loads": 0})
    assert got["held_requests"] == 0, got
    assert decode.nan_census() == {}


@pytest.mark.soak
@pytest.mark.skipif(os.environ.get("KVTAIL_SOAK") != "1", reason="set KVTAIL_SOAK=1")
def test_soak_the_digest_of_the_hybrid_raises_no_false_alarm(hybrid: Hybrid) -> None:
    """Clean requests through the router (``KVTAIL_SOAK_HYBRID_REQUESTS``, 200):
    the single-engine answers, no load failed, no digest (attention KV and the
    Mamba state) differing from its producer's, the sample taken."""
    hybrid.ensure_prefill()
    decode = hybrid.pair.decode
    prompts = hybrid.prompts(int(os.environ.get("KVTAIL_SOAK_HYBRID_REQUESTS", "200")), seed=29)
    refs = references(hybrid.reference, prompts)
    before = kvtail(decode)
    answers = send_all(openai_client(hybrid.router.url), prompts, MAX_TOKENS, CONCURRENCY)
    assert mismatches(answers, refs) == []
    got = wait_counts(decode, before, {"failed_loads": 0, "digest_mismatches": 0}, timeout=180)
    print("\nHYBRID SOAK " + json.dumps({"requests": len(prompts), **got}))
    assert got["held_requests"] == 0 and got.get("digests_verified", 0) > 0, got
    assert decode.nan_census() == {}
