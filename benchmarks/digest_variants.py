"""Device bandwidth of the KV digest kernel's launch variants against a plain read.

One CUDA run (torch and Triton; no vLLM), well under 4 minutes on an H200:

    PYTHONPATH=. python3 benchmarks/digest_variants.py [--json out.json] [--quick]

Caches (as ``bench_digest.py``): 80 layers of bf16 ``[B, H, N, C]`` pages
(8 KV heads, K|V = 256 elements per slot, 16-token blocks, LBHNC) and 61
layers of an MLA-like fp8 cache (one head, 576 bytes a token, 64-token
blocks). Requests: eight of 2k tokens and one of 16k, on shuffled blocks, in
one ``digest()`` call.

Per case, measured in the same run:

- ``page read``: a trivial Triton kernel that reads exactly the bytes the
  digest reads (each (layer, block) page of the requests' blocks, as int32
  vectors, summed), device time;
- ``torch.sum``: ``torch.sum`` over a contiguous int32 buffer of as many
  bytes (the issue's figure);
- per variant: the kernel alone (a pre-staged work buffer; its enqueue is
  hidden behind ``torch.cuda._sleep``, so the events time the device only),
  in TB/s of valid KV bytes, and its ratio to the page read. Medians of
  ``--reps``. Each variant's sums are checked against the default's, and the
  default's against the torch path on a small request.

The default (``KVDigester`` with no knobs) is the first row; the lead sets
the winner in ``kvtail_connector/extras/ops/digest/launcher.py`` (``CHUNK_TOKENS``,
``NUM_WARPS``, ``PROGRAMS_PER_SM``, ``MAX_REGISTERS``, ``NUM_STAGES``,
``STREAM``, or ``choose_tile``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
import triton
import triton.language as tl

from kvtail_connector.extras.ops.digest.launcher import DigestGroup, GroupSpan, KVDigester

SLEEP_CYCLES = 10_000_000  # ~5 ms at 2 GHz: longer than any enqueue here


@triton.jit
def _read_pages(
    base_ptr,
    blocks_ptr,
    out_ptr,
    n_blocks,
    layer_stride,
    page_stride,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program ``(b, l)``: the int32 sum of page ``blocks[b]`` of layer ``l``
    (``PAGE`` int32 words, 16-byte aligned)."""
    b = tl.program_id(0)
    layer = tl.program_id(1)
    blk = tl.load(blocks_ptr + b)
    start = layer.to(tl.int64) * layer_stride + blk * page_stride
    p = tl.multiple_of(base_ptr + start, 4)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, PAGE, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(p + offs, mask=offs < PAGE, other=0)
    tl.store(out_ptr + layer * n_blocks + b, tl.sum(acc))


def make_cache(device, layers, num_blocks, heads, slots, content, dtype):
    """Per-layer LBHNC views of one random buffer, and the int32 view of it."""
    el = torch.empty((), dtype=dtype).element_size()
    page = heads * slots * content * el
    raw = torch.empty(layers * num_blocks * page, dtype=torch.uint8, device=device)
    raw.random_(0, 256)
    views = [
        torch.as_strided(
            raw,
            (num_blocks, heads, slots, content * el),
            (page, slots * content * el, content * el, 1),
            layer * num_blocks * page,
        ).view(dtype)
        for layer in range(layers)
    ]
    return raw, views, page


def device_ms(fn, reps: int) -> float:
    """Median device ms of what ``fn`` enqueues, queued behind a sleep kernel
    (wall ms on CPU: the ``--smoke`` run checks the script, not speed)."""
    times = []
    for _ in range(reps):
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_only(digester: KVDigester, requests) -> Any:
    """A function launching the kernel alone on a pre-staged work buffer (the
    sums it adds up are not read)."""
    from kvtail_connector.extras.ops.digest.plan import choose_chunk, work_buffer

    _, kinds, n_cells, row_tokens = digester._plan(requests)
    chunk = digester.chunk_tokens or choose_chunk(row_tokens, digester._programs, digester.segment)
    work, units, _ = work_buffer(kinds, n_cells, digester.segment, chunk)
    staged = torch.from_numpy(work).to(digester.device)
    return lambda: digester._launch(staged, units)


def variants_for(default: KVDigester) -> list[tuple[str, dict[str, Any]]]:
    """The default, then one knob changed at a time, then a few pairs."""
    s, w = default.tile
    tiles = {(s * 2, w), (max(1, s // 2), w), (max(1, s // 2), w * 2), (s * 2, max(1, w // 2))}
    tiles.discard((s, w))
    out: list[tuple[str, dict[str, Any]]] = [("default", {})]
    out += [(f"tile {t}", {"tile": t}) for t in sorted(tiles)]
    out += [(f"warps {n}", {"num_warps": n}) for n in (2, 8) if n != default.num_warps]
    out += [(f"prog/SM {n}", {"programs_per_sm": n}) for n in (4, 16, 32)]
    out += [("maxnreg 0", {"max_registers": 0}), ("maxnreg 96", {"max_registers": 96})]
    out += [(f"chunk {n}", {"chunk_tokens": n}) for n in (32, 128, 512, 1024)]
    out += [("evict-first", {"stream": True}), ("no prefetch", {"prefetch": False})]
    out += [(f"stages {n}", {"num_stages": n}) for n in (2, 3)]
    out += [
        ("chunk 256 + prog/SM 16", {"chunk_tokens": 256, "programs_per_sm": 16}),
        ("chunk 1024 + prog/SM 4", {"chunk_tokens": 1024, "programs_per_sm": 4}),
        ("evict-first + stages 2", {"stream": True, "num_stages": 2}),
        ("warps 8 + tile x2", {"num_warps": 8, "tile": (s * 2, w)}),
        ("no prefetch + maxnreg 0", {"prefetch": False, "max_registers": 0}),
        # Prefetching holds two tiles: more registers, fewer resident programs.
        ("maxnreg 96 + prog/SM 4", {"max_registers": 96, "programs_per_sm": 4}),
        ("maxnreg 0 + prog/SM 4", {"max_registers": 0, "programs_per_sm": 4}),
        ("evict-first + maxnreg 0", {"stream": True, "max_registers": 0}),
    ]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--quick", action="store_true", help="the default and three variants")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=200.0,
        help="skip a case's variants left after its share of this",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on CPU (TRITON_INTERPRET=1): the script runs",
    )
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("needs CUDA (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    device = torch.device("cpu" if args.smoke else "cuda")
    gen = torch.Generator().manual_seed(0)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"
    print(f"# {name}, torch {torch.__version__}, triton {triton.__version__}")
    cases = [
        ("bf16 80L x 8H x 128d, bs16", (80, 2304, 8, 16, 256, torch.bfloat16)),
        ("fp8 MLA 61L x 576B, bs64", (61, 640, 1, 64, 576, torch.float8_e4m3fn)),
    ]
    lengths = [2048] * 8 + [16384]
    if args.smoke:
        cases = [
            ("bf16 2L x 2H x 16d, bs16", (2, 16, 2, 16, 32, torch.bfloat16)),
            ("fp8 MLA-like 2L x 576B, bs64", (2, 8, 1, 64, 576, torch.float8_e4m3fn)),
        ]
        lengths = [64, 128]
    rows: list[dict[str, Any]] = []
    for name, (layers, num_blocks, heads, slots, content, dtype) in cases:
        t_case = time.perf_counter()
        raw, views, page = make_cache(device, layers, num_blocks, heads, slots, content, dtype)
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        requests, used = [], 0
        for n in lengths:
            need = -(-n // slots)
            requests.append([GroupSpan(perm[used : used + need], 0, n)])
            used += need
        nbytes = sum(lengths) * layers * heads * content * views[0].element_size()
        # Plain reads of the same bytes: every (layer, block) page of the requests.
        # (Requests' lengths are whole blocks here, so pages are exactly the bytes.)
        assert all(n % slots == 0 for n in lengths)
        block_list = torch.tensor(perm[:used], dtype=torch.int64, device=device)
        words = raw.view(torch.int32)
        out = torch.empty(layers * used, dtype=torch.int32, device=device)
        page_words = page // 4

        layer_words = num_blocks * page_words

        def page_read(
            block_list=block_list,
            words=words,
            out=out,
            used=used,
            page_words=page_words,
            layers=layers,
            layer_words=layer_words,
        ):
            _read_pages[(used, layers)](
                words,
                block_list,
                out,
                used,
                layer_words,
                page_words,
                PAGE=page_words,
                BLOCK=4096,
                num_warps=8,
            )

        page_read()
        floor_ms = device_ms(page_read, args.reps)
        flat = torch.ones(nbytes // 4, dtype=torch.int32, device=device)
        flat.sum()
        sum_ms = device_ms(flat.sum, args.reps)
        del flat
        floor = nbytes / (floor_ms * 1e-3) / 1e12
        torch_sum = nbytes / (sum_ms * 1e-3) / 1e12
        print(f"\n## {name}: {len(lengths)} requests, {sum(lengths)} tokens, {nbytes / 1e9:.2f} GB")
        print(
            f"page read (Triton, the same bytes): {floor:.2f} TB/s; torch.sum: {torch_sum:.2f} TB/s"
        )
        default = KVDigester([DigestGroup(views)], implementation="triton")
        n_small = min(40, used)
        small = [[GroupSpan(perm[:n_small], 5, n_small * slots - 3)]]
        ref = KVDigester([DigestGroup(views)], implementation="torch").digest(small).result()
        print(
            f"default: tile {default.tile}, warps {default.num_warps}, chunk "
            f"{default.chunk_tokens or 'per launch'}, stages {default.num_stages}, "
            f"stream {default.stream}, prefetch {default.prefetch}"
        )
        print("| variant | kernel ms | TB/s | / page read | / torch.sum | call ms |")
        print("|---|---:|---:|---:|---:|---:|")
        want = None  # the first variant's sums (each variant's small sums match the torch path)
        variants = variants_for(default)
        if args.quick or args.smoke:
            variants = variants[:4] + [v for v in variants if v[0] in ("stages 2", "chunk 32")]
        for label, knobs in variants:
            if time.perf_counter() - t_case > args.budget_s / len(cases):
                print(f"| {label} | skipped: past this case's share of --budget-s | | | | |")
                continue
            try:
                d = KVDigester([DigestGroup(views)], implementation="triton", **knobs)
                d.warmup()
                ok = bool((d.digest(small).result()[0][0].sums == ref[0][0].sums).all())
                got = [r[0].sums for r in d.digest(requests).result()]
                if want is None:
                    want = got
                ok = ok and all((a == b).all() for a, b in zip(got, want, strict=True))
                k_ms = device_ms(kernel_only(d, requests), args.reps)
                c_ms = device_ms(lambda d=d, r=requests: d.digest(r), args.reps)
            except Exception as e:  # noqa: BLE001 - a variant that fails to build is reported
                if args.smoke:
                    raise
                print(f"| {label} | error: {type(e).__name__}: {str(e)[:120]} | | | | |")
                continue
            tbps = nbytes / (k_ms * 1e-3) / 1e12
            mark = "" if ok else " SUMS DIFFER"
            print(
                f"| {label}{mark} | {k_ms:.3f} | {tbps:.2f} | {tbps / floor:.2f} | "
                f"{tbps / torch_sum:.2f} | {c_ms:.3f} |"
            )
            rows.append(
                dict(
                    case=name,
                    variant=label,
                    knobs={k: list(v) if isinstance(v, tuple) else v for k, v in knobs.items()},
                    kernel_ms=k_ms,
                    call_ms=c_ms,
                    tbps=tbps,
                    page_read_tbps=floor,
                    torch_sum_tbps=torch_sum,
                    ratio=tbps / floor,
                    sums_equal=ok,
                )
            )
        del raw, views, words, default
        torch.cuda.empty_cache()
    print(f"\n# {time.perf_counter() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
