"""Host cost of the worker's completion path on a GPU, against one bare Triton launch.

What ``get_transfer_results`` adds when loads complete: pop their records,
concatenate their pre-encoded tails, one graph replay (copy + launch), one
event record. Measured per call with the GPU idle before each call (host time
only), as a ratio to launching an empty Triton kernel in the same run.

    PYTHONPATH=. python3 benchmarks/bench_worker_gpu.py [--json out.json]

The GPU machine has no vLLM; the worker module imports two vLLM base classes
and a logger, which ``benchmarks/vllm_stub`` provides there (nothing else of
vLLM runs on this path).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

try:
    import vllm  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).parent / "vllm_stub"))

import triton  # noqa: E402
from bench_zeroing import _noop, make_cache  # noqa: E402

from kvtail_connector.kvgroups import GroupInfo  # noqa: E402
from kvtail_connector.metadata import GroupLoad, KVTailMetadata, LoadRecord  # noqa: E402
from kvtail_connector.stats import KVTailStats  # noqa: E402
from kvtail_connector.worker import RankPlacement, TailWorker  # noqa: E402

BLOCK_TOKENS = 16


def median_us(samples: list[float]) -> float:
    samples = sorted(samples)
    return samples[len(samples) // 2] * 1e6


def host_time(fn, reps: int, before=None) -> float:
    """Median host seconds of ``fn`` with the GPU idle before each call."""
    out = []
    for _ in range(reps):
        if before is not None:
            before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return median_us(out)


def build_worker(layers: int, num_blocks: int) -> TailWorker:
    _raw, views = make_cache(layers, num_blocks, 8, BLOCK_TOKENS, 256, torch.bfloat16)
    names = [f"layer.{i}" for i in range(layers)]
    spec = SimpleNamespace(block_size=BLOCK_TOKENS, tokens_per_state=1)
    kv_cache_config = SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=spec)],
    )
    worker = TailWorker(
        (GroupInfo(0, True, BLOCK_TOKENS, 1),),
        RankPlacement(),
        zero_tails=True,
        zero_failed_loads=False,
        probe=False,
        stats=KVTailStats(),
    )
    worker.register_kv_caches(dict(zip(names, views, strict=True)), kv_cache_config)
    worker._keep_alive = views  # type: ignore[attr-defined]
    return worker


def records(n: int, num_blocks: int) -> tuple[LoadRecord, ...]:
    out = []
    for i in range(n):
        loaded = 3 * BLOCK_TOKENS + 1 + i % (BLOCK_TOKENS - 1)
        blocks = tuple((4 * i + j) % num_blocks for j in range(4))
        out.append(LoadRecord(f"r{i}", 0, loaded, (GroupLoad(0, 0, blocks),)))
    return tuple(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    x = torch.empty(1, device="cuda")
    _noop[(1,)](x)
    bare = host_time(lambda: _noop[(1,)](x), args.reps)
    rows = []
    for layers in (2, 80):
        worker = build_worker(layers, 1024)
        for n in (0, 1, 64):
            recs = records(n, 1024)
            finished = {r.req_id for r in recs}
            meta = KVTailMetadata(inner=None, loads=recs)  # type: ignore[arg-type]

            def bind(meta=meta, worker=worker):
                worker.bind(meta)

            def complete(finished=finished, worker=worker):
                worker.on_transfer_results(finished, (), None)

            us = host_time(complete, args.reps, before=bind if n else None)
            bind_us = host_time(
                bind, args.reps, before=lambda f=finished, w=worker: w._loads.clear()
            )
            worker._loads.clear()
            rows.append(dict(layers=layers, tails=n, complete_us=us, bind_us=bind_us))
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    )
    print(f"# one bare Triton launch (empty kernel, JIT): {bare:.1f} µs host")
    print("| layers | tails completing | completion µs (host) | / bare launch | bind µs (host) |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['layers']} | {r['tails']} | {r['complete_us']:.1f} | "
            f"{r['complete_us'] / bare:.2f} | {r['bind_us']:.1f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(dict(bare_launch_us=bare, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
