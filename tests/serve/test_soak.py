"""A bounded soak of the wrapped pair (runs only with ``KVTAIL_SOAK=1``).

A few hundred requests through ``vllm-router`` within at most five minutes,
8 at a time, prompts of random lengths (completions and chats, streamed and
not), and about one in eight streamed requests abandoned by its client at a
random point (before the first token: while the decode server loads; or after
a few tokens). Afterwards the wrapper holds nothing, every answer that was not
abandoned equals the single-engine server's, there is no error, no NaN in the
decode server's cache, and the decode server's RSS growth is reported.
``verify_kv`` runs at its default (a sampled digest); no load may differ from
its producer's digest (a false alarm).

    KVTAIL_SOAK=1 .venv/bin/python -m pytest -s -p no:cacheprovider tests/serve/test_soak.py

``KVTAIL_SOAK_REQUESTS`` (800) and ``KVTAIL_SOAK_BUDGET_S`` (300) size it;
``KVTAIL_SOAK_VERIFY_EVERY=1`` has the producer digest every request;
``KVTAIL_SOAK_PREFIX_CACHING=1`` turns prefix caching on in the wrapped pair and
starts one completion in three with the same three blocks, so that the decode
server loads only what its cache lacks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest

from demo.api_server import APIServer
from demo.router import Router
from demo.workload import (
    Answer,
    Prompt,
    openai_client,
    request_kwargs,
    send,
)
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

pytestmark = [
    pytest.mark.serve,
    pytest.mark.soak,
    pytest.mark.skipif(os.environ.get("KVTAIL_SOAK") != "1", reason="set KVTAIL_SOAK=1"),
]

REQUESTS = int(os.environ.get("KVTAIL_SOAK_REQUESTS", "800"))
BUDGET_S = float(os.environ.get("KVTAIL_SOAK_BUDGET_S", "300"))
ABORT_SHARE = 0.125


def rss_bytes(server: APIServer) -> int:
    """Resident memory of every process of the server (API server and engine)."""
    out = 0
    for pid in server.group_pids():
        with contextlib.suppress(psutil.Error):
            out += psutil.Process(pid).memory_info().rss
    return out


def _prefix_hits(server: APIServer) -> float:
    """Tokens the server's prefix cache answered (vLLM's counter; 0 with caching off)."""
    rows = server.metrics().get("vllm:prefix_cache_hits_total", [])
    return sum(value for _, value in rows)


def _abandon(url: str, prompt: Prompt, after_chunks: int) -> int:
    """Stream ``prompt`` and hang up after ``after_chunks`` chunks; chunks read."""
    client = openai_client(url)
    api = client.completions if prompt.kind == "completion" else client.chat.completions
    stream = api.create(**request_kwargs(prompt, MAX_TOKENS))
    read = 0
    try:
        for _ in stream:
            if read >= after_chunks:
                break
            read += 1
    finally:
        stream.close()
    return read


def test_soak(servers: Servers, tmp_path: Path) -> None:
    pair = servers.wrapped
    if not pair.prefill.alive:
        pair.prefill.start().wait_ready()
    d = pair.decode
    bs = block_size(d)
    ref = servers.reference

    rng = random.Random(7)
    prompts = served_prompts(ref, REQUESTS, bs, seed=7, low=4, high=300)
    if os.environ.get("KVTAIL_SOAK_PREFIX_CACHING") == "1":
        shared = tuple(range(100, 100 + 3 * bs))  # three whole blocks, the tiny vocab
        prompts = [
            dataclasses.replace(
                p, token_ids=shared + p.token_ids, num_tokens=len(shared) + p.num_tokens
            )
            if p.kind == "completion" and i % 3 == 0
            else p
            for i, p in enumerate(prompts)
        ]
    rng.shuffle(prompts)
    aborts = {i for i, p in enumerate(prompts) if p.stream and rng.random() < ABORT_SHARE * 2}
    abort_after = {i: rng.choice([0, 0, 1, 3]) for i in aborts}
    kept = [i for i in range(len(prompts)) if i not in aborts]
    refs = references(ref, [prompts[i] for i in kept])

    before = kvtail(d)
    hits0 = _prefix_hits(d)
    rss0 = rss_bytes(d)
    answers: dict[int, Answer] = {}
    abandoned: dict[int, Any] = {}
    t0 = time.monotonic()
    with Router("soak", [pair.prefill.url], [d.url], servers.fleet.log_dir) as router:
        client = openai_client(router.url)

        def one(i: int) -> None:
            if time.monotonic() - t0 > BUDGET_S:
                return
            if i in aborts:
                try:
                    abandoned[i] = _abandon(router.url, prompts[i], abort_after[i])
                except Exception as e:  # noqa: BLE001 - counted below
                    abandoned[i] = e
            else:
                answers[i] = send(client, prompts[i], MAX_TOKENS)

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(one, range(len(prompts))))
    elapsed = time.monotonic() - t0
    got = wait_counts(d, before, {"failed_loads": 0}, timeout=180)
    rss1 = rss_bytes(d)

    done = [i for i in kept if i in answers]
    errors = [answers[i].error for i in done if answers[i].error is not None]
    abandon_errors = [a for a in abandoned.values() if isinstance(a, Exception)]
    by_index = dict(zip(kept, refs, strict=True))
    wrong = mismatches([answers[i] for i in done], [by_index[i] for i in done])
    summary = {
        "requests_sent": len(done) + len(abandoned),
        "completed": len(done),
        "abandoned": len(abandoned),
        "elapsed_s": round(elapsed, 1),
        "requests_per_s": round((len(done) + len(abandoned)) / elapsed, 2),
        "errors": len(errors) + len(abandon_errors),
        "wrong_answers": len(wrong),
        "tails_zeroed": got.get("tails_zeroed"),
        "vouched_tails": got.get("vouched_tails"),
        "failed_loads": got.get("failed_loads"),
        "digests_verified": got.get("digests_verified", 0),
        "digest_mismatches": got.get("digest_mismatches", 0),
        "digests_skipped": got.get("digests_skipped", 0),
        "held_requests_after": got.get("held_requests"),
        "decode_rss_mb_before": round(rss0 / 2**20, 1),
        "decode_rss_mb_after": round(rss1 / 2**20, 1),
        "decode_rss_growth_mb": round((rss1 - rss0) / 2**20, 1),
        "decode_prefix_cache_hit_tokens": _prefix_hits(d) - hits0,
    }
    print("\nSOAK " + json.dumps(summary))
    (tmp_path / "soak.json").write_text(json.dumps(summary, indent=2))
    assert len(done) + len(abandoned) >= 200, summary  # "a few hundred" within the budget
    assert errors == [] and abandon_errors == [], (errors[:3], abandon_errors[:3])
    assert wrong == [], wrong[:5]
    assert got["held_requests"] == 0, got
    # No false alarm; the sample was taken (P digests the first of every N).
    assert got.get("digest_mismatches", 0) == 0, got
    assert got.get("digests_verified", 0) > 0, got
    assert d.nan_census() == {}
    # Every completed mid-block request had its tail zeroed (by D) or vouched for
    # (zeroed by P); abandoned ones may or may not have reached their load.
    mid_done = sum(prompts[i].mid_block(bs) for i in done)
    mid_abandoned = sum(prompts[i].mid_block(bs) for i in abandoned)
    handled = got.get("tails_zeroed", 0) + got.get("vouched_tails", 0)
    assert mid_done <= handled <= mid_done + mid_abandoned, (got, mid_done)
