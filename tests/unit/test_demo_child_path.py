"""The demo is not installed: a Python child of the harness imports it through the
PYTHONPATH the harness gives it, from any working directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("psutil")
pytest.importorskip("prometheus_client")

from demo import procs  # noqa: E402
from demo.api_server import SITE_DIR, SLOT_RPC, APIServer, ServerSpec  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# What an API server process imports of the demo before and while it serves: the
# sitecustomize at start-up, then --worker-extension-cls by its qualified name.
_CHILD = """
import importlib, json, sys
module, _, name = sys.argv[1].rpartition(".")
ext = getattr(importlib.import_module(module), name)
print(json.dumps({
    "demo": sys.modules["demo"].__file__,
    "sitecustomize": sys.modules["sitecustomize"].__file__,
    "nixl_progress_loaded": "demo.nixl_progress" in sys.modules,
    "extension": sys.modules[ext.__module__].__file__,
}))
"""


def test_an_api_server_environment_imports_the_demo_from_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without a PYTHONPATH of the parent's own, only the harness's entries can find it.
    monkeypatch.delenv("PYTHONPATH", raising=False)
    env = APIServer(ServerSpec("p", "model"), tmp_path).environment()
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, SLOT_RPC],
        env=env,
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.splitlines()[-1])
    assert Path(seen["demo"]) == REPO / "demo" / "__init__.py"
    assert Path(seen["sitecustomize"]) == REPO / "demo" / "site" / "sitecustomize.py"
    assert seen["nixl_progress_loaded"]
    assert Path(seen["extension"]) == REPO / "demo" / "slot_rpc.py"


def test_child_pythonpath_keeps_the_parents_entries_ahead_of_the_checkout() -> None:
    env = {"PYTHONPATH": os.pathsep.join(["/first/tree", "", "/second"])}
    got = procs.child_pythonpath(env, SITE_DIR).split(os.pathsep)
    assert got == [str(SITE_DIR), "/first/tree", "/second", str(REPO)]
    # Named twice, kept once, at its first place.
    twice = {"PYTHONPATH": os.pathsep.join([str(REPO), "/x"])}
    assert procs.child_pythonpath(twice).split(os.pathsep) == [str(REPO), "/x"]
