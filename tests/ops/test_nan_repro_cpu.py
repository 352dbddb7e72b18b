"""CPU run of ``benchmarks/nan_repro.py`` (tiny sizes), and proof that it can fail."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import kvtail_connector

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "nan_repro.py"


@pytest.fixture(scope="module")
def nan_repro():
    spec = importlib.util.spec_from_file_location("nan_repro", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["nan_repro"] = mod  # dataclasses resolve annotations through it
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("nan_repro", None)


def _two_cases(mod):
    # One plain and one DCP case keep the failing runs short.
    return (mod.CASES[1], mod.CASES[3])


def test_main_passes_on_cpu(nan_repro, tmp_path, capsys):
    out = tmp_path / "out.json"
    assert nan_repro.main(["--device", "cpu", "--size", "tiny", "--json", str(out)]) == 0
    assert "ALL PASS" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["ok"] and len(result["rows"]) == len(nan_repro.CASES)
    for row in result["rows"]:
        assert all(row["checks"].values()), row["checks"]
        assert row["stale_tail_nan_inf"] > 0 and row["nan_outputs_before"] > 0
        assert row["nan_outputs_after"] == 0 and row["bit_identical_to_clean"]


def test_fails_without_zeroing(nan_repro, monkeypatch):
    monkeypatch.setattr(nan_repro, "zero_kv_blocks", lambda *a, **k: None)
    result = nan_repro.run("cpu", "tiny", 0, cases=_two_cases(nan_repro))
    assert not result["ok"]
    for row in result["rows"]:
        assert row["nan_outputs_after"] > 0
        assert not row["checks"]["output bit-identical to clean"]
        assert not row["checks"]["zeroed pool == clean pool (byte for byte)"]


def test_fails_when_zeroing_too_much(nan_repro, monkeypatch):
    def whole_blocks(caches, block_ids=(), tails=(), *, pages_per_block=1):
        blocks = sorted({b for b, _ in tails})
        kvtail_connector.zero_kv_blocks(caches, blocks, pages_per_block=pages_per_block)

    monkeypatch.setattr(nan_repro, "zero_kv_blocks", whole_blocks)
    result = nan_repro.run("cpu", "tiny", 0, cases=_two_cases(nan_repro))
    assert not result["ok"]
    for row in result["rows"]:
        assert row["bytes_changed_outside_tails"] > 0
        assert not row["checks"]["no byte outside the tails changed"]


@pytest.fixture(scope="module")
def nan_repro_kernels(nan_repro):
    path = SCRIPT.with_name("nan_repro_kernels.py")
    spec = importlib.util.spec_from_file_location("nan_repro_kernels", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sdpa_and_flex_read_the_stale_nan_and_the_zeroed_pages_match_clean(nan_repro_kernels):
    result = nan_repro_kernels.run("cpu", "tiny", 0)
    assert result["ok"], nan_repro_kernels.table(result)
    assert {r["kernel"] for r in result["rows"]} == {"sdpa-math", "flex"}
    for row in result["rows"]:
        assert row["nan_before"] > 0 and row["nan_after"] == 0 and row["bit_identical"]


def test_kernel_repro_fails_without_zeroing(nan_repro_kernels, monkeypatch):
    monkeypatch.setattr(nan_repro_kernels, "zero_kv_blocks", lambda *a, **k: None)
    result = nan_repro_kernels.run("cpu", "tiny", 0)
    assert not result["ok"]
    assert all(r["nan_after"] > 0 for r in result["rows"])
