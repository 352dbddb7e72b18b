"""Host cost of the worker's completion path on a GPU, against one bare Triton launch.

What ``get_transfer_results`` adds when loads complete: pop their records,
join their tails' work lines (packed when the records arrived), one graph
replay (copy + launch, the slot's event recorded inside the graph).
Measured per call with the GPU idle before each call (host time only), as a
ratio to launching an empty Triton kernel, timed right after each call of
the row (the host's speed drifts within a run; the header's bare launch is
timed once, at the start).

    PYTHONPATH=. python3 benchmarks/bench_worker_gpu.py [--json out.json]

The last table is ``verify_kv: digest``: what P adds per step (digest
records bound, the digest launched in the hook, the worker metadata, its sums
read back) and what D adds (loads with a digest completing: the digest
launched, held, compared), per request size.

It needs the package's own dependencies (torch, Triton, numpy, pydantic), not
vLLM: importing the worker side needs a few vLLM base classes and vLLM's
logger, which ``without_vllm.install_if_absent()`` stands in for where vLLM
is not installed (nothing else of vLLM runs on these paths;
``tests/unit/test_bench_worker_cpu.py`` runs them on CPU with vLLM blocked).
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from without_vllm import install_if_absent

VLLM_STOOD_IN = install_if_absent()  # before anything below imports vLLM

import triton  # noqa: E402
from bench_zeroing import _noop, make_cache  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorTransferResults,
)

from kvtail_connector.core.kvgroups import GroupInfo  # noqa: E402
from kvtail_connector.core.metadata import GroupLoad, KVTailMetadata, LoadRecord  # noqa: E402
from kvtail_connector.core.parts.zeroing import RankPlacement  # noqa: E402
from kvtail_connector.core.policy import TailPolicy  # noqa: E402
from kvtail_connector.core.stats import KVTailStats  # noqa: E402
from kvtail_connector.core.worker import TailWorker  # noqa: E402
from kvtail_connector.extras.kv_verification.placement import HeadPlacement  # noqa: E402
from kvtail_connector.extras.metadata import (  # noqa: E402
    CheckedLoad,
    EntryStep,
    ExpectedDigest,
    LoadCheck,
)
from kvtail_connector.extras.worker import EntryFeaturesWorker  # noqa: E402

BLOCK_TOKENS = 16
DIGEST_SIZES = ((1, 1024), (1, 8192), (1, 131072), (16, 1024))  # (prompts, tokens each)


class _NoLoadErrors:
    """The inner connector, as far as completion asks it: no failed blocks."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()


def median_us(samples: list[float]) -> float:
    samples = sorted(samples)
    return samples[len(samples) // 2] * 1e6


def host_time(fn, reps: int, before=None) -> float:
    """Median host µs of ``fn`` with the GPU idle before each call."""
    return host_time_vs_bare(fn, None, reps, before)[0]


def host_time_vs_bare(fn, bare, reps: int, before=None) -> tuple[float, float]:
    """Median host µs of ``fn`` and of ``bare`` (one bare launch; None: not
    timed, 0.0) timed right after it in the same rep, the GPU idle before each:
    the host's speed drifts within a run (2x between two rows of the same work
    on a shared host), and a ratio to a launch timed beside the row does not."""
    out, base = [], []
    for _ in range(reps):
        if before is not None:
            before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        if bare is not None:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            bare()
            base.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return median_us(out), median_us(base) if base else 0.0


class _FlashAttentionPages:
    """Stands in for vLLM's FLASH_ATTN backend class, which the page maps key
    on by class path: this bench runs without vLLM, on FLASH_ATTN's plain
    ``[B, H, N, C]`` pages."""


_FlashAttentionPages.__module__ = "vllm.v1.attention.backends.flash_attn"
_FlashAttentionPages.__qualname__ = "FlashAttentionBackend"


def build_worker(
    layers: int, num_blocks: int, *, read_tails_by_layer: bool = False, digest: bool = False
) -> TailWorker:
    _raw, views = make_cache(layers, num_blocks, 8, BLOCK_TOKENS, 256, torch.bfloat16)
    names = [f"layer.{i}" for i in range(layers)]
    spec = SimpleNamespace(
        block_size=BLOCK_TOKENS,
        tokens_per_state=1,
        num_heads=int(views[0].shape[1]),
        state_content_size_bytes=int(views[0].shape[3]) * views[0].element_size(),
    )
    layer = SimpleNamespace(attn_backend=_FlashAttentionPages, kv_cache_dtype="auto")
    kv_cache_config = SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=spec)],
    )
    policy = TailPolicy(
        zeroes_tails=True,
        zeroes_failed_loads=False,
        records_every_load=False,
        zeroes_read_tails=True,
        excludes_reads=False,
        zeroes_reads_by_layer=read_tails_by_layer,
        holds_completions=False,
        probes=False,
        vouches_for_tails=True,
        producer_hook="wait_for_save",
        digests_prompts=digest,
        verifies_loads=digest,
    )
    worker = TailWorker(
        (GroupInfo(0, True, BLOCK_TOKENS, 1),),
        RankPlacement(),
        policy,
        extra=lambda caches: EntryFeaturesWorker(caches, policy, rank_id=0, heads=HeadPlacement()),
        stats=KVTailStats(),
    )
    worker.register_kv_caches(
        dict(zip(names, views, strict=True)), kv_cache_config, dict.fromkeys(names, layer)
    )
    worker._keep_alive = views  # type: ignore[attr-defined]
    return worker


def records(n: int, num_blocks: int) -> tuple[LoadRecord, ...]:
    out = []
    for i in range(n):
        loaded = 3 * BLOCK_TOKENS + 1 + i % (BLOCK_TOKENS - 1)
        blocks = tuple((4 * i + j) % num_blocks for j in range(4))
        out.append(LoadRecord(f"r{i}", 0, loaded, (GroupLoad(0, 0, blocks),)))
    return tuple(out)


def producer_records(n: int, num_blocks: int) -> tuple[LoadRecord, ...]:
    """What a producer's scheduler ships: each prompt's last block only."""
    out = []
    for i in range(n):
        prompt = 3 * BLOCK_TOKENS + 1 + i % (BLOCK_TOKENS - 1)
        out.append(LoadRecord(f"p{i}", 0, prompt, (GroupLoad(0, 3, ((4 * i + 3) % num_blocks,)),)))
    return tuple(out)


def device_us(fn) -> float:
    """Device time of the work ``fn`` enqueues: queued behind a sleep kernel, so
    the host has enqueued all of it before the GPU starts on it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(20_000_000)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3


def read_tail_rows(reps: int, bare, layers: int = 80, num_blocks: int = 1024) -> list[dict]:
    """MoRIIO READ tails: all layers after start_load_kv (0.33, FULL graphs on
    0.32) against one launch per layer after each wait_for_layer_load (0.32)."""
    worker = build_worker(layers, num_blocks, read_tails_by_layer=True)
    names = [f"layer.{i}" for i in range(layers)]
    rows = []
    for n in (1, 16):
        reads = records(n, num_blocks)
        meta = KVTailMetadata(inner=None, read_loads=reads)  # type: ignore[arg-type]
        vouched = EntryStep(vouched=frozenset(r.req_id for r in reads))
        trusted = KVTailMetadata(inner=None, read_loads=reads, extra=vouched)  # type: ignore[arg-type]

        def at_start(meta=meta):
            worker.bind(meta)
            worker.reads_started(True)

        def per_layer(meta=meta):
            worker.bind(meta)
            worker.reads_started(False)
            for name in names:
                worker.layer_loaded(name)

        def per_layer_vouched(meta=trusted):
            per_layer(meta)

        paths = (("at start", at_start), ("per layer", per_layer))
        paths += (("per layer, vouched", per_layer_vouched),)
        for path, fn in paths:
            fn()
            host, bare_us = host_time_vs_bare(fn, bare, reps)
            dev = sorted(device_us(fn) for _ in range(21))[10]
            rows.append(
                dict(
                    path=path, layers=layers, reads=n, host_us=host, bare_us=bare_us, device_us=dev
                )
            )
    return rows


def producer_rows(reps: int, bare, layers: int = 80, num_blocks: int = 1024) -> list[dict]:
    """A producer's added cost per step: bind its prompt-tail records (where
    they are encoded), zero them in the hook (one launch), build the worker
    metadata; each timed alone, and the three together."""
    worker = build_worker(layers, num_blocks)
    rows = []
    for n in (1, 16):
        step = EntryStep(producer_tails=producer_records(n, num_blocks))
        meta = KVTailMetadata(inner=None, extra=step)  # type: ignore[arg-type]

        def bind(meta=meta):
            worker.bind(meta)

        def step(meta=meta):
            worker.bind(meta)
            worker.produce()
            worker.worker_meta(None)

        step()
        bind_us = host_time(bind, reps, before=lambda: worker.worker_meta(None))
        hook_us, hook_bare_us = host_time_vs_bare(worker.produce, bare, reps, before=bind)
        meta_us = host_time(lambda: worker.worker_meta(None), reps, before=step)
        host, bare_us = host_time_vs_bare(step, bare, reps)
        dev = sorted(device_us(step) for _ in range(21))[10]
        rows.append(
            dict(
                prompts=n,
                layers=layers,
                host_us=host,
                bind_us=bind_us,
                hook_us=hook_us,
                hook_bare_us=hook_bare_us,
                meta_us=meta_us,
                bare_us=bare_us,
                device_us=dev,
            )
        )
    return rows


def digest_records(n: int, tokens: int, num_blocks: int) -> tuple[CheckedLoad, ...]:
    """``n`` prompts of ``tokens`` tokens each, every block of them."""
    per = -(-tokens // BLOCK_TOKENS)
    return tuple(
        CheckedLoad(
            f"d{i}",
            0,
            tokens,
            (GroupLoad(0, 0, tuple((per * i + j) % num_blocks for j in range(per))),),
        )
        for i in range(n)
    )


def digest_rows(
    reps: int, layers: int = 80, num_blocks: int = 1024, sizes=DIGEST_SIZES
) -> list[dict]:
    """``verify_kv: digest``. P: bind its digest records, the hook (digest
    launch and read-back enqueued), the worker metadata, reading the sums
    (waits for the device). D: loads carrying P's digest complete (digest
    launched, held, compared in ``transfer_results``)."""
    worker = build_worker(layers, num_blocks, digest=True)
    rows = []
    for n, tokens in sizes:
        recs = digest_records(n, tokens, num_blocks)
        meta = KVTailMetadata(inner=None, extra=EntryStep(producer_digests=recs))  # type: ignore[arg-type]
        parts: dict = {}

        def produce(meta=meta, parts=parts):
            worker.bind(meta)
            worker.produce()
            parts.update(worker.worker_meta(None).extra.digests)

        def read_back(parts=parts):
            for part in parts.values():
                part.sums()

        produce()
        read_back()
        expected = {r.req_id: parts[r.req_id].digest() for r in recs}
        p_host = host_time(produce, reps)
        p_read = host_time(lambda: (produce(), read_back()), reps)
        p_dev = sorted(device_us(produce) for _ in range(11))[5]
        loads = tuple(LoadRecord(r.req_id, 0, tokens, r.groups) for r in recs)
        checks = {r.req_id: LoadCheck(ExpectedDigest(tokens, expected[r.req_id])) for r in recs}
        load_meta = KVTailMetadata(inner=None, loads=loads, extra=EntryStep(checks=checks))  # type: ignore[arg-type]
        finished = {r.req_id for r in loads}
        done = KVConnectorTransferResults(finished_recving=finished)

        def bind(meta=load_meta):
            worker.bind(meta)

        def complete(done=done):
            return worker.transfer_results(done, set(), _NoLoadErrors())

        def drain(out):
            failed = set(out.failed_recving)
            while worker.held_requests():  # held: the next passes release them
                out = worker.transfer_results(KVConnectorTransferResults(), set(), _NoLoadErrors())
                failed |= out.failed_recving
            assert not failed, "the digest must match"
            worker.worker_meta(None)

        def verify():
            drain(complete())

        bind()
        verify()
        # The completion pass alone (digest launched, held), then until released.
        d_launch = host_time(
            complete, reps, before=lambda: (drain(KVConnectorTransferResults()), bind())
        )
        drain(KVConnectorTransferResults())
        d_host = host_time(verify, reps, before=bind)
        # Bound first, as in the host row: unbound loads complete without a check.
        d_dev = sorted(device_us(lambda: (bind(), verify())) for _ in range(11))[5]
        rows.append(
            dict(
                prompts=n,
                tokens=tokens,
                layers=layers,
                p_host_us=p_host,
                p_with_read_us=p_read,
                p_device_us=p_dev,
                d_launch_us=d_launch,
                d_host_us=d_host,
                d_device_us=d_dev,
            )
        )
    return rows


def unsampled_rows(reps: int, layers: int = 80, num_blocks: int = 1024) -> list[dict]:
    """``verify_kv: sample``: what a step with no sampled request pays. The same
    worker work with the digest wired in (sampling on) and without (``off``),
    alternating in each rep. P: bind + hook + worker metadata of a step whose
    metadata carries nothing for the extras (the scheduler sends ``extra=None``
    then). D: 16 loads complete, none carrying a digest (bind + completion)."""
    wired = build_worker(layers, num_blocks, digest=True)
    plain = build_worker(layers, num_blocks, digest=False)
    p_meta = KVTailMetadata(inner=None)  # type: ignore[arg-type]
    loads = records(16, num_blocks)
    d_meta = KVTailMetadata(inner=None, loads=loads)  # type: ignore[arg-type]
    done = KVConnectorTransferResults(finished_recving={r.req_id for r in loads})

    def producer(worker):
        worker.bind(p_meta)
        worker.produce()
        worker.worker_meta(None)

    def consumer(worker):
        worker.bind(d_meta)
        worker.transfer_results(done, set(), _NoLoadErrors())
        worker.worker_meta(None)

    rows = []
    for side, fn in (("P: producer step", producer), ("D: 16 loads complete", consumer)):
        for w in (wired, plain):
            fn(w)
        on, off = host_time_vs_bare(lambda fn=fn: fn(wired), lambda fn=fn: fn(plain), reps)
        rows.append(dict(side=side, wired_us=on, plain_us=off))
    return rows


def completion_rows(
    reps: int,
    bare,
    layer_counts: tuple[int, ...] = (2, 80),
    num_blocks: int = 1024,
    sizes: tuple[int, ...] = (0, 1, 64),
) -> list[dict[str, float]]:
    """Host µs of the runner's ``get_transfer_results`` hook (the worker's
    ``transfer_results``) when ``n`` loads complete (their records bound
    before each rep), and of binding them, per layer count. ``n = 0``: nothing
    completes while 64 loads are in flight."""
    rows: list[dict[str, float]] = []
    inner = _NoLoadErrors()
    for layers in layer_counts:
        worker = build_worker(layers, num_blocks)
        for n in sizes:
            recs = records(n, num_blocks)
            finished = {r.req_id for r in recs}
            meta = KVTailMetadata(inner=None, loads=recs)  # type: ignore[arg-type]
            results = KVConnectorTransferResults(finished_recving=finished)

            def bind(meta=meta, worker=worker):
                worker.bind(meta)

            def complete(results=results, worker=worker):
                worker.transfer_results(results, set(), inner)

            def forget(finished=finished, worker=worker):
                # What a rep bound, dropped (the loads completed, unzeroed).
                worker.contain_transfer_results(
                    KVConnectorTransferResults(finished_recving=finished), set()
                )

            if n:
                us, bare_us = host_time_vs_bare(complete, bare, reps, before=bind)
            else:
                in_flight = KVTailMetadata(inner=None, loads=records(64, num_blocks))  # type: ignore[arg-type]
                worker.bind(in_flight)
                us, bare_us = host_time_vs_bare(complete, bare, reps)
                worker.contain_transfer_results(
                    KVConnectorTransferResults(
                        finished_recving={r.req_id for r in in_flight.loads}
                    ),
                    set(),
                )
            bind_us = host_time(bind, reps, before=forget)
            forget()
            rows.append(
                dict(layers=layers, tails=n, complete_us=us, bare_us=bare_us, bind_us=bind_us)
            )
    return rows


def pickled_rows(
    reps: int, bare, layers: int = 80, num_blocks: int = 4096, blocks_per_load: int = 64
) -> list[dict[str, float]]:
    """Completion and bind as a multi-process executor delivers the metadata:
    unpickled each step (fresh objects, freed when their load completes), with
    ``blocks_per_load`` blocks per load (64: a 1k-token prompt at 16 tokens per
    block). The unpickling itself is vLLM's and is not timed."""
    rows: list[dict[str, float]] = []
    inner = _NoLoadErrors()
    worker = build_worker(layers, num_blocks)
    for n in (1, 64):
        recs = tuple(
            LoadRecord(
                f"req-{i:05d}",
                0,
                (blocks_per_load - 1) * BLOCK_TOKENS + 1 + i % (BLOCK_TOKENS - 1),
                (
                    GroupLoad(
                        0,
                        0,
                        tuple(
                            (blocks_per_load * i + j) % num_blocks for j in range(blocks_per_load)
                        ),
                    ),
                ),
            )
            for i in range(n)
        )
        blob = pickle.dumps(KVTailMetadata(inner=None, loads=recs))  # type: ignore[arg-type]
        results = KVConnectorTransferResults(finished_recving={r.req_id for r in recs})
        fresh: list[KVTailMetadata] = []

        def unpickle(fresh=fresh, blob=blob):
            fresh.append(pickle.loads(blob))

        def bind(fresh=fresh, worker=worker):
            worker.bind(fresh.pop())

        def bind_fresh(blob=blob, worker=worker):
            worker.bind(pickle.loads(blob))

        def complete(results=results, worker=worker):
            worker.transfer_results(results, set(), inner)

        complete_us, bare_us = host_time_vs_bare(complete, bare, reps, before=bind_fresh)
        bind_us = host_time(bind, reps, before=unpickle)
        worker.contain_transfer_results(results, set())
        rows.append(
            dict(layers=layers, tails=n, complete_us=complete_us, bare_us=bare_us, bind_us=bind_us)
        )
    return rows


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

    def launch() -> None:
        _noop[(1,)](x)

    bare = host_time(launch, args.reps)
    rows = completion_rows(args.reps, launch)
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
        + (", vLLM not installed (benchmarks/without_vllm.py)" if VLLM_STOOD_IN else "")
    )
    print(f"# one bare Triton launch (empty kernel, JIT): {bare:.1f} µs host")
    print("# each ratio: to a bare launch timed right after the row's call, in each rep")
    print("get_transfer_results (0 completing: 64 loads in flight, none done), and bind")
    print(
        "| layers | tails completing | completion µs (host) | bare launch µs | / bare launch "
        "| bind µs (host) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['layers']} | {r['tails']} | {r['complete_us']:.1f} | {r['bare_us']:.1f} | "
            f"{r['complete_us'] / r['bare_us']:.2f} | {r['bind_us']:.1f} |"
        )
    pickled = pickled_rows(args.reps, launch)
    print()
    print("The same, the metadata unpickled each step (multi-process executor), 64 blocks/load")
    print(
        "| layers | tails completing | completion µs (host) | bare launch µs | / bare launch "
        "| bind µs (host) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for r in pickled:
        print(
            f"| {r['layers']} | {r['tails']} | {r['complete_us']:.1f} | {r['bare_us']:.1f} | "
            f"{r['complete_us'] / r['bare_us']:.2f} | {r['bind_us']:.1f} |"
        )
    read_rows = read_tail_rows(max(args.reps // 3, 50), launch)
    print()
    print("MoRIIO READ tails, 80 layers (host includes bind; device: queued behind a sleep)")
    print(
        "| zeroed | READ loads | host µs | bare launch µs | / bare launch | per layer / bare "
        "| device µs |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in read_rows:
        ratio = r["host_us"] / r["bare_us"]
        per_layer = f"{ratio / r['layers']:.2f}" if r["path"] == "per layer" else ""
        print(
            f"| {r['path']} | {r['reads']} | {r['host_us']:.1f} | {r['bare_us']:.1f} | "
            f"{ratio:.2f} | {per_layer} | {r['device_us']:.1f} |"
        )
    producer = producer_rows(max(args.reps // 3, 50), launch)
    print()
    print("Producer: prompt tails zeroed in the step that completes them, 80 layers")
    print("(host: bind, the hook, the worker metadata, and the three; device: behind a sleep)")
    print(
        "| prompts completing | bind µs | hook µs | hook / bare launch | worker meta µs "
        "| all µs | all / bare launch | device µs |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in producer:
        print(
            f"| {r['prompts']} | {r['bind_us']:.1f} | {r['hook_us']:.1f} | "
            f"{r['hook_us'] / r['hook_bare_us']:.2f} | {r['meta_us']:.1f} | {r['host_us']:.1f} | "
            f"{r['host_us'] / r['bare_us']:.2f} | {r['device_us']:.1f} |"
        )
    digest = digest_rows(max(args.reps // 10, 20))
    print()
    print("verify_kv: digest, 80 layers, 8 KV heads x 256 bf16. P host: bind + hook + worker")
    print("metadata (then with the sums read back, which waits for the device); D: the completion")
    print("pass (digest launched, held), then completion until released (waits for the device)")
    print(
        "| prompts | tokens each | P host µs | P host µs with read-back | P device µs "
        "| D completion µs (host) | D until released µs | D device µs |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in digest:
        print(
            f"| {r['prompts']} | {r['tokens']} | {r['p_host_us']:.1f} | "
            f"{r['p_with_read_us']:.1f} | {r['p_device_us']:.1f} | {r['d_launch_us']:.1f} | "
            f"{r['d_host_us']:.1f} | {r['d_device_us']:.1f} |"
        )
    unsampled = unsampled_rows(args.reps)
    print()
    print("verify_kv: sample, a step with no sampled request: the digest wired in against off")
    print("(host, alternating in each rep)")
    print("| step | sample µs | off µs | added µs |")
    print("|---|---:|---:|---:|")
    for r in unsampled:
        print(
            f"| {r['side']} | {r['wired_us']:.1f} | {r['plain_us']:.1f} | "
            f"{r['wired_us'] - r['plain_us']:.1f} |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                dict(
                    bare_launch_us=bare,
                    rows=rows,
                    pickled_rows=pickled,
                    read_rows=read_rows,
                    producer=producer,
                    digest=digest,
                    unsampled=unsampled,
                ),
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
