"""``benchmarks/bench_worker_gpu.py`` on the CPU, as the GPU machine sees the imports.

That machine has the package's dependencies but no vLLM: the benchmark
imports the worker side through ``benchmarks/without_vllm.py``'s stand-ins,
and every path it measures must run without any other vLLM code. A fresh
interpreter with vLLM hidden imports the benchmark and runs those paths on CPU
caches (small pages; this checks the paths, not their speed): main()'s
completion (the stale slots checked byte for byte), the MoRIIO READ tails, the
producer step, the digest round (the benchmark asserts P's and D's digests
match) and the unsampled step with and without the digest wired in.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.not_installed import hide

REPO = Path(__file__).resolve().parents[2]

# Run after hide("vllm").
_PROBE = """
import json

sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
import torch

import bench_worker_gpu as bench
from kvtail_connector.core.metadata import KVTailMetadata

caches = []


def make_cache(num_layers, num_blocks, heads, slots, content, dtype):
    # bench_zeroing.make_cache's layout (one buffer of random non-zero bytes, a
    # [B, H, N, C] view per layer) on the CPU, with one head of 4 elements.
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(1, 255, (num_layers, num_blocks, 1, slots, 4 * size), dtype=torch.uint8)
    caches.append(raw)
    return raw, [raw[layer].view(dtype) for layer in range(num_layers)]


def once(fn, reps=1, before=None):
    if before is not None:
        before()
    fn()
    return 1.0


def once_vs_bare(fn, bare, reps=1, before=None):
    once(fn, reps, before)
    bare()
    return 1.0, 1.0


launches = []


def bare():
    launches.append(1)


bench.make_cache, bench.host_time, bench.device_us = make_cache, once, once
bench.host_time_vs_bare = once_vs_bare

worker = bench.build_worker(2, 64)
raw = caches[-1]
expected = raw.clone()
loads = bench.records(3, 64)
for r in loads:
    (group,) = r.groups
    block = group.block_ids[r.num_loaded // bench.BLOCK_TOKENS - group.first_block]
    expected[:, block, :, r.num_loaded % bench.BLOCK_TOKENS :, :] = 0
worker.bind(KVTailMetadata(inner=None, loads=loads))
zeroed = worker.on_transfer_results({r.req_id for r in loads}, (), bench._NoLoadErrors())

rows = {
    "read": bench.read_tail_rows(1, bare, layers=2, num_blocks=64),
    "producer": bench.producer_rows(1, bare, layers=2, num_blocks=64),
    "digest": bench.digest_rows(1, layers=2, num_blocks=64, sizes=((1, 40), (2, 24))),
    "completion": bench.completion_rows(
        1, bare, layer_counts=(2,), num_blocks=64, sizes=(0, 1, 3)
    ),
    "unsampled": bench.unsampled_rows(1, layers=2, num_blocks=64),
}
print(json.dumps(dict(
    stood_in=bench.VLLM_STOOD_IN,
    asked=_NOT_INSTALLED.asked,
    zeroed=sorted(zeroed),
    bytes_as_expected=torch.equal(raw, expected),
    rows={name: len(table) for name, table in rows.items()},
    bare_launches=len(launches),
    ratios_have_a_bare=all(
        "bare_us" in row for name in ("read", "producer", "completion") for row in rows[name]
    ),
)))
"""


def test_bench_worker_gpu_runs_without_vllm() -> None:
    r = subprocess.run(
        [sys.executable, "-c", hide("vllm") + _PROBE, str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["stood_in"]
    # Only install_if_absent's own ``import vllm`` was asked for.
    assert out["asked"] == ["vllm"]
    assert out["zeroed"] == ["r0", "r1", "r2"]
    assert out["bytes_as_expected"]
    # Two READ sizes x three paths; two producer sizes; the two digest sizes; the
    # unsampled producer step and consumer completion.
    assert out["rows"] == {
        "read": 6,
        "producer": 2,
        "digest": 2,
        "completion": 3,
        "unsampled": 2,
    }
    # Each ratio's bare launch is timed beside its row: one per READ row, two per
    # producer row (the hook, the whole step), one per completion row.
    assert out["bare_launches"] == 6 + 2 * 2 + 3 and out["ratios_have_a_bare"]
