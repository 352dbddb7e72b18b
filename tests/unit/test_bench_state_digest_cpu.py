"""``benchmarks/bench_state_digest.py`` on the CPU, as the GPU machine sees the imports.

That machine has no vLLM and no pydantic. A fresh interpreter with both
hidden imports the benchmark and runs its rows on CPU pages of small shapes
(the kernel under the Triton interpreter; timings stubbed): this checks the
paths and that the kernel's sums equal the torch path's, not their speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.not_installed import hide

REPO = Path(__file__).resolve().parents[2]

# Run after hide("vllm", "pydantic").
_PROBE = """
import json

sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
import torch

import bench_state_digest as bench

torch.cuda.synchronize = lambda: None
bench.DEVICE = "cpu"
bench.REQUESTS = (1, 3)
bench.SHAPES = {
    "gdn-like": (2, 2, [((6, 3), torch.bfloat16), ((2, 4, 4), torch.float32)]),
    "odd": (1, 3, [((7,), torch.int8), ((5, 3), torch.float16)]),
}
bench.host_us = bench.device_us = lambda fn, reps: (fn(), 1.0)[1]
table = bench.rows(1, with_torch=True)
print(json.dumps(dict(stood_in=bench.VLLM_STOOD_IN, asked=_NOT_INSTALLED.asked, table=table)))
"""


def test_bench_state_digest_runs_without_vllm_and_pydantic() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, "-c", hide("vllm", "pydantic") + _PROBE, str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["stood_in"]
    assert out["asked"] == ["vllm"]
    table = out["table"]
    assert [(row["shape"], row["requests"]) for row in table] == [
        ("gdn-like", 1),
        ("gdn-like", 3),
        ("odd", 1),
        ("odd", 3),
    ]
    assert all(row["same_sums"] for row in table)
