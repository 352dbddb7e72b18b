"""A small two-step P/D proxy for OpenAI-style completions (stdlib only).

Each request goes to the prefill server with ``max_tokens=1`` and
``kv_transfer_params.do_remote_decode=True``; the prefill's returned
``kv_transfer_params`` then go, with the original request, to the decode
server, whose answer is returned. Non-streaming only; one request at a time
per connection thread. For trying a deployment, not for production.

    python examples/proxy.py --prefill http://127.0.0.1:8100 \
        --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PATHS = ("/v1/completions", "/v1/chat/completions")


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: one token, and keep the KV for a remote decode."""
    req = dict(body)
    req["max_tokens"] = 1
    req.pop("max_completion_tokens", None)
    req["stream"] = False
    req["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return req


def decode_request(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The decode leg: the original request plus the prefill's transfer params."""
    params = prefill_response.get("kv_transfer_params")
    if not params:
        raise ValueError("the prefill server returned no kv_transfer_params (is it a kv_producer?)")
    req = dict(body)
    req["kv_transfer_params"] = params
    return req


def post(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
        return json.loads(response.read())


def make_handler(prefill: str, decode: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            if self.path not in PATHS:
                self.send_error(404, f"only {', '.join(PATHS)}")
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if body.get("stream"):
                    raise ValueError("streaming is not supported by this example proxy")
                first = post(prefill + self.path, prefill_request(body))
                answer = post(decode + self.path, decode_request(body, first))
            except Exception as e:  # noqa: BLE001 - reported to the client
                self.send_error(502, str(e))
                return
            payload = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", required=True, help="prefill server base URL")
    parser.add_argument("--decode", required=True, help="decode server base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), make_handler(args.prefill, args.decode))
    print(f"proxy on http://{args.host}:{args.port} -> {args.prefill} then {args.decode}")
    server.serve_forever()


if __name__ == "__main__":
    main()
