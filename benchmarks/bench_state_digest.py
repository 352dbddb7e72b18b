"""Cost of one state digest call (``mix64-state-1``) on a GPU: the kernel, the
torch path it replaced, and a plain read of the same bytes.

``verify_kv`` digests each hybrid request's state block on P right behind the
forward (producer hook) and on D at its load's completion. Per shape and
request count (1, 16, 64) this prints, for one ``StateDigester.digest`` call:

- host: median host time of the call with the GPU idle before it (what the
  hook adds to the step; the kernel path never waits for the device);
- device: median GPU time of the work it enqueues (queued behind a sleep
  kernel, so the host enqueues all of it before the GPU starts);
- floor: device time of ``torch.sum`` over the gathered pages (``index_select``
  of each layer's pages, then one sum): a plain read of the digested bytes;
- GB/s: digested bytes over the kernel's device time;
- torch_*: the same for the torch path (what ran on CUDA before the kernel;
  its blocking index copies wait for the sleep kernel, so its device time
  includes the GPU waiting for the host), and same_sums: the kernel's sums
  equal the torch path's (the run exits 1 where they do not).

Shapes (vLLM's ``MambaStateShapeCalculator``; page = the states packed from
offset 0, padded to 4 KiB; each layer's pages its own tensor):

- ``qwen3-next-tp4``: Qwen3-Next-80B at TP 4, 36 GDN layers in 3 groups of 12
  (vLLM groups hybrid layers 12 to a group there): conv ``[8192/4, 3]`` bf16,
  recurrent ``[32/4, 128, 128]`` fp32 (``mamba_ssm_cache_dtype=float32``).
- ``mamba2-2.7b``: 64 Mamba2 layers in one group, TP 1: conv ``[5120 + 2*128,
  3]`` bf16, SSM ``[80, 64, 128]`` fp32.

    PYTHONPATH=. python3 benchmarks/bench_state_digest.py [--reps N] [--json out.json]

Runs without vLLM (``without_vllm.install_if_absent``); about a minute on an H200.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from math import prod
from pathlib import Path

import torch
from without_vllm import install_if_absent

VLLM_STOOD_IN = install_if_absent()  # before anything below imports vLLM

from digest_variants import device_ms  # noqa: E402

from kvtail_connector.extras.ops.state_digest import StateDigester, StateLayer  # noqa: E402

DEVICE = "cuda"  # tests/unit/test_bench_state_digest_cpu.py runs the rows on "cpu"
REQUESTS = (1, 16, 64)
# name -> (groups, layers per group, [(shape, dtype) per state])
SHAPES = {
    "qwen3-next-tp4": (
        3,
        12,
        [((8192 // 4, 3), torch.bfloat16), ((32 // 4, 128, 128), torch.float32)],
    ),
    "mamba2-2.7b": (1, 64, [((5120 + 2 * 128, 3), torch.bfloat16), ((80, 64, 128), torch.float32)]),
}


def build(shape: str, num_blocks: int) -> tuple[list[tuple[int, list[StateLayer]]], int]:
    """The shape's groups of layers (random pages) and the digested bytes per request."""
    n_groups, per_group, states = SHAPES[shape]
    spans, offset = [], 0
    for dims, dtype in states:
        nbytes = prod(dims) * torch.empty((), dtype=dtype).element_size()
        spans.append((offset, nbytes))
        offset += nbytes
    page = -(-offset // 4096) * 4096
    groups = []
    for g in range(n_groups):
        layers = []
        for _ in range(per_group):
            pages = torch.randint(0, 256, (num_blocks, page), dtype=torch.uint8, device=DEVICE)
            layers.append(StateLayer(pages, tuple(spans)))
        groups.append((g + 1, layers))
    return groups, n_groups * per_group * offset


def median(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


def host_us(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return median(out) * 1e6


def device_us(fn, reps: int) -> float:
    """Median device µs of what ``fn`` enqueues, behind a sleep kernel."""
    return device_ms(fn, reps) * 1e3


def floor_read(groups: list[tuple[int, list[StateLayer]]], blocks: list[list[int]]):
    """torch.sum over each layer's gathered pages (the digested prefix only)."""
    index = [
        torch.tensor([per[j] for per in blocks], dtype=torch.int64, device=DEVICE)
        for j in range(len(groups))
    ]
    end = max(o + n for o, n in groups[0][1][0].states)

    def run() -> None:
        for j, (_, layers) in enumerate(groups):
            for layer in layers:
                torch.sum(layer.pages.index_select(0, index[j])[:, :end], dtype=torch.int64)

    return run


def shape_rows(shape: str, reps: int, with_torch: bool) -> list[dict]:
    out = []
    num_blocks = max(REQUESTS) + 8
    groups, per_request = build(shape, num_blocks)
    kernel = StateDigester(groups, shard=1)
    assert kernel.implementation == "triton"
    torch_path = StateDigester(groups, shard=1, implementation="torch")
    for n in REQUESTS:
        blocks = [[(5 * i + 3 + g) % num_blocks for g in range(len(groups))] for i in range(n)]

        def run(d: StateDigester = kernel, b: list[list[int]] = blocks) -> None:
            d.digest(b)

        def run_torch(d: StateDigester = torch_path, b: list[list[int]] = blocks) -> None:
            d.digest(b)

        got = kernel.digest(blocks)  # warm-up (compile) and the check below
        torch.cuda.synchronize()
        row: dict = {
            "shape": shape,
            "requests": n,
            "MiB": round(n * per_request / 2**20, 1),
            "host_us": round(host_us(run, reps), 1),
            "device_us": round(device_us(run, reps), 1),
        }
        floor = floor_read(groups, blocks)
        floor()
        row["floor_us"] = round(device_us(floor, reps), 1)
        row["GB/s"] = round(n * per_request / row["device_us"] / 1e3, 1)
        if with_torch:
            row["same_sums"] = torch.equal(got, torch_path.digest(blocks))
            torch_reps = max(3, reps // 5)
            row["torch_host_us"] = round(host_us(run_torch, torch_reps), 1)
            row["torch_device_us"] = round(device_us(run_torch, torch_reps), 1)
        out.append(row)
    return out


def rows(reps: int, with_torch: bool) -> list[dict]:
    out = []
    for shape in SHAPES:
        out.extend(shape_rows(shape, reps, with_torch))
        torch.cuda.empty_cache()
    return out


def print_table(table: list[dict]) -> None:
    cols = list(dict.fromkeys(k for r in table for k in r))
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in table)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for r in table:
        print("  ".join(str(r.get(c, "")).rjust(w) for c, w in zip(cols, widths, strict=True)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--no-torch", action="store_true", help="skip the torch path rows")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_state_digest: needs a CUDA device", file=sys.stderr)
        return 2
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, vLLM stood in: {VLLM_STOOD_IN}"
    )
    table = rows(args.reps, not args.no_torch)
    print_table(table)
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))
    bad = [r for r in table if r.get("same_sums") is False]
    if bad:
        print(f"MISMATCH between the kernel and the torch path: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
