"""The package imports from a plain checkout the same way as when installed.

Benchmarks and out-of-tree runs put the checkout on ``PYTHONPATH``; nothing may
depend on the installer's path mapping (an editable finder, ``package_dir``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.not_installed import hide

REPO = Path(__file__).resolve().parents[2]

# A fresh interpreter with every installer-provided finder removed, so only
# the checkout on sys.path can satisfy the imports.
_PROBE = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in repr(h).lower()]
sys.path.insert(0, sys.argv[1])
import kvtail_connector.connectors as adapters
from kvtail_connector.connectors.nixl import NixlAdapter
print(adapters.__file__)
print(NixlAdapter.__module__)
"""


def test_adapters_import_from_a_checkout_without_the_installer_mapping() -> None:
    r = subprocess.run(
        [sys.executable, "-c", _PROBE, str(REPO)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    path, module = r.stdout.split()
    assert Path(path).resolve() == (REPO / "kvtail_connector" / "connectors" / "__init__.py")
    assert module == "kvtail_connector.connectors.nixl"


# Run after hide("vllm").
_WORKER_PROBE = """
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
from without_vllm import install_if_absent
assert install_if_absent()
import kvtail_connector.core.worker, kvtail_connector.core.metadata
print(" ".join(_NOT_INSTALLED.asked))
"""


def test_the_worker_side_imports_without_vllm() -> None:
    # The GPU benchmarks run the worker where the package's own dependencies
    # are installed but vLLM is not (the benchmarks' stand-ins,
    # benchmarks/without_vllm.py, provide the few names it imports).
    r = subprocess.run(
        [sys.executable, "-c", hide("vllm") + _WORKER_PROBE, str(REPO)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    # Only install_if_absent's own ``import vllm``: no vLLM module beyond the
    # stand-ins was asked for (not even in a try).
    assert r.stdout.split() == ["vllm"]
