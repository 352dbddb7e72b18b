"""Process bookkeeping: everything the demo and the harness start is stopped on exit.

Objects with a ``close()`` (engine processes, API servers, routers, the Mooncake
master) register here; they are closed from ``atexit`` (normal exit, and Ctrl-C, whose
KeyboardInterrupt unwinds to exit) and from a SIGTERM/SIGHUP handler (which
would skip ``atexit``). Children also ask the kernel to kill them when their
parent dies, so even a SIGKILLed parent leaves nothing behind.

Processes are found and awaited with ``psutil`` (a vLLM dependency): the members of
a process group, and their exit, without walking ``/proc`` or sleeping in loops.
What stays a poll is waiting for a *service* to reach a state (a port open, an HTTP
endpoint saying ready): :func:`wait_for`, the one such loop of the harness, with a
deadline and an error naming what was awaited and what was last seen.

The demo is not installed: :func:`child_pythonpath` is the PYTHONPATH under which a
Python child (an API server and the processes it starts) imports it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import psutil

T = TypeVar("T")

# The folder holding the ``demo`` package: the repository root. The demo is not
# installed (it is not in the wheel), so a Python process the harness starts finds it,
# and the modules its command line names (``--worker-extension-cls demo.slot_rpc...``,
# the ``sitecustomize``), only through PYTHONPATH: see :func:`child_pythonpath`.
DEMO_ROOT = Path(__file__).resolve().parent.parent


def child_pythonpath(env: Mapping[str, str], *first: str | os.PathLike[str]) -> str:
    """The PYTHONPATH for a Python child process of the harness: ``first``, then
    ``env``'s own PYTHONPATH (what the parent was told to import first stays first),
    then :data:`DEMO_ROOT`."""
    entries = [*map(str, first), *env.get("PYTHONPATH", "").split(os.pathsep), str(DEMO_ROOT)]
    return os.pathsep.join(dict.fromkeys(e for e in entries if e))


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # objects with .close()
_cleanup_lock = threading.Lock()
_handlers_installed = False


def close_all() -> None:
    """Close every registered object (idempotent)."""
    with _cleanup_lock:
        for obj in list(_LIVE):
            with contextlib.suppress(Exception):
                obj.close()


def _on_signal(signum: int, frame: Any) -> None:
    close_all()
    # Re-deliver with the default action so the exit status says "killed by SIGTERM".
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(close_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _on_signal)


def register(obj: Any) -> None:
    """Have ``obj.close()`` called on exit, unless ``unregister`` ran first."""
    _install_handlers()
    _LIVE.add(obj)


def unregister(obj: Any) -> None:
    _LIVE.discard(obj)


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux only)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


# Ports this process has handed out: a port is never handed out twice, even after
# its first owner closed it, so two engines started together cannot be given the same one.
_HANDED_OUT: set[int] = set()
_ports_lock = threading.Lock()
_ports_rng = random.Random(int.from_bytes(os.urandom(8), "little"))


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _listen_ports() -> range:
    """Ports outside the kernel's ephemeral range. A port chosen from the ephemeral range
    may be taken, between choosing and binding, by any ``bind(0)`` or outgoing connection
    (an engine's gloo, ZMQ or HTTP sockets): that made a NIXL side channel fail with
    "Address already in use". The kernel never hands out a port outside that range."""
    lo, hi = _ephemeral_range()
    if lo - 10_000 >= 2_000:
        return range(10_000, lo)
    return range(hi + 1, 65_536)


def _bindable(port: int, host: str) -> bool:
    # The wildcard address also catches a listener on any other local address.
    for addr in {host, "0.0.0.0"}:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, port))
            except OSError:
                return False
    return True


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports to listen on: bindable now, outside the kernel's ephemeral
    range, and never returned before by this process. The scan starts at a random port
    so that two processes choosing at once rarely meet."""
    pool = _listen_ports()
    with _ports_lock:
        start = _ports_rng.randrange(len(pool))
        chosen: list[int] = []
        for i in range(len(pool)):
            port = pool[(start + i) % len(pool)]
            if port in _HANDED_OUT or not _bindable(port, host):
                continue
            chosen.append(port)
            if len(chosen) == n:
                _HANDED_OUT.update(chosen)
                return chosen
    raise RuntimeError(f"no {n} free ports in {pool.start}-{pool.stop - 1} on {host}")


def wait_for(
    pred: Callable[[], T],
    timeout: float,
    what: str,
    *,
    interval: float = 0.25,
    dead: Callable[[], str | None] | None = None,
    detail: Callable[[], str] | None = None,
) -> T:
    """Call ``pred`` until it returns something truthy, and return that. Raises
    ``TimeoutError`` after ``timeout`` s, or ``RuntimeError`` as soon as ``dead()``
    names a reason to stop (the process meant to answer exited); both name ``what``,
    ``pred``'s last value and ``detail()`` (a log tail)."""
    deadline = time.monotonic() + timeout
    while True:
        last = pred()
        if last:
            return last
        reason = dead() if dead is not None else None
        if reason or time.monotonic() > deadline:
            more = f"\n{detail()}" if detail is not None else ""
            why = reason or f"not reached within {timeout} s"
            err = RuntimeError if reason else TimeoutError
            raise err(f"{what}: {why} (last: {last!r}){more}")
        time.sleep(interval)


def wait_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until ``host:port`` accepts connections (or ``proc`` exits: error)."""

    def accepts() -> bool:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return True
        return False

    def exited() -> str | None:
        if proc is not None and proc.poll() is not None:
            return f"process exited with {proc.returncode}"
        return None

    wait_for(accepts, timeout, f"{host}:{port} open", interval=0.1, dead=exited)


def group_processes(pgid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of process group ``pgid``."""
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def stop_group(proc: subprocess.Popen, sig: int, timeout: float) -> None:
    """Send ``sig`` to the process group led by ``proc`` and wait until none of it
    lives; SIGKILL what is left after ``timeout`` s (and wait 10 s more for that)."""
    members = group_processes(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    _, alive = psutil.wait_procs(members, timeout=timeout)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(0 if not alive else 0.1)
    if alive or proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM one process, SIGKILL it after ``timeout`` s; reaped either way."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
