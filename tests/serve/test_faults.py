"""Faults between real servers, under ``kv_load_failure_policy`` recompute and fail.

The wrapped pair's prefill server feeds two decode servers, one per policy;
each fault hits both at once (the same request shape through two routes). A
route is a ``vllm-router`` in front of the prefill server and one decode server,
with a :class:`~demo.prefill_tap.PrefillTap` between the router
and the prefill server: the faults between the legs happen there, after the
prefill answer and before the router sends the decode leg. After every fault:

* no NaN anywhere in either decode server's KV cache;
* ``recompute``: the answer equals the single-engine server's;
* ``fail``: the client gets a clean error (an HTTP error with a JSON body, or
  an error event in the stream), not a dropped connection;
* the wrapper holds nothing (``vllm:kvtail_held_requests`` back to 0), and
  ``vllm:kvtail_failed_loads_total`` moved by the failures that happened;
* the decode servers keep serving: a request computed locally, and P/D requests
  through the router once a (restarted) prefill server is up.

With the prefill server dead, the router itself is measured (docs/serving.md):
its answer to a client, that nothing reaches the decode server, when its health
check takes the prefill server out and when it routes again after the restart.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pytest

from demo.api_server import APIServer
from demo.faults import AfterPrefill, BlackHole, fake_prefill, nixl_params_to
from demo.prefill_tap import AfterPrefill as TapHook
from demo.prefill_tap import FakeAnswer, PrefillTap
from demo.prom_text import total
from demo.router import Router
from demo.serving import ServePair
from demo.workload import (
    Answer,
    Prompt,
    completion_prompt,
    openai_client,
    request_kwargs,
    send,
)
from tests.serve.conftest import Servers
from tests.serve.support import (
    MAX_TOKENS,
    block_size,
    kvtail,
    mismatches,
    references,
    router_with_prefill_dead,
    wait_counts,
    wait_idle,
    wait_until,
)

pytestmark = pytest.mark.serve

POLICIES = ("recompute", "fail")


@dataclass
class Route:
    """One decode server behind a router whose prefill side is a tap on the
    prefill server."""

    policy: str
    decode: APIServer
    tap: PrefillTap
    router: Router

    @property
    def url(self) -> str:
        return self.router.url


@pytest.fixture
def pair(servers: Servers) -> ServePair:
    """The wrapped pair, its prefill server up (a test before may have killed it)."""
    pair = servers.wrapped
    if not pair.prefill.alive:
        pair.prefill.start().wait_ready()
    return pair


@pytest.fixture
def bs(pair: ServePair) -> int:
    return block_size(pair.decode)


@pytest.fixture(scope="module")
def _routes(servers: Servers) -> Iterator[list[Route]]:
    """A tap and a router per policy, for the whole module (a router takes seconds
    to start; the hooks change per test)."""
    pair = servers.wrapped
    if not pair.prefill.alive:
        pair.prefill.start().wait_ready()
    with ExitStack() as stack:
        out = []
        for policy in POLICIES:
            decode = pair.decodes[policy]
            tap = stack.enter_context(PrefillTap(pair.prefill.url))
            router = Router(f"faults-{policy}", [tap.url], [decode.url], servers.fleet.log_dir)
            out.append(Route(policy, decode, tap, stack.enter_context(router)))
        yield out


@pytest.fixture
def routes(pair: ServePair, _routes: list[Route]) -> Iterator[Callable[..., list[Route]]]:
    """``routes(after_prefill=..., fake=...)``: the routes with these between the
    legs (none: plain P/D), once each router sees its workers healthy."""

    def make(after_prefill: TapHook | None = None, fake: FakeAnswer | None = None) -> list[Route]:
        for r in _routes:
            r.tap.reset(pair.prefill.url)
            r.tap.after_prefill, r.tap.fake = after_prefill, fake
            r.router.wait_ready()
        return _routes

    yield make
    for r in _routes:
        r.tap.reset(pair.prefill.url)


def _prompts(bs: int, seed: int, stream: bool = False) -> list[Prompt]:
    """One mid-block completion prompt per policy (distinct, so neither server can
    answer from anything left by the other request)."""
    import random

    rng = random.Random(seed)
    return [completion_prompt(bs * k + 5 + k, rng, stream) for k in (2, 3)]


def _send_each(routes: list[Route], prompts: list[Prompt]) -> list[Future[Answer]]:
    pool = ThreadPoolExecutor(len(routes))
    futures = [
        pool.submit(send, openai_client(r.url), p, MAX_TOKENS)
        for r, p in zip(routes, prompts, strict=True)
    ]
    pool.shutdown(wait=False)
    return futures


def _in_flight(server: APIServer) -> float:
    m = server.metrics()
    return total(m, "vllm:num_requests_kv_fetch_by_stage", stage="in_progress")


def _queued(server: APIServer) -> float:
    """Requests the engine has running or waiting (an aborted one is neither, even
    while its load is still in flight)."""
    m = server.metrics()
    return total(m, "vllm:num_requests_running") + total(m, "vllm:num_requests_waiting")


def _assert_clean_failure(answer: Answer) -> None:
    import openai

    err = answer.error
    assert err is not None, f"policy fail answered {answer.token_ids}"
    assert not isinstance(err, openai.APIConnectionError), f"connection dropped: {err!r}"
    assert isinstance(err, openai.APIError), repr(err)
    if not answer.prompt.stream:
        assert isinstance(err, openai.APIStatusError) and err.status_code == 500, repr(err)
        assert isinstance(err.body, dict) and err.body.get("message"), err.body


def _check(
    servers: Servers,
    routes: list[Route],
    answers: list[Answer],
    before: list[dict[str, float]],
    failed: dict[str, int],
) -> None:
    """What must hold after a fault (see the module docstring)."""
    refs = references(servers.reference, [a.prompt for a in answers])
    for route, answer, ref, b in zip(routes, answers, refs, before, strict=True):
        d = route.decode
        got = wait_counts(d, b, {"failed_loads": failed[route.policy]}, timeout=120)
        assert got["held_requests"] == 0, (route.policy, got)
        assert d.nan_census() == {}, route.policy
        if route.policy == "recompute":
            assert mismatches([answer], [ref]) == [], route.policy
        else:
            _assert_clean_failure(answer)


def _keeps_serving(servers: Servers, pair: ServePair, routes: list[Route], bs: int, seed: int):
    """Both decode servers answer a local request, then (prefill server up, and
    healthy in each router's eyes) P/D requests through their routers, all equal to
    the single-engine answers."""
    prompts = _prompts(bs, seed)
    refs = references(servers.reference, prompts)
    for route in routes:
        local = send(openai_client(route.decode.url), prompts[0], MAX_TOKENS)
        assert mismatches([local], refs[:1]) == [], route.policy
    if not pair.prefill.alive:
        pair.prefill.start().wait_ready()
    for route in routes:
        route.router.wait_ready()
        before = kvtail(route.decode)
        answers = [send(openai_client(route.url), p, MAX_TOKENS) for p in prompts]
        assert mismatches(answers, refs) == [], route.policy
        # The restarted P vouches again, bound to the new transfers: D checks each
        # claim (none declined) and zeroes every tail itself (vouch_tails "auto").
        want = {
            "vouches_unused": len(prompts),
            "vouches_declined": 0,
            "vouched_tails": 0,
            "tails_zeroed": len(prompts),
            "failed_loads": 0,
        }
        got = wait_counts(route.decode, before, want)
        assert got["held_requests"] == 0, got


# --------------------------------------------------------------------------- #


def test_prefill_killed_after_its_answer(servers: Servers, pair: ServePair, routes, bs) -> None:
    """SIGKILL after the prefill leg answered, before either decode server pulled;
    then the router with its prefill server dead, and the restart."""
    decode = pair.decodes["recompute"]
    log_dir = servers.fleet.log_dir
    with Router("direct", [pair.prefill.url], [decode.url], log_dir) as direct:
        rs = routes(after_prefill=AfterPrefill(pair.prefill.kill, parties=len(POLICIES)))
        before = [kvtail(r.decode) for r in rs]
        answers = [f.result(timeout=600) for f in _send_each(rs, _prompts(bs, seed=10))]
        assert not pair.prefill.alive
        _check(servers, rs, answers, before, failed={"recompute": 1, "fail": 1})
        prompt = _prompts(bs, seed=12)[0]
        router_with_prefill_dead(servers.reference, pair.prefill, direct, decode, prompt)
    _keeps_serving(servers, pair, rs, bs, seed=11)


def _loads_held(
    pair: ServePair,
    routes: Callable[..., list[Route]],
    start: Callable[[list[Route], int], list[Any]],
    drain: Callable[[list[Any]], None],
    attempts: int = 3,
) -> tuple[list[Route], list[Any], list[dict[str, float]]]:
    """Freeze the prefill server right after the prefill legs of one request per
    decode server (``start(routes, attempt)`` sends them), and return once both
    decode servers report the load in progress: (routes, what ``start``
    returned, each decode server's counters before). If a load is never seen in
    progress (it completed first), the prefill server is thawed, the requests
    are drained, and it is tried again with new prompts."""
    for attempt in range(attempts):
        rs = routes(after_prefill=AfterPrefill(pair.prefill.freeze, parties=len(POLICIES)))
        before = [kvtail(r.decode) for r in rs]
        handles = start(rs, attempt)
        try:
            for r in rs:
                wait_until(lambda r=r: _in_flight(r.decode) >= 1, 60, f"{r.policy}: load held")
            return rs, handles, before
        except AssertionError:
            pair.prefill.thaw()
            drain(handles)
            for r in rs:
                wait_idle(r.decode)
    raise AssertionError(f"no load was ever seen in progress in {attempts} attempts")


def test_prefill_killed_during_the_transfer(servers: Servers, pair: ServePair, routes, bs) -> None:
    """The prefill server frozen after its answer (its side of the READ stalls),
    SIGKILLed once both decode servers report the load in progress."""
    _keeps_serving(servers, pair, routes(), bs, seed=20)  # both handshake with this P

    def start(rs: list[Route], attempt: int) -> list[Future[Answer]]:
        return _send_each(rs, _prompts(bs, seed=21 + 100 * attempt, stream=True))

    def drain(futures: list[Future[Answer]]) -> None:
        for f in futures:
            f.result(timeout=600)

    try:
        rs, futures, before = _loads_held(pair, routes, start, drain)
    finally:
        pair.prefill.kill()
    answers = [f.result(timeout=600) for f in futures]
    _check(servers, rs, answers, before, failed={"recompute": 1, "fail": 1})
    _keeps_serving(servers, pair, rs, bs, seed=22)


def test_handshake_never_answered(servers: Servers, pair: ServePair, routes, bs) -> None:
    """The prefill answer names a side channel that accepts and never replies."""
    hole = BlackHole()
    prompts = _prompts(bs, seed=30)
    blocks = {p.token_ids: list(range(1, -(-p.num_tokens // bs) + 1)) for p in prompts}

    def params(body: dict[str, Any]) -> dict[str, Any]:
        return nixl_params_to("127.0.0.1", hole.port, blocks[tuple(body["prompt"])])

    try:
        rs = routes(fake=fake_prefill(params))
        before = [kvtail(r.decode) for r in rs]
        answers = [f.result(timeout=600) for f in _send_each(rs, prompts)]
        _check(servers, rs, answers, before, failed={"recompute": 1, "fail": 1})
    finally:
        hole.close()
    _keeps_serving(servers, pair, routes(), bs, seed=31)


def test_transfer_reported_failed(servers: Servers, pair: ServePair, routes, bs) -> None:
    """The prefill answer is real but names blocks the producer does not have: the
    decode server's NIXL read of them fails."""

    def bad_blocks(path: str, body: dict[str, Any], answer: dict[str, Any]) -> None:
        ids = answer["kv_transfer_params"]["remote_block_ids"]
        answer["kv_transfer_params"]["remote_block_ids"] = [[b + 10**6 for b in g] for g in ids]

    rs = routes(after_prefill=bad_blocks)
    before = [kvtail(r.decode) for r in rs]
    answers = [f.result(timeout=600) for f in _send_each(rs, _prompts(bs, seed=40))]
    _check(servers, rs, answers, before, failed={"recompute": 1, "fail": 1})
    _keeps_serving(servers, pair, routes(), bs, seed=41)  # taps without the bad ids


def _open_stream(url: str, prompt: Prompt) -> http.client.HTTPConnection:
    """Send a streamed request and return without reading the answer."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    kwargs = request_kwargs(prompt, MAX_TOKENS)
    body = {**{k: v for k, v in kwargs.items() if k != "extra_body"}, **kwargs["extra_body"]}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def test_client_disconnects_while_decode_loads(
    servers: Servers, pair: ServePair, routes, bs
) -> None:
    """The client hangs up while the decode server waits for the KV (prefill
    server frozen): the request is aborted there, and nothing stays behind once
    the producer runs again."""
    _keeps_serving(servers, pair, routes(), bs, seed=50)  # both handshake with this P

    def start(rs: list[Route], attempt: int) -> list[http.client.HTTPConnection]:
        prompts = _prompts(bs, seed=51 + 100 * attempt, stream=True)
        return [_open_stream(r.url, p) for r, p in zip(rs, prompts, strict=True)]

    def drain(conns: list[http.client.HTTPConnection]) -> None:
        for c in conns:
            c.getresponse().read()
            c.close()

    try:
        rs, conns, before = _loads_held(pair, routes, start, drain)
        for c in conns:
            assert c.sock is not None
            c.sock.shutdown(socket.SHUT_RDWR)
            c.close()
        for r in rs:  # the abort reached the engine: the request is gone from its queues
            wait_until(lambda r=r: not _queued(r.decode), 120, f"{r.policy}: request aborted")
    finally:
        pair.prefill.thaw()
    for r, b in zip(rs, before, strict=True):
        got = wait_counts(r.decode, b, {"failed_loads": 0}, timeout=120)
        assert got["held_requests"] == 0, (r.policy, got)
        assert r.decode.nan_census() == {}, r.policy
    _keeps_serving(servers, pair, rs, bs, seed=52)
