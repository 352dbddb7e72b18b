"""Read bandwidth of the KV digest (mix64-1) against a plain read of the same bytes.

Run on a CUDA GPU (an H200 for benchmarks/RESULTS.md; needs torch and
Triton, not vLLM):

    PYTHONPATH=. python3 benchmarks/bench_digest.py [--json out.json]

and, to exercise it without a GPU (tiny sizes, wall time, the Triton
interpreter under TRITON_INTERPRET=1, or the torch path):

    PYTHONPATH=. python3 benchmarks/bench_digest.py --device cpu

Caches: an 80-layer bf16 ``[B, H, N, C]`` cache (LBHNC, 8 KV heads x 128
dims, K|V in C = 256, 16-token blocks) and a 61-layer MLA-like fp8 cache
(1 head, 576-byte slots, 64-token blocks). Requests of 2k and 32k tokens
(and a batch of eight 2k requests in one call) on shuffled block ids.

Per case, device times are medians with the host's enqueue hidden behind
``torch.cuda._sleep`` (the events time the device only): ``read µs``, a
trivial Triton kernel reading exactly the requests' pages (the floor);
``kernel µs``, the digest kernel alone on a pre-staged work buffer;
``call µs``, one ``digest()`` call (work copy, kernel, read-back). Then the
kernel's TB/s, the floor's, their ratio (target >= 0.85), and the host time
to enqueue one call (GPU idle). ``torch.sum`` over a contiguous int32 buffer
of 4 GiB is printed too (the issue's figure). Launch variants:
``digest_variants.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from digest_variants import _read_pages, device_ms, kernel_only, make_cache

from kvtail_connector.extras.ops.digest.launcher import DigestGroup, GroupSpan, KVDigester

TARGET_RATIO = 0.85  # of a plain read of the same bytes


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


def host_us(digester, requests, device, reps):
    """Median host µs to enqueue one digest() call, the GPU idle before it."""
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        pending = digester.digest(requests)
        out.append((time.perf_counter() - t0) * 1e6)
        pending.result()
    return statistics.median(out)


def page_reader(raw, requests, layers, num_blocks, page):
    """A function reading every (layer, block) page of the requests once."""
    blocks = [b for r in requests for b in r[0].block_ids]
    block_list = torch.tensor(blocks, dtype=torch.int64, device=raw.device)
    words, out = (
        raw.view(torch.int32),
        torch.empty(layers * len(blocks), dtype=torch.int32, device=raw.device),
    )
    page_words = page // 4

    def read():
        _read_pages[(len(blocks), layers)](
            words,
            block_list,
            out,
            len(blocks),
            num_blocks * page_words,
            page_words,
            PAGE=page_words,
            BLOCK=4096,
            num_warps=8,
        )

    return read


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
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    rows = []
    torch_sum = read_floor_tbps(device)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    print(f"torch.sum, 4 GiB int32: {torch_sum:.2f} TB/s\n")
    header = (
        f"{'case':<30} {'tokens':>8} {'MB read':>8} {'read µs':>9} {'kernel µs':>10} "
        f"{'call µs':>9} {'TB/s':>6} {'read TB/s':>9} {'ratio':>6} {'host µs':>8}  tile"
    )
    print(header)
    print("-" * len(header))
    for name, shape, lengths, batch in cases(device):
        layers, num_blocks, heads, slots, content, dtype = shape
        raw, views, _ = make_cache(device, layers, num_blocks, heads, slots, content, dtype)
        page = heads * slots * content * views[0].element_size()
        digester = KVDigester([DigestGroup(views)], implementation=args.implementation)
        digester.warmup()
        runs = [(f"{n}", [n]) for n in lengths] + [(f"{batch}x{lengths[0]}", [lengths[0]] * batch)]
        for label, request_lengths in runs:
            requests = requests_of(request_lengths, num_blocks, slots, gen)
            read = sum(request_lengths) * layers * slot_bytes(views)
            digester.digest(requests).result()  # warm: staging, pinned pool
            if device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
                reader = page_reader(raw, requests, layers, num_blocks, page)
                read_us = device_ms(reader, 3) * 1e3
            else:
                read_us = float("nan")
            if digester.implementation == "triton":
                kernel_us = device_ms(kernel_only(digester, requests), args.reps) * 1e3
            else:
                kernel_us = float("nan")
            call_us = device_ms(lambda d=digester, r=requests: d.digest(r), args.reps) * 1e3
            enqueue_us = host_us(digester, requests, device, args.reps)
            tbps = read / (kernel_us * 1e-6) / 1e12
            floor = read / (read_us * 1e-6) / 1e12
            row = dict(
                case=name,
                tokens=label,
                bytes_read=read,
                read_us=read_us,
                kernel_us=kernel_us,
                call_us=call_us,
                tbps=tbps,
                read_tbps=floor,
                ratio=tbps / floor,
                target_ratio=TARGET_RATIO,
                host_us=enqueue_us,
                tile=list(digester.tile),
                torch_sum_tbps=torch_sum,
            )
            rows.append(row)
            print(
                f"{name:<30} {label:>8} {read / 1e6:>8.1f} {read_us:>9.1f} {kernel_us:>10.1f} "
                f"{call_us:>9.1f} {tbps:>6.2f} {floor:>9.2f} {tbps / floor:>6.2f} "
                f"{enqueue_us:>8.1f}  {digester.tile}"
            )
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
        del raw, views, digester
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
