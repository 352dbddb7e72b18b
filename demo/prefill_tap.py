"""A tap between ``vllm-router`` and a prefill server: faults between the two legs.

The router cannot be told to do anything between the prefill answer and the decode
leg, but it waits for the prefill answer before it sends the decode leg. So the
serving tests put this pass-through (aiohttp, a vLLM dependency) where the router
expects the prefill server: every request goes to ``upstream`` unchanged, and when
the prefill leg's answer is back, ``after_prefill(path, body, answer)`` runs (plant
NaN in the producer's tail, kill or freeze the prefill server, rewrite the answer
in place) before the router gets the answer and sends the decode leg. With
``fake`` set, the tap answers prefill legs itself (``fake(body)`` is the answer)
without asking ``upstream``: a prefill side that sends the decode server anywhere.

A connection refused by ``upstream`` (a dead prefill server) is passed on as a
dropped connection, so the router sees what it sees without the tap.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web

HOST = "127.0.0.1"
# (path, prefill-leg body, prefill answer) -> None; may change the answer in place.
AfterPrefill = Callable[[str, dict[str, Any], dict[str, Any]], None]
FakeAnswer = Callable[[dict[str, Any]], dict[str, Any]]
# Headers the tap must not copy: aiohttp sets its own framing.
_HOP = {"content-length", "transfer-encoding", "connection", "host", "keep-alive"}


class PrefillTap:
    """``with PrefillTap(prefill_url) as tap: Router(..., [tap.url], ...)``;
    set ``tap.after_prefill`` / ``tap.fake`` / ``tap.upstream`` at any time."""

    def __init__(self, upstream: str, timeout: float = 600.0) -> None:
        self.upstream = upstream.rstrip("/")
        self.after_prefill: AfterPrefill | None = None
        self.fake: FakeAnswer | None = None
        self._timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner, self.port = self._call(self._start())
        self.url = f"http://{HOST}:{self.port}"

    def _call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> tuple[web.AppRunner, int]:
        self._session = ClientSession(timeout=ClientTimeout(total=self._timeout))
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, HOST, 0)
        await site.start()
        return runner, runner.addresses[0][1]

    def reset(self, upstream: str | None = None) -> None:
        """No hook, no fake; ``upstream`` if given."""
        self.after_prefill = self.fake = None
        if upstream is not None:
            self.upstream = upstream.rstrip("/")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        data = await request.read()
        is_leg = request.method == "POST" and request.path.startswith("/v1/")
        if is_leg and self.fake is not None:
            return web.json_response(self.fake(json.loads(data)))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        try:
            async with self._session.request(
                request.method, self.upstream + request.path_qs, data=data, headers=headers
            ) as upstream:
                payload = await upstream.read()
                status, content_type = upstream.status, upstream.content_type
        except (ClientError, OSError):
            # What the router would have met without the tap: no answer at all.
            if request.transport is not None:
                request.transport.abort()
            raise web.HTTPBadGateway() from None
        hook = self.after_prefill
        if is_leg and status == 200 and hook is not None:
            answer = json.loads(payload)
            body = json.loads(data)
            # Hooks block (an RPC to the server, a barrier with other legs): not here.
            await asyncio.get_running_loop().run_in_executor(None, hook, request.path, body, answer)
            payload = json.dumps(answer).encode()
        return web.Response(status=status, body=payload, content_type=content_type)

    def close(self) -> None:
        if not self._loop.is_running():
            return

        async def stop() -> None:
            await self._runner.cleanup()
            await self._session.close()

        try:
            self._call(stop(), timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> PrefillTap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
