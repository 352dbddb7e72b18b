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
CONFIGS = sorted(p for p in EXAMPLES.rglob("*.json") if p.name != "mooncake.json")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_kv_transfer_configs_parse_and_resolve(path):
    ktc = json.loads(path.read_text())
    assert ktc["kv_connector"] == "KVTailConnector"
    cfg = KVTailConfig.from_extra_config(ktc["kv_connector_extra_config"])
    pytest.importorskip("vllm")
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtail_connector import backend

    outer = KVTransferConfig(**ktc)
    inner = backend.inner_transfer_config(outer, cfg)
    assert inner.kv_role == ktc["kv_role"]
    registered = KVConnectorFactory.get_connector_class_by_name(cfg.backend)
    assert backend.resolve_backend_class(cfg, inner) is registered


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
