"""``vllm-router`` (the vLLM project's Rust P/D router) as a process on loopback.

The serving tests and ``benchmarks/bench_serve.py`` send their clients through the
router users run in front of a P/D pair: ``vllm-router --vllm-pd-disaggregation
--prefill URL --decode URL``. It sends the prefill leg (``max_tokens: 1``, its own
``kv_transfer_params``), then the decode leg with the prefill answer's
``kv_transfer_params`` copied whole, and relays the decode answer.

Start-up and health are tuned for a test bench only where the defaults would make
a test wait: the worker check at start-up runs every second (default 30 s), and the
runtime health check every ``health_interval_s`` (default 60 s), so that a prefill
server killed and restarted is seen down and up again within seconds. A server is
taken out after 5 failed checks in a row (default 3): a server on a loaded 2-core
machine that misses 3 checks in a row (5 s each) is busy, not dead. Everything
else (retries, circuit breaker, timeouts) is the router's default.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from demo import procs

HOST = "127.0.0.1"


class RouterError(RuntimeError):
    """The router did not start, died, or never saw its workers healthy."""


def router_executable() -> str:
    """The ``vllm-router`` console script next to this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.exists():
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise RouterError("vllm-router is not installed: pip install vllm-router==0.1.17")
    return found


class Router:
    """``with Router("name", [prefill_url], [decode_url], log_dir) as r: r.url ...``

    ``start()`` returns once ``/readiness`` reports every worker healthy.
    """

    def __init__(
        self,
        name: str,
        prefill: Sequence[str],
        decode: Sequence[str],
        log_dir: str | os.PathLike[str],
        *,
        health_interval_s: int = 2,
        args: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.prefill, self.decode = list(prefill), list(decode)
        self.health_interval_s = health_interval_s
        self.args = list(args)
        self.log_path = Path(log_dir) / f"router-{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.port, self.metrics_port = procs.free_ports(2)
        self.url = f"http://{HOST}:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        cmd = [router_executable(), "--vllm-pd-disaggregation"]
        for url in self.prefill:
            cmd += ["--prefill", url]
        for url in self.decode:
            cmd += ["--decode", url]
        cmd += ["--host", HOST, "--port", str(self.port)]
        cmd += ["--prometheus-host", HOST, "--prometheus-port", str(self.metrics_port)]
        cmd += ["--worker-startup-check-interval", "1"]
        cmd += ["--health-check-interval-secs", str(self.health_interval_s)]
        cmd += ["--health-failure-threshold", "5"]
        return cmd + self.args

    def start(self, timeout: float = 60.0) -> Router:
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== {' '.join(self.command())}\n".encode())
            log.flush()
            procs.register(self)
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=procs.die_with_parent  # noqa: PLW1509
                if threading.current_thread() is threading.main_thread()
                else None,
            )
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.close()
            raise
        return self

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def readiness(self) -> dict[str, Any] | None:
        """The router's ``/readiness`` (healthy and total workers per side), or None
        while it does not answer."""
        try:
            with urllib.request.urlopen(f"{self.url}/readiness", timeout=5) as r:  # noqa: S310
                body = r.read()
        except urllib.error.HTTPError as e:  # 503 while a side has no healthy worker
            try:
                body = e.read()
            except OSError:
                return None
        except OSError:
            return None
        try:
            state = json.loads(body or b"null")
        except ValueError:
            return None
        return state if isinstance(state, dict) else None

    def prefill_down(self) -> bool:
        """The router answered and counts no healthy prefill server (its health
        check took it out); no answer is not an answer."""
        state = self.readiness()
        return state is not None and (state.get("prefill") or {}).get("healthy") == 0

    def ready(self) -> bool:
        state = self.readiness()
        if not state:
            return False
        sides = [state.get("prefill") or {}, state.get("decode") or {}]
        return all(s.get("total") and s.get("healthy") == s.get("total") for s in sides)

    def wait_ready(self, timeout: float = 60.0) -> Router:
        """Until every worker is healthy in the router's eyes (after a prefill server
        came back, the router needs two health checks in a row to route to it)."""
        procs.wait_for(
            self.ready,
            timeout,
            f"router {self.name}: workers healthy",
            dead=lambda: None if self.alive else f"router {self.name} exited",
            detail=lambda: f"last /readiness: {self.readiness()}\n{self.log_tail()}",
        )
        return self

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return f"--- {self.log_path} ---\n" + "\n".join(lines[-n:])

    def close(self, timeout: float = 10.0) -> None:
        procs.unregister(self)
        if self._proc is not None:
            procs.stop_process(self._proc, timeout)

    def __enter__(self) -> Router:
        return self.start() if self._proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()
