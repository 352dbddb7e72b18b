"""Read bandwidth of the KV digest (mix64-1) against the target.

Run on a CUDA GPU (an H200 for benchmarks/RESULTS.md; needs torch and
Triton, not vLLM):

    PYTHONPATH=. python3 benchmarks/bench_digest.py [--json out.json] [--sweep]

and, to exercise it without a GPU (tiny sizes, wall time, torch path or the
Triton interpreter under TRITON_INTERPRET=1):

    PYTHONPATH=. python3 benchmarks/bench_digest.py --device cpu

Caches: an 80-layer bf16 ``[B, H, N, C]`` cache (LBHNC, 8 KV heads x 128
dims, K|V in C = 256, 16-token blocks) and a 61-layer MLA-like fp8 cache
(1 head, 576-byte slots, 64-token blocks). Requests of 2k and 32k tokens
(and a batch of eight 2k requests in one call) on shuffled block ids.

Per case: bytes of valid KV read, device time of one ``digest()`` call
(host-to-device work copy, the kernel, the read-back; CUDA events, median),
bandwidth, the target (2.5 TB/s) and the ratio, and the host time to enqueue
the call. ``read floor`` is ``torch.sum`` over a 4 GiB int32 buffer, measured
in the same run. ``--sweep`` times launch variants (tile, warps, programs
per SM, register cap) on the 32k cases.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kvtail_connector.ops.digest.launcher import DigestGroup, GroupSpan, KVDigester

TARGET_TBPS = 2.5


def make_cache(device, num_layers, num_blocks, heads, slots, content, dtype):
    """Per-layer LBHNC views of one random buffer."""
    el = torch.empty((), dtype=dtype).element_size()
    page = heads * slots * content * el
    raw = torch.empty(num_layers * num_blocks * page, dtype=torch.uint8, device=device)
    raw.random_(0, 256)
    views = [
        torch.as_strided(
            raw,
            (num_blocks, heads, slots, content * el),
            (page, slots * content * el, content * el, 1),
            layer * num_blocks * page,
        ).view(dtype)
        for layer in range(num_layers)
    ]
    return raw, views


def cases(device):
    """(name, views, block size, request lengths) per cache."""
    if device.type == "cpu":
        return [
            ("tiny bf16 2L x 2H x 16d, bs16", (2, 64, 2, 16, 32, torch.bfloat16), [300], 2),
            ("tiny fp8 MLA 2L x 576B, bs64", (2, 16, 1, 64, 576, torch.float8_e4m3fn), [300], 2),
        ]
    return [
        ("bf16 80L x 8H x 128d, bs16", (80, 2304, 8, 16, 256, torch.bfloat16), [2048, 32768], 8),
        ("fp8 MLA 61L x 576B, bs64", (61, 576, 1, 64, 576, torch.float8_e4m3fn), [2048, 32768], 8),
    ]


def requests_of(lengths, num_blocks, block_size, gen):
    """Requests on disjoint shuffled blocks."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    out, used = [], 0
    for n in lengths:
        need = -(-n // block_size)
        out.append([GroupSpan(perm[used : used + need], 0, n)])
        used += need
    return out


def time_call(digester, requests, device, reps):
    """(device µs, host enqueue µs) of one digest() call, medians."""
    digester.digest(requests).result()  # warm: compile, staging, pinned pool
    dev, host = [], []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            pending = digester.digest(requests)
            host.append((time.perf_counter() - t0) * 1e6)
            end.record()
            pending.result()
            dev.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            digester.digest(requests).result()
            host.append((time.perf_counter() - t0) * 1e6)
            dev.append(host[-1])
    return statistics.median(dev), statistics.median(host)


def read_floor_tbps(device):
    if device.type != "cuda":
        return float("nan")
    buf = torch.ones(1 << 30, dtype=torch.int32, device=device)
    buf.sum()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        buf.sum()
    end.record()
    torch.cuda.synchronize()
    return buf.numel() * 4 * 10 / (start.elapsed_time(end) * 1e-3) / 1e12


def slot_bytes(views):
    v = views[0]
    return int(v.shape[1]) * int(v.shape[3]) * v.element_size()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--implementation", default="auto", choices=["auto", "triton", "torch"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--sweep", action="store_true", help="time launch variants (largest requests)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    rows = []
    floor = read_floor_tbps(device)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    print(f"read floor (torch.sum, 4 GiB int32): {floor:.2f} TB/s\n")
    header = (
        f"{'case':<34} {'tokens':>9} {'MB read':>9} {'device µs':>10} {'TB/s':>6} "
        f"{'target':>6} {'ratio':>6} {'host µs':>8}  tile"
    )
    print(header)
    print("-" * len(header))
    sweep_inputs = []
    for name, shape, lengths, batch in cases(device):
        layers, num_blocks, heads, slots, content, dtype = shape
        _, views = make_cache(device, layers, num_blocks, heads, slots, content, dtype)
        digester = KVDigester([DigestGroup(views)], implementation=args.implementation)
        digester.warmup()
        runs = [(f"{n}", [n]) for n in lengths] + [(f"{batch}x{lengths[0]}", [lengths[0]] * batch)]
        for label, request_lengths in runs:
            requests = requests_of(request_lengths, num_blocks, slots, gen)
            read = sum(request_lengths) * layers * slot_bytes(views)
            dev_us, host_us = time_call(digester, requests, device, args.reps)
            tbps = read / (dev_us * 1e-6) / 1e12
            row = dict(
                case=name,
                tokens=label,
                bytes_read=read,
                device_us=dev_us,
                tbps=tbps,
                target_tbps=TARGET_TBPS,
                ratio=tbps / TARGET_TBPS,
                host_us=host_us,
                tile=list(digester.tile),
                read_floor_tbps=floor,
            )
            rows.append(row)
            print(
                f"{name:<34} {label:>9} {read / 1e6:>9.1f} {dev_us:>10.1f} {tbps:>6.3f} "
                f"{TARGET_TBPS:>6.2f} {tbps / TARGET_TBPS:>6.3f} {host_us:>8.1f}  {digester.tile}"
            )
            if label == str(lengths[-1]):
                sweep_inputs.append((name, views, requests, read))
        # The timed kernel computes the torch path's sums.
        small = requests_of([min(lengths[0], 512)], num_blocks, slots, gen)
        got = digester.digest(small).result()[0][0].sums
        ref = (
            KVDigester([DigestGroup(views)], implementation="torch")
            .digest(small)
            .result()[0][0]
            .sums
        )
        assert (got == ref).all(), f"{name}: kernel and torch path disagree"
    if args.sweep:
        rows += sweep(sweep_inputs, device, args.reps, args.implementation)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def sweep(inputs, device, reps, implementation):
    """TB/s of launch variants; the default is the row marked *."""
    print("\nlaunch variants (largest requests)")
    print(f"{'case':<34} {'tile':>10} {'warps':>5} {'prog/SM':>7} {'maxnreg':>7} {'TB/s':>6}")
    rows = []
    for name, views, requests, read in inputs:
        default = KVDigester([DigestGroup(views)], implementation=implementation)
        s, w = default.tile
        tiles = sorted({(s, w), (2 * s, w), (max(1, s // 2), w), (max(1, s // 2), 2 * w)})
        for tile in tiles:
            for warps in (4, 8):
                for programs in (4, 8, 16):
                    for maxnreg in (0, 64):
                        d = KVDigester(
                            [DigestGroup(views)],
                            implementation=implementation,
                            tile=tile,
                            num_warps=warps,
                            programs_per_sm=programs,
                            max_registers=maxnreg,
                        )
                        dev_us, _ = time_call(d, requests, device, max(3, reps // 4))
                        tbps = read / (dev_us * 1e-6) / 1e12
                        mark = (
                            "*"
                            if (tile, warps, programs, maxnreg)
                            == (default.tile, default.num_warps, 8, 64)
                            else ""
                        )
                        print(
                            f"{name:<34} {str(tile):>10} {warps:>5} {programs:>7} "
                            f"{maxnreg:>7} {tbps:>6.2f}{mark}"
                        )
                        rows.append(
                            dict(
                                case=name,
                                sweep=True,
                                tile=list(tile),
                                warps=warps,
                                programs_per_sm=programs,
                                maxnreg=maxnreg,
                                tbps=tbps,
                            )
                        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
