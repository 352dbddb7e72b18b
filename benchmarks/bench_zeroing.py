"""Device time of one zeroing launch against the alternatives and the floor.

Run on a CUDA GPU (an H200 for benchmarks/RESULTS.md):

    PYTHONPATH=. python benchmarks/bench_zeroing.py [--json out.json]

Caches: an 80-layer bf16 ``[B, H, N, C]`` cache (LBHNC, 8 KV heads, 16-token
blocks, K|V in C=256) and a 61-layer fp8 MLA-like cache (64-token blocks,
656-byte slots). For 1/16/64/256 tails with 0/256/1024 whole new blocks it
prints, in one run:

- ``ours``: ``KVZeroer.zero`` (host staging + one launch), do_bench median;
- ``graph``: the same launch replayed from a CUDA graph (device time);
- ``slice``: a ``zero_()`` per tail and layer (and per block and layer);
- ``masked``: per layer gather -> ``masked_fill_`` -> scatter of the pages;
- ``floor``: max(empty-launch device time, bytes / memset bandwidth), both
  measured in this run; ``graph/floor`` is the target ratio (<= 1.2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
import triton
from triton.testing import do_bench

from kvtail_connector.ops import KVZeroer

TAILS = (1, 16, 64, 256)
NEW_BLOCKS = (0, 256, 1024)
# Per-call launches above which the per-tail slicing baseline is skipped.
MAX_SLICE_LAUNCHES = 25_000


def make_cache(num_layers, num_blocks, heads, slots, content, dtype):
    el = torch.empty((), dtype=dtype).element_size()
    page = heads * slots * content * el
    raw = torch.empty(num_layers * num_blocks * page, dtype=torch.uint8, device="cuda")
    raw.random_(1, 255)
    views = []
    for layer in range(num_layers):
        v = torch.as_strided(
            raw,
            (num_blocks, heads, slots, content * el),
            (page, slots * content * el, content * el, 1),
            layer * num_blocks * page,
        )
        views.append(v.view(dtype))
    return raw, views


@triton.jit
def _noop(x_ptr):
    pass


def graph_time_us(fn, repeats: int = 20) -> float:
    """Device time per call of ``fn`` replayed from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm inside the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    ms = do_bench(graph.replay, warmup=20, rep=200, return_mode="median")
    return ms * 1e3 / repeats


def memset_bandwidth() -> float:
    buf = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    ms = do_bench(buf.zero_, warmup=20, rep=300, return_mode="median")
    del buf
    return (4 << 30) / (ms * 1e-3)


def launch_floor_us() -> float:
    x = torch.empty(1, device="cuda")
    return graph_time_us(lambda: _noop[(1,)](x), repeats=100)


def pick(rng, num_blocks, n_tails, n_blocks, slots_per_block):
    chosen = rng.choice(num_blocks, size=n_tails + n_blocks, replace=False)
    tail_blocks, whole = chosen[:n_tails], chosen[n_tails:]
    firsts = rng.integers(1, slots_per_block, size=n_tails)
    return tail_blocks, firsts, whole


def bytes_zeroed(views, firsts, n_whole):
    v = views[0]
    slots = v.shape[2]
    per_slot = v.shape[1] * v.shape[3] * v.element_size()
    per_layer = int(((slots - firsts) * per_slot).sum()) + n_whole * slots * per_slot
    return per_layer * len(views)


def slicing(views, tail_blocks, firsts, whole):
    tb, tf, wb = tail_blocks.tolist(), firsts.tolist(), whole.tolist()

    def run():
        for v in views:
            for b, f in zip(tb, tf, strict=True):
                v[b, :, f:, :].zero_()
            for b in wb:
                v[b].zero_()

    return run


def masked(views, tail_blocks, firsts, whole):
    slots = views[0].shape[2]
    pages = torch.as_tensor(np.concatenate([tail_blocks, whole]), device="cuda")
    first = torch.as_tensor(np.concatenate([firsts, np.zeros_like(whole)]), device="cuda")
    mask = (torch.arange(slots, device="cuda")[None, :] >= first[:, None])[:, None, :, None]

    # masked_fill_ has no fp8 kernel: fill the same bytes through a uint8 view.
    raw = [v if v.element_size() > 1 else v.view(torch.uint8) for v in views]

    def run():
        for v in raw:
            sub = v[pages]
            sub.masked_fill_(mask, 0)
            v[pages] = sub

    return run


def check_exact(raw, views, zeroer, items, tail_blocks, firsts):
    """Spot check: tails zeroed, their valid prefix untouched."""
    before = views[0][torch.as_tensor(tail_blocks, device="cuda")].clone()
    zeroer.zero(items)
    after = views[0][torch.as_tensor(tail_blocks, device="cuda")]
    for i, f in enumerate(firsts.tolist()):
        assert torch.equal(after[i, :, :f].view(torch.uint8), before[i, :, :f].view(torch.uint8))
        assert not after[i, :, f:].view(torch.uint8).any()


def bench_cache(name, raw, views, floor_us, bw, rng, out_rows):
    num_blocks, _, slots, _ = views[0].shape
    # KVZeroer's zero() plus the worker's staged launch (for the graph timing).
    zeroer = KVZeroer([(views, 1)])
    zeroer.warmup()
    for n_tails in TAILS:
        for n_blocks in NEW_BLOCKS:
            tb, tf, wb = pick(rng, num_blocks, n_tails, n_blocks, slots)
            items = np.concatenate(
                [
                    np.stack([np.zeros_like(tb), tb, tf], axis=1),
                    np.stack([np.zeros_like(wb), wb, np.zeros_like(wb)], axis=1),
                ]
            ).astype(np.int64)
            check_exact(raw, views, zeroer, items, tb, tf)
            nbytes = bytes_zeroed(views, tf, len(wb))
            ours = do_bench(
                lambda items=items: zeroer.zero(items, validate=False),
                warmup=20,
                rep=200,
                return_mode="median",
            )
            # The same items as zero(items), staged once; the graph replays
            # their launch alone.
            (launch,) = zeroer.stage([0], [(int(b), int(f)) for _, b, f in items])
            assert launch is not None
            graph = graph_time_us(launch)
            # Host cost of a call (staging + launch), queued without syncing.
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                zeroer.zero(items, validate=False)
            host_us = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
            launches = (n_tails + n_blocks) * len(views)
            slice_us = None
            if launches <= MAX_SLICE_LAUNCHES:
                slice_us = 1e3 * do_bench(
                    slicing(views, tb, tf, wb), warmup=1, rep=100, return_mode="median"
                )
            masked_us = 1e3 * do_bench(
                masked(views, tb, tf, wb), warmup=2, rep=100, return_mode="median"
            )
            floor = max(floor_us, nbytes / bw * 1e6)
            row = dict(
                cache=name,
                tails=n_tails,
                blocks=n_blocks,
                mib=nbytes / 2**20,
                ours_us=ours * 1e3,
                graph_us=graph,
                host_us=host_us,
                slice_us=slice_us,
                masked_us=masked_us,
                floor_us=floor,
                graph_over_floor=graph / floor,
                slice_over_ours=(slice_us / (ours * 1e3)) if slice_us else None,
            )
            out_rows.append(row)
            print(_fmt(row), flush=True)


HEADER = (
    "| cache | tails | new blocks | MiB | ours (do_bench) µs | graph µs | host µs/call "
    "| slice µs | masked µs | floor µs | graph/floor | slice/ours |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _fmt(r):
    def f(x, spec):
        return "—" if x is None else format(x, spec)

    return (
        f"| {r['cache']} | {r['tails']} | {r['blocks']} | {r['mib']:.2f} | {r['ours_us']:.1f} "
        f"| {r['graph_us']:.2f} | {r['host_us']:.1f} | {f(r['slice_us'], '.0f')} "
        f"| {r['masked_us']:.0f} | {r['floor_us']:.2f} | {r['graph_over_floor']:.2f} "
        f"| {f(r['slice_over_ours'], '.0f')} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows here as JSON")
    parser.add_argument("--blocks", type=int, default=2048, help="blocks per cache")
    parser.add_argument("--only", choices=("bf16", "fp8"), help="run one cache (both by default)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_zeroing needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    bw = memset_bandwidth()
    floor_us = launch_floor_us()
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    )
    print(f"# memset bandwidth {bw / 1e12:.2f} TB/s; empty launch {floor_us:.2f} µs (graph)")
    print(HEADER)
    rows: list[dict] = []
    if args.only in (None, "bf16"):
        raw, views = make_cache(80, args.blocks, 8, 16, 256, torch.bfloat16)
        bench_cache("bf16 80L [B,8,16,256]", raw, views, floor_us, bw, rng, rows)
        del raw, views
        torch.cuda.empty_cache()
    if args.only in (None, "fp8"):
        raw, views = make_cache(61, args.blocks, 1, 64, 656, torch.float8_e4m3fn)
        bench_cache("fp8 61L MLA [B,1,64,656]", raw, views, floor_us, bw, rng, rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                dict(memset_tbps=bw / 1e12, launch_floor_us=floor_us, rows=rows), fh, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
