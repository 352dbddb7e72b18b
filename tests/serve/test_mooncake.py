"""``KVTailConnector`` around MooncakeStore between two API servers and a master.

The prefill server stores each prompt's blocks in a local ``mooncake_master``;
the decode server, behind ``vllm-router`` (whose decode leg is the client's request
plus whatever ``kv_transfer_params`` the prefill answer carries), loads what the
store holds. On the tiny Llama (one KV precision, no prefix-match unit
below the block) store hits are whole blocks: the wrapper must be transparent.
Clients, 8 at a time, get the single-engine answers; the decode server loaded
from the store; the wrapper zeroed nothing, counted no failure and holds
nothing afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from demo.prom_text import total
from demo.router import Router
from demo.serving import ServePair
from demo.tiny_model import ensure_tiny_llama
from demo.workload import openai_client, send_all
from tests.e2e.support import require
from tests.serve.conftest import Servers
from tests.serve.support import (
    CONCURRENCY,
    MAX_TOKENS,
    block_size,
    kvtail,
    mismatches,
    references,
    served_prompts,
    wait_counts,
)

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def pair(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServePair]:
    require("mooncake.store")
    pair = servers.fleet.add_pair(
        "mooncake", str(ensure_tiny_llama()), backend="mooncake", wrapped=True
    )
    try:
        servers.fleet.start()  # starts only what is not running yet
        yield pair
    finally:
        servers.fleet.close_pair("mooncake")


def _store_hits(pair: ServePair) -> float:
    return total(pair.decode.metrics(), "vllm:external_prefix_cache_hits_total")


def test_store_pair_through_the_router_is_transparent(servers: Servers, pair: ServePair) -> None:
    bs = block_size(pair.decode)
    ref = servers.reference

    prompts = served_prompts(ref, 24, bs, seed=5, low=bs + 1)
    refs = references(ref, prompts)
    before, hits = kvtail(pair.decode), _store_hits(pair)
    log_dir = servers.fleet.log_dir
    with Router("mooncake", [pair.prefill.url], [pair.decode.url], log_dir) as router:
        answers = send_all(openai_client(router.url), prompts, MAX_TOKENS, CONCURRENCY)
    assert mismatches(answers, refs) == []
    got = wait_counts(pair.decode, before, {"tails_zeroed": 0, "failed_loads": 0})
    assert got["held_requests"] == 0, got
    assert _store_hits(pair) > hits, "the decode server never loaded from the store"
    assert pair.decode.nan_census() == {}
