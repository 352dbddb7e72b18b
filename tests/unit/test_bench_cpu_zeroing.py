"""``benchmarks/bench_cpu_zeroing.py`` on small plain views: its rows run and
count the bytes each call zeroes (checked against the views' own sizes), not
its speed."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_cpu_zeroing as bench  # noqa: E402


def test_rows_count_the_bytes_each_call_zeroes(monkeypatch):
    monkeypatch.setattr(bench, "REPS", 3)
    blocks, heads, slots, content = 96, 2, 4, 8
    views = [torch.ones(blocks, heads, slots, content, dtype=torch.float16) for _ in range(3)]
    rows = bench.bench("view", views, slots, blocks)
    assert [r["zeroes"] for r in rows] == ["1 tail", "16 tails", "64 blocks"]
    page = heads * slots * content * 2
    # 64 whole blocks of 3 layers; one tail zeroes at most a page less one slot.
    assert rows[2]["KiB"] == round(64 * page * 3 / 1024, 1)
    assert 0 < rows[0]["KiB"] * 1024 <= (page - page // slots) * 3
    assert all(r["ours_us"] > 0 and r["floor_us"] > 0 for r in rows)
