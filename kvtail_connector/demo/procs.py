"""Process bookkeeping: everything the demo and the harness start is stopped on exit.

Objects with a ``close()`` (engine processes, the Mooncake master) register
here; they are closed from ``atexit`` (normal exit, and Ctrl-C, whose
KeyboardInterrupt unwinds to exit) and from a SIGTERM/SIGHUP handler (which
would skip ``atexit``). Children also ask the kernel to kill them when their
parent dies, so even a SIGKILLed parent leaves nothing behind.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
import weakref
from typing import Any

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


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago (all held open while choosing)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until ``host:port`` accepts connections (or ``proc`` exits: error)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{host}:{port} did not open within {timeout} s")
