"""Kernel design experiments: block size, warps, grid size, 16-byte stores.

One CUDA run times every variant of ``zero_kv_slots_kernel`` on the same
caches (CUDA-graph replay, device time) and the host cost of each launch
path, so the launcher's constants are chosen by measurement:

    cd benchmarks && PYTHONPATH=.. python kernel_variants.py

The chosen values live in ``kvtail_connector/ops/zero/launcher.py`` (BLOCK,
NUM_WARPS, PROGRAMS_PER_SM); RESULTS.md records the run that chose them.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
import triton
from bench_zeroing import _noop, graph_time_us, launch_floor_us, make_cache, memset_bandwidth

from kvtail_connector.ops import KVZeroer
from kvtail_connector.ops.staging import PinnedStaging
from kvtail_connector.ops.zero import launcher
from kvtail_connector.ops.zero.plan import items_work, pack_line
from kvtail_connector.ops.zero.work_schema import HEADER_WORDS, ITEM_COLS, ROW_COLUMN

# (BLOCK, num_warps, programs per SM, 16-byte stores)
VARIANTS = [
    (1024, 4, 8, True),
    (2048, 4, 8, True),
    (2048, 4, 8, False),
    (2048, 4, 4, True),
    (2048, 4, 16, True),
    (2048, 8, 8, True),
    (4096, 8, 8, True),
]
CASES = [(1, 0), (64, 0), (256, 0), (0, 256), (0, 1024), (64, 1024)]


def items_for(rng, num_blocks, slots, n_tails, n_blocks):
    chosen = rng.choice(num_blocks, size=n_tails + n_blocks, replace=False)
    firsts = rng.integers(1, slots, size=n_tails)
    tails = np.stack([np.zeros(n_tails), chosen[:n_tails], firsts], 1)
    whole = np.stack([np.zeros(n_blocks), chosen[n_tails:], np.zeros(n_blocks)], 1)
    return np.concatenate([tails, whole]).astype(np.int64), firsts


def numpy_work(zeroer, items, block):
    """The work buffer ``zeroer.zero(items)`` launches, under block size ``block``
    (the header's chunk counts depend on it), and its units."""
    return items_work(
        items, zeroer._row_start, zeroer._row_count, zeroer._max_span, zeroer.num_groups, block
    )


def variant_time(zeroer, items, rows_vec, rows_novec, block, warps, per_sm, vec):
    work, units = numpy_work(zeroer, items, block)
    work_dev = torch.from_numpy(np.frombuffer(work, dtype=np.int64).copy()).cuda()
    rows = rows_vec if vec else rows_novec
    grid = max(1, min(units, torch.cuda.get_device_properties(0).multi_processor_count * per_sm))

    def fn():
        launcher.kernel()[(grid,)](work_dev, rows, BLOCK=block, num_warps=warps, **launcher.COLUMNS)

    return graph_time_us(fn)


def host_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    rng = np.random.default_rng(1)
    bw = memset_bandwidth()
    floor = launch_floor_us()
    print(f"# {torch.cuda.get_device_name()} triton {triton.__version__}")
    print(f"# memset {bw / 1e12:.2f} TB/s, empty launch {floor:.2f} µs")
    caches = {
        "bf16 80L H8": (make_cache(80, 2048, 8, 16, 256, torch.bfloat16), 16),
        "fp8 61L MLA": (make_cache(61, 2048, 1, 64, 656, torch.float8_e4m3fn), 64),
    }
    names = [f"B{b} w{w} x{p}{' v4' if v else ''}" for b, w, p, v in VARIANTS]
    print("| cache | tails | blocks | MiB | floor µs | " + " | ".join(names) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(VARIANTS))
    for name, ((_raw, views), slots) in caches.items():
        zeroer = KVZeroer([(views, 1)], use_graphs=False)
        assert zeroer._launcher is not None
        rows_vec = zeroer._launcher.rows
        rows_novec = rows_vec.clone()
        rows_novec[:, ROW_COLUMN["vectorized"]] = 0
        v0 = views[0]
        per_slot = v0.shape[1] * v0.shape[3] * v0.element_size()
        for n_tails, n_blocks in CASES:
            items, firsts = items_for(rng, v0.shape[0], slots, n_tails, n_blocks)
            per_layer = int(((slots - firsts) * per_slot).sum()) + n_blocks * slots * per_slot
            nbytes = per_layer * len(views)
            f = max(floor, nbytes / bw * 1e6)
            times = [variant_time(zeroer, items, rows_vec, rows_novec, *v) for v in VARIANTS]
            cells = " | ".join(f"{t:.1f} ({t / f:.2f}x)" for t in times)
            print(f"| {name} | {n_tails} | {n_blocks} | {nbytes / 2**20:.1f} | {f:.1f} | {cells} |")
        del views
    caches.clear()
    torch.cuda.empty_cache()

    # Host cost of each launch path (µs per call, queued, no sync in the loop).
    _raw, views = make_cache(2, 256, 8, 16, 256, torch.bfloat16)
    graphs = KVZeroer([(views, 1)])
    graphs.warmup()
    staged = KVZeroer([(views, 1)], use_graphs=False)
    staged.warmup()
    items64, _ = items_for(rng, 256, 16, 64, 0)
    kernel_launcher = staged._launcher
    assert kernel_launcher is not None and kernel_launcher._compiled is not None
    compiled = kernel_launcher._compiled
    rows = kernel_launcher.rows
    x = torch.empty(1, device="cuda")
    empty = torch.zeros(HEADER_WORDS, dtype=torch.int64, device="cuda")
    staging = PinnedStaging(torch.device("cuda"))
    table = np.zeros(HEADER_WORDS + 64 * ITEM_COLS, dtype=np.int64)
    (prepared,) = staged.stage([0], [(int(b), int(f)) for _, b, f in items64])
    # What the worker holds at completion: one packed line per tail.
    lines64 = b"".join(pack_line(int(b), int(f), graphs.rows_for(0, int(f))) for _, b, f in items64)
    assert prepared is not None
    print()
    print("| host path | µs/call |")
    print("|---|---:|")
    paths = [
        ("empty Triton kernel, JIT launch", lambda: _noop[(1,)](x), 2000),
        (
            "our kernel, JIT launch (empty work)",
            lambda: launcher.launch_jit(1, empty, rows),
            2000,
        ),
        (
            "our kernel, compiled launch (empty work)",
            compiled.bound(1, empty, rows),
            2000,
        ),
        ("staging a 64-item work buffer", lambda: staging.to_device(table), 2000),
        (
            "encode 64 tails (numpy)",
            lambda: numpy_work(staged, items64, launcher.BLOCK),
            2000,
        ),
        (
            "zero 64 packed tail lines (the worker's path), graph path",
            lambda: graphs.zero_packed(b"", lines64),
            500,
        ),
        ("launch only (staged, 64 tails)", prepared, 1000),
        ("zero 64 tails, staged path", lambda: staged.zero(items64, validate=False), 500),
        ("zero 64 tails, graph path", lambda: graphs.zero(items64, validate=False), 500),
        ("zero 64 tails, graph path, validated", lambda: graphs.zero(items64), 500),
        ("zero 0 items", lambda: graphs.zero(np.zeros((0, 3), np.int64)), 2000),
    ]
    for label, fn, n in paths:
        print(f"| {label} | {host_us(fn, n):.1f} |")
    print(f"| compiled fast path active | {compiled.fast} |")
    print(f"| graph path active | {graphs.uses_graphs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
