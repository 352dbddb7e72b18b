"""The example proxy (``examples/proxy.py``) serving in a thread of this process.

The serving tests and ``benchmarks/bench_serve.py`` send their clients through
the very proxy users are shown, started here on a free loopback port, with an
optional ``after_prefill`` hook (poison a tail, kill the prefill server) run
between the two legs.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

PROXY_PATH = Path(__file__).resolve().parents[2] / "examples" / "proxy.py"
_module: ModuleType | None = None


def proxy_module() -> ModuleType:
    """``examples/proxy.py``, imported by path (it is a script, not a package module)."""
    global _module
    if _module is None:
        if not PROXY_PATH.exists():
            raise FileNotFoundError(f"{PROXY_PATH} not found: the serving harness needs a checkout")
        spec = importlib.util.spec_from_file_location("kvtail_example_proxy", PROXY_PATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _module = module
    return _module


class RunningProxy:
    """``with RunningProxy(prefill_url, decode_url) as proxy: proxy.url ...``"""

    def __init__(self, prefill: str, decode: str, **kw: Any) -> None:
        self._server = proxy_module().serve(prefill, decode, "127.0.0.1", 0, **kw)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> RunningProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
