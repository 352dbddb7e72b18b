"""A small two-step P/D proxy for OpenAI-style completions and chat (stdlib only).

Each request goes to the prefill server with ``max_tokens=1``, ``stream=false``
and ``kv_transfer_params.do_remote_decode=True``; the prefill's returned
``kv_transfer_params`` then go, with the original request, to the decode
server, whose answer is relayed, streamed (server-sent events) when the client
asked for ``stream``. With ``--store`` (MooncakeStore and other shared stores)
the decode leg is the original request: the decode server finds the KV in the
store, and no transfer parameters are needed.

Errors: a server's HTTP error (status and JSON body) is passed to the client
unchanged; a server that cannot be reached gives 502 with an OpenAI-style
error body. A client that hangs up aborts the leg in flight (the proxy closes
its connection to the server, which aborts the request there).

For trying a deployment, not for production.

    python examples/proxy.py --prefill http://127.0.0.1:8100 \
        --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import select
import socket
import threading
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

PATHS = ("/v1/completions", "/v1/chat/completions")
# Called between the legs with (path, client body, prefill answer); for tests and
# instrumentation. An exception it raises is reported to the client as a 502.
AfterPrefill = Callable[[str, dict[str, Any], dict[str, Any]], None]


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: one token, not streamed, and keep the KV for a remote decode."""
    req = dict(body)
    req["max_tokens"] = 1
    req.pop("max_completion_tokens", None)
    req["stream"] = False
    req.pop("stream_options", None)
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


class UpstreamError(Exception):
    """A server answered with an HTTP error: relayed as is."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.body, self.content_type = status, body, content_type


class ClientGone(Exception):
    """The client hung up; the leg in flight was aborted."""


class _Leg:
    """One request to a server, abortable from another thread (``abort``)."""

    def __init__(self, base_url: str, path: str, body: dict[str, Any], timeout: float) -> None:
        parts = urlsplit(base_url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        self.path = parts.path.rstrip("/") + path
        self.body = json.dumps(body).encode()
        self.aborted = False

    def open(self) -> http.client.HTTPResponse:
        self.conn.connect()
        if self.aborted:  # the client left before this leg began
            raise ConnectionAbortedError("the client hung up")
        self.conn.request("POST", self.path, self.body, {"Content-Type": "application/json"})
        response = self.conn.getresponse()
        if response.status >= 400:
            raise UpstreamError(
                response.status,
                response.read(),
                response.getheader("Content-Type", "application/json"),
            )
        return response

    def abort(self) -> None:
        self.aborted = True
        sock = self.conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.conn.close()


class _ClientWatch:
    """Aborts the current leg when the client's socket reaches end of file."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._leg: _Leg | None = None
        self._done = threading.Event()
        self.gone = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def track(self, leg: _Leg | None) -> None:
        self._leg = leg
        if self.gone and leg is not None:
            leg.abort()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                readable, _, _ = select.select([self._sock], [], [], 0.2)
                if not readable:
                    continue
                if self._sock.recv(1, socket.MSG_PEEK):
                    return  # the client sent more (a pipelined request): not a hang-up
            except (OSError, ValueError):
                pass  # reset, or closed under us: the client is gone
            self.gone = True
            if self._leg is not None:
                self._leg.abort()
            return

    def stop(self) -> None:
        self._done.set()


def make_handler(
    prefill: str,
    decode: str,
    *,
    store: bool = False,
    after_prefill: AfterPrefill | None = None,
    timeout: float = 600.0,
    quiet: bool = True,
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            if self.path not in PATHS:
                self._error(404, f"only {', '.join(PATHS)}")
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            except (ValueError, TypeError) as e:
                self._error(400, f"the request body is not JSON: {e}")
                return
            # Watched once the body is read: then the client has nothing more to send.
            watch = _ClientWatch(self.connection)
            try:
                first = self._call(watch, prefill, prefill_request(body))
                if after_prefill is not None:
                    after_prefill(self.path, body, first)
                second = body if store else decode_request(body, first)
                self._relay(watch, decode, second)
            except UpstreamError as e:
                self._send(e.status, e.body, e.content_type)
            except ClientGone:
                self.close_connection = True
            except Exception as e:  # noqa: BLE001 - reported to the client
                self._error(502, f"{type(e).__name__}: {e}")
            finally:
                watch.stop()

        def _call(self, watch: _ClientWatch, base: str, body: dict[str, Any]) -> dict[str, Any]:
            leg = _Leg(base, self.path, body, timeout)
            watch.track(leg)
            try:
                return json.loads(leg.open().read())
            except (OSError, http.client.HTTPException):
                if leg.aborted:
                    raise ClientGone from None
                raise
            finally:
                watch.track(None)
                leg.close()

        def _relay(self, watch: _ClientWatch, base: str, body: dict[str, Any]) -> None:
            if not body.get("stream"):
                answer = self._call(watch, base, body)
                self._send(200, json.dumps(answer).encode(), "application/json")
                return
            leg = _Leg(base, self.path, body, timeout)
            watch.track(leg)
            try:
                try:
                    response = leg.open()
                except (OSError, http.client.HTTPException):
                    if leg.aborted:
                        raise ClientGone from None
                    raise
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()  # HTTP/1.0: the stream ends when the proxy closes
                try:
                    while chunk := response.read1(65536):
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except (OSError, http.client.HTTPException):
                    # The client's write failed, or the server's stream broke after
                    # the 200 went out: nothing more can be said to the client.
                    leg.abort()
                    raise ClientGone from None
            finally:
                watch.track(None)
                leg.close()

        def _send(self, status: int, payload: bytes, content_type: str) -> None:
            with contextlib.suppress(OSError):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        def _error(self, status: int, message: str) -> None:
            err = {"error": {"message": message, "type": "ProxyError", "code": status}}
            self._send(status, json.dumps(err).encode(), "application/json")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            if not quiet:
                super().log_message(format, *args)

    return Handler


def serve(
    prefill: str, decode: str, host: str = "127.0.0.1", port: int = 0, **kw: Any
) -> ThreadingHTTPServer:
    """A proxy server (not yet serving: call ``serve_forever``, e.g. in a thread)."""
    server = ThreadingHTTPServer((host, port), make_handler(prefill, decode, **kw))
    server.daemon_threads = True
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", required=True, help="prefill server base URL")
    parser.add_argument("--decode", required=True, help="decode server base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--store",
        action="store_true",
        help="the servers share a KV store (MooncakeStore): no transfer params in the decode leg",
    )
    parser.add_argument("--verbose", action="store_true", help="log every request")
    args = parser.parse_args()
    server = serve(
        args.prefill, args.decode, args.host, args.port, store=args.store, quiet=not args.verbose
    )
    print(f"proxy on http://{args.host}:{args.port} -> {args.prefill} then {args.decode}")
    server.serve_forever()


if __name__ == "__main__":
    main()
