"""The core stands without the opt-in features: with ``kvtail_connector/extras``
removed, the wrapper still zeroes tails, handles MoRIIO READs and contains
failures, and the scheduler suite passes (tests that name the features, or
are marked ``extras``, are left out by ``tests/conftest.py``); the settings
that need the features are refused at start-up, naming the field."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvtail_connector
from tests.helpers.importable import importable

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(kvtail_connector.__file__).parent

pytestmark = pytest.mark.skipif(not importable("vllm"), reason="the core suite needs vLLM")


def _core_only(tmp_path: Path) -> Path:
    """A checkout whose package lacks ``extras/``, the tests those of this one."""
    shutil.copytree(
        PACKAGE,
        tmp_path / "kvtail_connector",
        ignore=shutil.ignore_patterns("extras", "__pycache__"),
    )
    for shared in ("tests", "demo"):
        (tmp_path / shared).symlink_to(REPO / shared)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


# An editable install finds kvtail_connector's submodules in the checkout
# whatever the path says (setuptools' _EditableFinder, last on sys.meta_path):
# without it, the copy's package is the only one.
_NO_EDITABLE = (
    "import sys; sys.meta_path[:] = "
    "[f for f in sys.meta_path if 'Editable' not in getattr(f, '__name__', '')]; "
)


def _run(root: Path, code: str, timeout: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", _NO_EDITABLE + code],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_core_suite_passes_without_the_extras(tmp_path):
    root = _core_only(tmp_path)
    where = _run(
        root,
        "import importlib.util, kvtail_connector; print(kvtail_connector.__file__); "
        "print(importlib.util.find_spec('kvtail_connector.extras'))",
        timeout=120,
    )
    assert where.stdout.split() == [str(root / "kvtail_connector" / "__init__.py"), "None"]
    run = _run(
        root,
        "import pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
        "'tests/scheduler', 'tests/unit/test_policy.py']))",
        timeout=1800,
    )
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, summary
    # The core's own suites ran: tails, READs, containment, the lifecycle.
    passed = int(summary.split(" passed")[0].split()[-1])
    assert passed > 300, summary


def test_the_settings_that_need_the_extras_are_refused_without_them():
    from kvtail_connector.config import KVTailConfig
    from kvtail_connector.core.policy import resolve_policy

    facts = dict(
        needs_zeroing=True,
        has_mamba=False,
        is_consumer=True,
        sync_read=False,
        writes_past_the_fence=False,
        reads_may_land_per_layer=False,
        is_producer=True,
        carries_producer_tail=True,
        producer_hook="wait_for_save",
    )
    for field, value in (
        ("vouch_tails", "trust"),
        ("verify_kv", "digest"),
        ("verify_kv", "sample"),  # set by name: asked for
        ("verify_kv_every", 8),
        ("entry_key_env", "KVTAIL_KEY"),
    ):
        cfg = KVTailConfig.from_extra_config({"backend": "NixlConnector", field: value})
        with pytest.raises(ValueError, match=f"kv_connector_extra_config.{field}"):
            resolve_policy(cfg, **facts, extras_installed=False)
    # The defaults (verify_kv "sample" unset) and auto turn the features off instead.
    for extra in ({}, {"verify_kv": "auto"}):
        cfg = KVTailConfig.from_extra_config({"backend": "NixlConnector", **extra})
        policy = resolve_policy(cfg, **facts, extras_installed=False)
        assert policy.zeroes_tails and not (
            policy.checks_claims
            or policy.vouches_for_tails
            or policy.digests_prompts
            or policy.verifies_loads
        ), extra
        assert policy.verify_kv_off == "kvtail_connector/extras is not installed"
        with_extras = resolve_policy(cfg, **facts)
        assert with_extras.checks_claims and with_extras.verifies_loads
        assert with_extras.digests_prompts
