"""Faults to inject between the two legs of a P/D request, and fake prefill sides.

The ``after_prefill`` hooks run in :class:`~demo.prefill_tap.PrefillTap`
between the prefill leg's answer and the moment ``vllm-router`` gets it (and sends
the decode leg):

* :class:`PoisonTail` plants a value (NaN) in the producer's never-written tail
  slots of the request's last block, as the in-process e2e tests do;
* :class:`CorruptSlot` changes one written slot of the producer's KV (valid KV,
  after anything P computed over it, its digest included): a transfer fault;
* :class:`AfterPrefill` runs an action (kill or freeze the prefill server) once
  ``parties`` requests have all finished their prefill leg, so several decode
  servers can meet the same fault at once.

:class:`BlackHole` is a prefill side that never answers the NIXL handshake, and
:func:`fake_prefill` prefill answers (``PrefillTap.fake``) that send the decode
server to it (or anywhere else).
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

from demo.api_server import APIServer
from demo.prefill_tap import FakeAnswer


def prompt_tokens(prefill_answer: dict[str, Any]) -> int:
    return int(prefill_answer["usage"]["prompt_tokens"])


class PoisonTail:
    """Fill the producer's never-written tail slots of each request's last block
    with ``value``, after its prefill and before the decode server pulls.

    ``planted`` counts (layer, block, slot) triples per request, in order.
    """

    def __init__(self, prefill: APIServer, block_size: int, value: float = float("nan")) -> None:
        self.prefill = prefill
        self.block_size = block_size
        self.value = value
        self.planted: list[int] = []
        self._lock = threading.Lock()

    def __call__(self, path: str, body: dict[str, Any], answer: dict[str, Any]) -> None:
        n = prompt_tokens(answer)
        blocks = answer["kv_transfer_params"]["remote_block_ids"][0]  # the attention group
        written = n % self.block_size
        planted = 0
        if written:
            last = blocks[(n - 1) // self.block_size]
            planted = self.prefill.fill_slots([last], written, None, self.value)
        with self._lock:
            self.planted.append(planted)


class CorruptSlot:
    """Set prompt token ``token``'s slot of the producer's KV, in every attention
    layer, to ``value`` after its prefill and before the decode server pulls.

    ``answers`` keeps each prefill leg's answer (its ``kv_transfer_params``: the
    entry and digest P sent), in order; ``planted`` the (layer, slot) pairs set.
    """

    def __init__(self, prefill: APIServer, block_size: int, token: int, value: float) -> None:
        self.prefill = prefill
        self.block_size = block_size
        self.token = token
        self.value = value
        self.answers: list[dict[str, Any]] = []
        self.planted: list[int] = []
        self._lock = threading.Lock()

    def __call__(self, path: str, body: dict[str, Any], answer: dict[str, Any]) -> None:
        if prompt_tokens(answer) <= self.token:
            raise ValueError(f"prompt of {prompt_tokens(answer)} tokens has no token {self.token}")
        blocks = answer["kv_transfer_params"]["remote_block_ids"][0]  # the attention group
        block, slot = divmod(self.token, self.block_size)
        planted = self.prefill.fill_slots([blocks[block]], slot, slot + 1, self.value)
        with self._lock:
            self.answers.append(answer)
            self.planted.append(planted)


class AfterPrefill:
    """Run ``action`` once, when the first ``parties`` requests have all had their
    prefill leg answered; each of them then goes on to its decode leg. Later
    requests pass straight through."""

    def __init__(self, action: Callable[[], None], parties: int = 1, timeout: float = 600.0):
        self._barrier = threading.Barrier(parties, action=action, timeout=timeout)
        self._parties = parties
        self._arrived = 0
        self._lock = threading.Lock()

    def __call__(self, path: str, body: dict[str, Any], answer: dict[str, Any]) -> None:
        with self._lock:
            self._arrived += 1
            mine = self._arrived <= self._parties
        if mine:
            self._barrier.wait()


class BlackHole:
    """A TCP listener that accepts connections and never says a word: a NIXL
    side channel that never answers the handshake."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._held: list[socket.socket] = []
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._held.append(conn)  # kept open, never read from or written to

    def close(self) -> None:
        self._stop = True
        for s in [self._sock, *self._held]:
            s.close()


def fake_prefill(params: Callable[[dict[str, Any]], dict[str, Any]]) -> FakeAnswer:
    """A prefill side that computes nothing (``PrefillTap.fake``): every prefill leg
    is answered with one token and ``params(body)`` as its ``kv_transfer_params``."""

    def answer(body: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": "fake",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1},
            "kv_transfer_params": params(body),
        }

    return answer


def nixl_params_to(host: str, port: int, block_ids: list[int]) -> dict[str, Any]:
    """``kv_transfer_params`` naming a NIXL producer at ``host:port`` that nobody
    has seen before (a fresh engine id, so the decode server must handshake)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(block_ids)],
        "remote_engine_id": f"fake-{uuid.uuid4()}",
        "remote_request_id": f"fake-{uuid.uuid4()}",
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
    }
