"""Host time of the torch zeroing path (CPU engines) against a memset floor.

Run on a CPU (the numbers in benchmarks/RESULTS.md: the project's CI machine,
pinned to one core):

    taskset -c 1 python benchmarks/bench_cpu_zeroing.py [--json out.json]

Caches, as vLLM's CPU engines lay them out:

- ``cpu_attn vec``: 2 layers of CPU_ATTN fp32 pages ``[B, 2, 32, 64]`` (the
  demo's tiny Llama: K transposed, 4-byte units), regions learned from vLLM's
  own writer;
- ``cpu_attn amx``: the same in bf16 with AMX tiles (K in VNNI pairs, V two
  tokens per 32-bit word: 2-byte units), from vLLM's writer where the CPU has
  AMX tiles, else from the tests' synthetic writer of the same layout;
- ``view``: 8 layers of plain LBHNC bf16 ``[B, 8, 16, 256]`` views.

For 1 and 16 tails and 64 whole blocks it prints, in one run, ``ours``
(``KVZeroer.zero``, torch path, median), ``floor`` (one ``zero_()`` of as
many contiguous bytes as the call zeroes, per layer) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtail_connector.ops import RegionCache, reference_zero_kv_blocks  # noqa: E402
from kvtail_connector.ops.zero.zeroer import KVZeroer  # noqa: E402

NUM_BLOCKS = 4096
REPS = 200


def _cpu_attn(isa: str) -> list[RegionCache]:
    from kvtail_connector.pages import cpu as cpu_pages

    dtype = torch.float32 if isa == "vec" else torch.bfloat16
    writer = None
    if isa == "amx" and "amx_tile" not in Path("/proc/cpuinfo").read_text():
        from tests.helpers.cpu_attn_writers import page_writer

        writer = page_writer("amx")
    caches = []
    for _ in range(2):
        view = torch.randn(NUM_BLOCKS, 2, 32, 64).to(dtype)
        regions = cpu_pages.cpu_attn_regions(view, isa, writer=writer)
        caches.append(RegionCache(view, 32, regions))
    return caches


def _views() -> list[torch.Tensor]:
    return [torch.randn(NUM_BLOCKS // 2, 8, 16, 256).to(torch.bfloat16) for _ in range(8)]


def _items(rng: np.random.Generator, num_blocks: int, slots: int, n: int, whole: bool) -> Any:
    blocks = rng.choice(num_blocks, n, replace=False)
    firsts = np.zeros(n, np.int64) if whole else rng.integers(1, slots, n)
    return np.stack([np.zeros(n, np.int64), blocks, firsts], 1)


def _tensor(cache: Any) -> torch.Tensor:
    return cache.tensor if isinstance(cache, RegionCache) else cache


def _zeroed_bytes(caches: list[Any], items: np.ndarray) -> int:
    """Bytes the items zero, by the reference, on copies of ``caches`` that
    hold no zero byte."""
    copies: list[Any] = []
    for cache in caches:
        t = _tensor(cache).clone()
        t.view(torch.uint8).fill_(0x5A)
        is_region = isinstance(cache, RegionCache)
        copies.append(RegionCache(t, cache.slots_per_page, cache.regions) if is_region else t)
    whole = [int(b) for _, b, f in items if f == 0]
    tails = [(int(b), int(f)) for _, b, f in items if f != 0]
    reference_zero_kv_blocks(copies, whole, tails)
    return sum(int((_tensor(c).view(torch.uint8) == 0).sum()) for c in copies)


def _median_us(fn: Any, args: list[Any]) -> float:
    ts = []
    for arg in args:
        t0 = time.perf_counter_ns()
        fn(arg)
        ts.append(time.perf_counter_ns() - t0)
    return float(np.median(ts)) / 1e3


def _memset(buffers: list[torch.Tensor]) -> None:
    for b in buffers:
        b.zero_()


def bench(name: str, caches: list[Any], slots: int, num_blocks: int) -> list[dict[str, Any]]:
    zeroer = KVZeroer([(caches, 1)], implementation="torch")
    layers = len(caches)
    rows = []
    for label, n, whole in (("1 tail", 1, False), ("16 tails", 16, False), ("64 blocks", 64, True)):
        rng = np.random.default_rng(0)
        calls = [_items(rng, num_blocks, slots, n, whole) for _ in range(REPS)]
        ours = _median_us(zeroer.zero, calls)
        per_layer = _zeroed_bytes(caches, calls[0]) // layers
        # One contiguous buffer per layer, as the call writes each layer's bytes.
        buffers = [torch.ones(max(per_layer, 1), dtype=torch.uint8) for _ in range(layers)]
        floor = _median_us(_memset, [buffers] * REPS)
        rows.append(
            {
                "cache": name,
                "zeroes": label,
                "KiB": round(per_layer * layers / 1024, 1),
                "ours_us": round(ours, 1),
                "floor_us": round(floor, 1),
                "ours_per_floor": round(ours / floor, 2),
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = bench("cpu_attn vec, 2 layers", _cpu_attn("vec"), 32, NUM_BLOCKS)
    rows += bench("cpu_attn amx, 2 layers", _cpu_attn("amx"), 32, NUM_BLOCKS)
    rows += bench("view bf16 [B,8,16,256], 8 layers", _views(), 16, NUM_BLOCKS // 2)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of {REPS}")
    print("| cache | zeroes | KiB | ours µs | floor µs | ours / floor |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['cache']} | {r['zeroes']} | {r['KiB']} | {r['ours_us']} | "
            f"{r['floor_us']} | {r['ours_per_floor']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
