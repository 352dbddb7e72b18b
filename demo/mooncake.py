"""A local ``mooncake_master`` for MooncakeStoreConnector engines on loopback."""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from demo import procs
from demo.prom_text import parse_metrics

_LOOKUP_CHANNELS = itertools.count()
_handed_out: list[int] = []


def private_lookup_channel() -> int:
    """A ``lookup_rpc_port`` that no other MooncakeStore engine on this host uses.

    MooncakeStoreConnector's scheduler asks its worker for store hits over a ZMQ
    IPC socket whose path holds only ``lookup_rpc_port`` (default 0), the host
    name and the DP rank (vLLM's ``get_zmq_rpc_path_lookup``,
    ``mooncake/store/worker.py``), and every worker unlinks and rebinds that path
    when it starts. Engines started together with the default therefore share one
    socket: an engine's lookups can be answered by another engine's worker, which
    asks its own master, so a decode engine of one pair reports the hits of the
    other pair's store (none yet: 0 tokens loaded). The number names a socket file,
    not a TCP port; the process id and a counter keep every engine's apart.
    """
    channel = os.getpid() * 100_000 + next(_LOOKUP_CHANNELS) % 100_000
    if not _handed_out:
        atexit.register(_remove_lookup_sockets)
    _handed_out.append(channel)
    return channel


def _remove_lookup_sockets() -> None:
    """Unlink the socket files of the channels handed out: the engines end with
    ``os._exit``, before their worker would unlink its own."""
    base = Path(os.environ.get("VLLM_RPC_BASE_PATH", tempfile.gettempdir()))
    for channel in _handed_out:
        for path in base.glob(f"lookup_rpc_port_{channel}_host_*"):
            path.unlink(missing_ok=True)


def find_mooncake_master() -> str:
    cand = Path(sys.executable).parent / "mooncake_master"
    if cand.exists():
        return str(cand)
    found = shutil.which("mooncake_master")
    if found:
        return found
    raise FileNotFoundError(
        "mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)"
    )


class MooncakeMaster:
    """A local ``mooncake_master`` (RPC + HTTP metadata + metrics on 127.0.0.1 free ports)
    and the JSON config file that MooncakeStoreConnector reads (MOONCAKE_CONFIG_PATH)."""

    def __init__(self, workdir: str | os.PathLike[str] | None = None) -> None:
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="kvtail-mc-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.rpc_port, self.http_port, self.metrics_port = procs.free_ports(3)
        self.config_path = self.workdir / "mooncake.json"
        self.log_path = self.workdir / "mooncake_master.log"
        self._proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> MooncakeMaster:
        cmd = [
            find_mooncake_master(),
            "-rpc_address=127.0.0.1",
            f"-rpc_port={self.rpc_port}",
            "-enable_http_metadata_server=true",
            "-http_metadata_server_host=127.0.0.1",
            f"-http_metadata_server_port={self.http_port}",
            "-metrics_host=127.0.0.1",
            f"-metrics_port={self.metrics_port}",
            "-default_kv_lease_ttl=5000",
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        procs.register(self)
        self._proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=procs.die_with_parent,  # noqa: PLW1509 - no threads of ours run the fork
        )
        log.close()
        try:
            procs.wait_port("127.0.0.1", self.rpc_port, timeout, self._proc)
            procs.wait_port("127.0.0.1", self.http_port, timeout, self._proc)
        except BaseException:
            self.close()
            raise
        self.config_path.write_text(
            json.dumps(
                {
                    "local_hostname": "127.0.0.1",
                    "metadata_server": f"http://127.0.0.1:{self.http_port}/metadata",
                    "master_server_address": f"127.0.0.1:{self.rpc_port}",
                    "protocol": "tcp",
                    "device_name": "",
                    "global_segment_size": "256MB",
                    "local_buffer_size": "64MB",
                }
            )
        )
        return self

    @property
    def env(self) -> dict[str, str]:
        return {"MOONCAKE_CONFIG_PATH": str(self.config_path)}

    def metrics(self) -> dict[str, float]:
        """The master's Prometheus samples, summed over labels (sample name -> value)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback
            samples = parse_metrics(r.read().decode())
        return {name: sum(v for _, v in rows) for name, rows in samples.items()}

    def puts(self) -> tuple[float, float]:
        """(puts started, puts ended or revoked) according to the master."""
        m = self.metrics()

        def total(*names: str) -> float:
            return sum(m.get(n, 0.0) for n in names)

        started = total("master_put_start_requests_total", "master_batch_put_start_items_total")
        ended = total(
            "master_put_end_requests_total",
            "master_batch_put_end_items_total",
            "master_put_revoke_requests_total",
            "master_batch_put_revoke_items_total",
        )
        return started, ended

    def close(self) -> None:
        proc, self._proc = self._proc, None
        procs.unregister(self)
        if proc is not None:
            procs.stop_process(proc, 10.0)

    def __enter__(self) -> MooncakeMaster:
        return self.start() if self._proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()
