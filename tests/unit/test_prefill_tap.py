"""The serving harness's tap between vllm-router and a prefill server, on fakes.

The tap passes everything through, runs its hook on a prefill answer before
handing it on (and hands on what the hook left), answers by itself when given a
fake, and makes a dead upstream look dead. With ``vllm-router`` installed, the
router in front of the tap sends the decode leg with the answer as the hook left
it: what the serving tests rely on to put faults between the legs.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from demo.prefill_tap import PrefillTap

pytest.importorskip("aiohttp")


class _Fake(BaseHTTPRequestHandler):
    """A fake server (test double): a prefill leg gets ``kv_transfer_params`` back,
    a decode leg an answer naming the params it got; ``seen`` records bodies."""

    seen: list[tuple[str, dict[str, Any]]]
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802
        self._send(200, {"path": self.path})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.path, body))
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            self._send(200, {"kv_transfer_params": {"remote_block_ids": [[3, 4]], "kvtail": {}}})
        else:
            self._send(200, {"choices": [{"text": "decoded"}], "got": kv})

    def _send(self, status: int, answer: dict[str, Any]) -> None:
        payload = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake():
    seen: list[tuple[str, dict[str, Any]]] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("F", (_Fake,), {"seen": seen}))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", seen
    server.shutdown()
    server.server_close()


def _request(url: str, method: str, path: str, body: dict | None = None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    data = None if body is None else json.dumps(body)
    conn.request(method, path, data, {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


PREFILL_LEG = {"prompt": [1, 2], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}


def test_passes_through_and_runs_the_hook_between_the_legs(fake):
    url, seen = fake
    calls = []

    def hook(path: str, body: dict, answer: dict) -> None:
        calls.append((path, body["prompt"]))
        answer["kv_transfer_params"]["remote_block_ids"] = [[9]]

    with PrefillTap(url) as tap:
        assert _request(tap.url, "GET", "/health?x=1") == (200, {"path": "/health?x=1"})
        tap.after_prefill = hook
        status, answer = _request(tap.url, "POST", "/v1/completions", PREFILL_LEG)
    assert status == 200
    assert answer["kv_transfer_params"] == {"remote_block_ids": [[9]], "kvtail": {}}
    assert calls == [("/v1/completions", [1, 2])]
    assert seen == [("/v1/completions", PREFILL_LEG)]


def test_a_fake_answers_without_the_upstream(fake):
    url, seen = fake
    with PrefillTap(url) as tap:
        tap.fake = lambda body: {"kv_transfer_params": {"n": len(body["prompt"])}}
        assert _request(tap.url, "POST", "/v1/completions", PREFILL_LEG) == (
            200,
            {"kv_transfer_params": {"n": 2}},
        )
    assert seen == []


def test_a_dead_upstream_drops_the_connection():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with PrefillTap(dead) as tap, pytest.raises((ConnectionError, http.client.HTTPException)):
        _request(tap.url, "POST", "/v1/completions", PREFILL_LEG)


def test_vllm_router_sends_the_decode_leg_with_the_answer_the_hook_left(fake, tmp_path):
    pytest.importorskip("vllm_router")
    from demo.router import Router

    url, seen = fake

    def hook(path: str, body: dict, answer: dict) -> None:
        answer["kv_transfer_params"]["remote_block_ids"] = [[7]]

    with PrefillTap(url) as tap, Router("unit", [tap.url], [url], tmp_path) as router:
        tap.after_prefill = hook
        client = {"model": "m", "prompt": [5], "max_tokens": 9, "kv_transfer_params": {"c": 1}}
        status, answer = _request(router.url, "POST", "/v1/completions", client)
    assert status == 200
    # The decode leg: the client's request, kv_transfer_params replaced by the
    # prefill answer's, whole (the wrapper's kvtail entry included).
    assert answer["got"] == {"remote_block_ids": [[7]], "kvtail": {}}
    (prefill_path, prefill), (decode_path, decode) = seen
    assert prefill_path == decode_path == "/v1/completions"
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert decode["max_tokens"] == 9
