"""The GPU deployment examples stay valid: configs parse, the proxy's two steps work."""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvtail_connector.config import KVTailConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# kv_transfer_configs: every JSON file but Mooncake's own config and the Grafana dashboard
CONFIGS = sorted(
    p for p in EXAMPLES.rglob("*.json") if p.name != "mooncake.json" and p.parent.name != "grafana"
)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_kv_transfer_configs_parse_and_resolve(path):
    ktc = json.loads(path.read_text())
    assert ktc["kv_connector"] == "KVTailConnector"
    cfg = KVTailConfig.from_extra_config(ktc["kv_connector_extra_config"])
    pytest.importorskip("vllm")
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtail_connector import inner_connector

    outer = KVTransferConfig(**ktc)
    inner = inner_connector.inner_transfer_config(outer, cfg)
    assert inner.kv_role == ktc["kv_role"]
    registered = KVConnectorFactory.get_connector_class_by_name(cfg.backend)
    assert inner_connector.resolve_backend_class(cfg, inner) is registered


def _load_proxy():
    spec = importlib.util.spec_from_file_location("example_proxy", EXAMPLES / "proxy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Fake(BaseHTTPRequestHandler):
    seen: list

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(body)
        if body["kv_transfer_params"].get("do_remote_decode"):
            answer = {"kv_transfer_params": {"remote_block_ids": [[3, 4]], "remote_engine_id": "p"}}
        else:
            answer = {"choices": [{"text": "decoded"}]}
        payload = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def _serve(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


def test_proxy_does_prefill_then_decode():
    proxy = _load_proxy()
    prefill_seen, decode_seen = [], []
    p_server, p_url = _serve(type("P", (_Fake,), {"seen": prefill_seen}))
    d_server, d_url = _serve(type("D", (_Fake,), {"seen": decode_seen}))
    x_server, x_url = _serve(proxy.make_handler(p_url, d_url))
    try:
        answer = proxy.post(x_url + "/v1/completions", {"prompt": "hi", "max_tokens": 9})
    finally:
        for s in (p_server, d_server, x_server):
            s.shutdown()
    assert answer == {"choices": [{"text": "decoded"}]}
    (first,) = prefill_seen
    assert first["max_tokens"] == 1 and first["kv_transfer_params"]["do_remote_decode"] is True
    (second,) = decode_seen
    assert second["max_tokens"] == 9
    assert second["kv_transfer_params"] == {"remote_block_ids": [[3, 4]], "remote_engine_id": "p"}


class _Decode(BaseHTTPRequestHandler):
    """A fake pair in one server: answers the prefill leg, then the decode leg as
    the class says (``mode``): a stream, an HTTP error, or no answer at all."""

    mode = "stream"
    holding = threading.Event()
    hung_up = threading.Event()

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["kv_transfer_params"].get("do_remote_decode"):
            self._send(200, {"kv_transfer_params": {"remote_block_ids": [[1]]}})
        elif self.mode == "stream":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(3):
                self.wfile.write(f"data: {json.dumps({'n': i})}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        elif self.mode == "error":
            self._send(500, {"error": {"message": "KV load failed", "code": 500}})
        else:  # "hold": wait until the proxy hangs up
            self.holding.set()
            self.connection.settimeout(30)
            if self.connection.recv(1) == b"":
                self.hung_up.set()

    def _send(self, status, answer):
        payload = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def _post_raw(url, body):
    import http.client

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


@pytest.mark.parametrize("mode", ["stream", "error", "hold"])
def test_proxy_streams_relays_errors_and_aborts_on_hang_up(mode):
    proxy = _load_proxy()
    handler = type(
        "D", (_Decode,), {"mode": mode, "holding": threading.Event(), "hung_up": threading.Event()}
    )
    server, url = _serve(handler)
    x_server, x_url = _serve(proxy.make_handler(url, url))
    try:
        conn = _post_raw(x_url, {"prompt": [1, 2], "stream": mode != "error"})
        if mode == "hold":
            import socket

            assert handler.holding.wait(10), "the decode leg never started"
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
            assert handler.hung_up.wait(10), "the proxy kept the decode leg open"
            return
        response = conn.getresponse()
        raw = response.read()
    finally:
        server.shutdown()
        x_server.shutdown()
    if mode == "stream":
        assert response.status == 200
        assert response.getheader("Content-Type") == "text/event-stream"
        events = [line for line in raw.decode().split("\n\n") if line]
        assert events == [*(f'data: {{"n": {i}}}' for i in range(3)), "data: [DONE]"]
    else:
        assert response.status == 500
        assert json.loads(raw) == {"error": {"message": "KV load failed", "code": 500}}


def test_proxy_answers_502_when_a_server_is_down():
    proxy = _load_proxy()
    with socket_closed_port() as dead:
        x_server, x_url = _serve(proxy.make_handler(dead, dead))
        try:
            response = _post_raw(x_url, {"prompt": [1]}).getresponse()
            body = json.loads(response.read())
        finally:
            x_server.shutdown()
    assert response.status == 502
    assert body["error"]["code"] == 502 and "Connection" in body["error"]["message"]


def socket_closed_port():
    """A context manager giving the URL of a loopback port nobody listens on."""
    import contextlib
    import socket

    @contextlib.contextmanager
    def closed():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        yield f"http://127.0.0.1:{port}"

    return closed()
