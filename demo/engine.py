"""The parent's handle on one engine process (spawned; see ``server``).

Each engine lives in its own process, because two engines (and two NIXL
agents) cannot share one interpreter. The parent talks to it over a
``multiprocessing`` pipe: one command at a time, each answered with
``("ok", result)`` or ``("err", traceback)``.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from demo import procs
from demo.records import (
    EngineCallError,
    EngineConfig,
    EngineError,
    GenResult,
    KVInfo,
)
from demo.server import engine_main


class EngineProcess:
    """One vLLM engine in its own process. Use as a context manager, or call close()."""

    def __init__(self, cfg: EngineConfig, log_dir: str | os.PathLike[str] | None = None) -> None:
        self.cfg = cfg
        log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="kvtail-engines-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{cfg.name}.log"
        self._proc: Any = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._idle = False  # ready and not inside a call: it will answer "close"
        self.startup_s: float | None = None

    # --- life cycle -------------------------------------------------------
    def start(self) -> EngineProcess:
        """Spawn the process; returns at once (call wait_ready)."""
        # A spawned child gets the parent's sys.path before it unpickles engine_main,
        # so it imports this (uninstalled) demo from where the parent did.
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=engine_main,
            args=(child, self.cfg, str(self.log_path)),
            name=f"kvtail-{self.cfg.name}",
            daemon=False,
        )
        procs.register(self)
        self._proc.start()
        child.close()
        self._conn = parent
        return self

    def wait_ready(self, timeout: float = 300.0) -> EngineProcess:
        info = self._recv(timeout, what="start-up")
        self.startup_s = info["startup_s"]
        self._idle = True
        return self

    def close(self, timeout: float = 15.0) -> None:
        """Stop the engine: politely (engine shutdown, then os._exit) when it is idle;
        at once (SIGTERM, then SIGKILL) when it is still starting or busy, e.g. after
        Ctrl-C interrupted a call - it could not read the request to close."""
        proc, conn, idle = self._proc, self._conn, self._idle
        self._proc = self._conn = None
        self._idle = False
        procs.unregister(self)
        if proc is None:
            return
        if conn is not None:
            if idle:
                with contextlib.suppress(Exception):
                    conn.send(("close", (), {}))
                    if conn.poll(timeout):
                        conn.recv()
            with contextlib.suppress(Exception):
                conn.close()
        proc.join(timeout if idle else 0.1)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)

    def __enter__(self) -> EngineProcess:
        if self._proc is None:
            self.start().wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    # --- RPC --------------------------------------------------------------
    def _recv(self, timeout: float, what: str) -> Any:
        assert self._conn is not None and self._proc is not None, "engine not started"
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if not self._proc.is_alive():
                raise EngineError(
                    f"{self.cfg.name}: process died (exit {self._proc.exitcode}) during {what}\n"
                    f"--- {self.log_path} ---\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise EngineError(
                    f"{self.cfg.name}: {what} timed out after {timeout} s\n"
                    f"--- {self.log_path} ---\n{self.log_tail()}"
                )
        status, payload = self._conn.recv()
        if status != "ok":
            raise EngineCallError(
                f"{self.cfg.name}: {what} failed:\n{payload}\n"
                f"--- {self.log_path} ---\n{self.log_tail()}"
            )
        return payload

    def call(self, method: str, *args: Any, timeout: float = 120.0, **kwargs: Any) -> Any:
        with self._lock:
            assert self._conn is not None and self._idle, "engine not started or busy"
            self._idle = False
            self._conn.send((method, args, kwargs))
            try:
                result = self._recv(timeout, what=method)
            except EngineCallError:
                self._idle = True  # it answered: still serving
                raise
            self._idle = True  # not reached if it died or the wait was interrupted
            return result

    # --- typed helpers ----------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        kv_transfer_params: Sequence[dict[str, Any] | None] | None = None,
    ) -> list[GenResult]:
        """Greedy generation (temperature 0, ignore_eos) of token-id prompts."""
        raw = self.call(
            "generate",
            [list(p) for p in prompts],
            max_tokens,
            None if kv_transfer_params is None else list(kv_transfer_params),
        )
        return [GenResult(**r) for r in raw]

    def kv_info(self) -> KVInfo:
        return KVInfo(**self.call("kv_info"))

    def kvtail_counters(self) -> dict[str, int]:
        """The wrapper's cumulative counters (``tail_bytes_zeroed``, ``stale_nonzero_bytes``...)."""
        return self.call("kvtail_counters")

    def fill_slots(
        self, block_ids: Sequence[int], start: int, stop: int | None = None, value: float = math.nan
    ) -> int:
        """Set slots [start, stop) of ``block_ids`` in every attention layer; returns
        the (layer, block, slot) triples written."""
        return int(self.call("rpc", "fill_slots", list(block_ids), start, stop, value))

    def fill_state(self, block_ids: Sequence[int], state: int, value: float) -> int:
        """Set element 0 of state ``state`` of ``block_ids`` in every state layer;
        returns the (layer, block) pairs written."""
        return int(self.call("rpc", "fill_state", list(block_ids), state, value))

    def fill_all(self, value: float = math.nan) -> int:
        return int(self.call("rpc", "fill_all", value))

    def scrub_nan(self) -> int:
        return int(self.call("rpc", "scrub_nan"))

    def slot_nan_counts(self, block_ids: Sequence[int]) -> dict[str, dict[int, list[int]]]:
        """Per layer, per block: NaN elements in each slot."""
        return self.call("rpc", "slot_counts", list(block_ids), "nan")

    def slot_nonzero_counts(self, block_ids: Sequence[int]) -> dict[str, dict[int, list[int]]]:
        """Per layer, per block: non-zero elements in each slot."""
        return self.call("rpc", "slot_counts", list(block_ids), "nonzero")

    def nan_census(self) -> dict[int, int]:
        """Block id -> NaN elements, for the blocks that hold any."""
        return self.call("rpc", "nan_census")


def start_engines(
    cfgs: Sequence[EngineConfig],
    log_dir: str | os.PathLike[str] | None = None,
    timeout: float = 300.0,
) -> list[EngineProcess]:
    """Start several engines at once (their imports overlap) and wait for all."""
    engines = [EngineProcess(c, log_dir) for c in cfgs]
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready(timeout)
    except BaseException:
        for e in engines:
            e.close()
        raise
    return engines
