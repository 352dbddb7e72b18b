"""The Mamba hybrid served P/D over NIXL, ``KVTailConnector`` on both sides.

The tiny Granite hybrid (one Mamba2 layer, one attention layer, float32) in two
API servers with the wrapper around NixlConnector and default settings, with
no variable set by hand: vLLM's CPU platform picks the DS Mamba conv-state
layout NIXL needs only for a NIXL connector it sees by name, and the wrapper's
plugin sets it from the server's ``--kv-transfer-config`` (issue 23: both
servers failed at start-up). Through vllm-router, prompts ending inside
an attention block and on its boundary, completions and chats, streamed and
not, get the single-engine server's greedy answers; nothing non-finite is
left in the decode server's cache; no load failed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvtail_connector.demo.api_server import APIServer
from kvtail_connector.demo.router import Router
from kvtail_connector.demo.serving import Fleet, ServePair
from kvtail_connector.demo.tiny_model import ensure_tiny_hybrid
from kvtail_connector.demo.workload import mixed_prompts, openai_client, send_all
from kvtail_connector.name_keyed import CONV_STATE_LAYOUT_ENV
from tests.e2e.support import require
from tests.serve.support import CONCURRENCY, MAX_TOKENS, mismatches, references, wait_counts

pytestmark = pytest.mark.serve


@dataclass
class Hybrid:
    reference: APIServer
    pair: ServePair
    fleet: Fleet


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hybrid]:
    require("nixl._api")
    # The servers inherit this process's environment: nothing set by hand.
    assert CONV_STATE_LAYOUT_ENV not in os.environ
    model = str(ensure_tiny_hybrid(kind="granite"))
    fleet = Fleet(tmp_path_factory.mktemp("hybrid-nixl-logs"))
    reference = fleet.add_reference(model)
    pair = fleet.add_pair("hybrid", model, wrapped=True, zero_tails="auto")
    with fleet.start():
        yield Hybrid(reference, pair, fleet)


def test_wrapped_hybrid_pair_starts_and_answers_like_one_engine(hybrid: Hybrid) -> None:
    for server in hybrid.pair.servers:
        text = server.log_path.read_text(errors="replace")
        # vLLM's own line: the layout it read from the environment.
        assert "Setting SSM conv state layout to DS" in text, server.spec.name
    (attn_block,) = {v["block_size"] for v in hybrid.pair.decode.layout().values()}
    ref = hybrid.reference

    def count_tokens(messages: list[dict[str, str]]) -> int:
        return len(ref.tokenize(messages=messages, add_generation_prompt=True))

    prompts = mixed_prompts(8, attn_block, count_tokens, seed=23, low=8, high=200)
    assert any(p.mid_block(attn_block) for p in prompts)
    refs = references(ref, prompts)
    pair = hybrid.pair
    with Router(pair.name, [pair.prefill.url], [pair.decode.url], hybrid.fleet.log_dir) as router:
        answers = send_all(openai_client(router.url), prompts, MAX_TOKENS, CONCURRENCY)
    assert mismatches(answers, refs) == []
    got = wait_counts(hybrid.pair.decode, {}, {"failed_loads": 0})
    assert got["held_requests"] == 0, got
    assert hybrid.pair.decode.nan_census() == {}
