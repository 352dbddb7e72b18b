"""The engine process: one ``vllm.LLM`` serving commands from the parent over a pipe.

The engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the
scheduler and the worker's KV tensors are reachable from the command loop.
Besides generating, the server records each request's block ids and each
connector hit, by wrapping two scheduler methods (``KVCacheManager.allocate_slots``
and the connector's ``get_num_new_matched_tokens``). Block ids are taken at
allocation time, not at free time, because a NIXL producer frees late.

The process ignores SIGINT (the parent handles Ctrl-C and shuts it down), dies
with the parent (PR_SET_PDEATHSIG), and ends with ``os._exit`` after an explicit
engine shutdown, because NIXL can segfault in interpreter finalisation.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from typing import Any

from demo.nixl_progress import slow_nixl_progress_thread
from demo.procs import die_with_parent
from demo.records import BASE_ENV, EngineConfig, GenResult, KVInfo
from demo.slots import RPCS, NoSlotMapError

# The wrapper's Prometheus counters (vllm:kvtail_<name>), see kvtail_connector/facade/prom.py.
KVTAIL_METRIC_PREFIX = "vllm:kvtail_"


class _Recorder:
    """Wraps scheduler methods to record block ids and connector hits per request.

    A request's record is its block ids after its last successful
    ``allocate_slots``. That covers its prompt only if the request computed its
    prompt: one whose async KV load failed under ``kv_load_failure_policy:
    "fail"`` ends (``finish_reason`` "error") with the blocks of the load's
    allocation alone, which cover the loaded tokens, not the prompt.
    """

    def __init__(self, scheduler: Any) -> None:
        self.allocs: dict[str, dict[str, Any]] = {}
        self.hits: list[dict[str, Any]] = []
        self.scheduler = scheduler
        kvm = self.scheduler.kv_cache_manager
        orig_alloc = kvm.allocate_slots

        def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
            res = orig_alloc(request, *args, **kwargs)
            if res is not None:
                if len(self.allocs) > 4096:  # long-lived engines: forget the oldest
                    self.allocs.pop(next(iter(self.allocs)))
                with contextlib.suppress(Exception):
                    self.allocs[request.request_id] = {
                        "external": getattr(request, "external_req_id", None),
                        "block_ids": [list(g) for g in kvm.get_block_ids(request.request_id)],
                    }
            return res

        kvm.allocate_slots = allocate_slots
        conn = getattr(self.scheduler, "connector", None)
        if conn is not None:
            orig_match = conn.get_num_new_matched_tokens

            def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> Any:
                res = orig_match(request, num_computed_tokens)
                self.hits.append(
                    {
                        "request_id": request.request_id,
                        "external": getattr(request, "external_req_id", None),
                        "num_computed_tokens": num_computed_tokens,
                        "num_prompt_tokens": request.num_prompt_tokens,
                        "matched": None if res is None else res[0],
                        "async": None if res is None else res[1],
                    }
                )
                return res

            conn.get_num_new_matched_tokens = get_num_new_matched_tokens

    def find(self, external_id: str) -> tuple[str | None, dict[str, Any] | None]:
        """The record of the request vLLM calls ``external_id`` outside the engine:
        the scheduler's id is ``{external_id}-{8 random hex}`` (or the id itself
        with request-id randomization off)."""
        for rid, rec in self.allocs.items():
            if rid == external_id or rec["external"] == external_id:
                return rid, rec
            if rid.startswith(f"{external_id}-"):
                return rid, rec
        return None, None

    def hits_of(self, external_id: str, since: int) -> list[dict[str, Any]]:
        return [
            h
            for h in self.hits[since:]
            if h["external"] == external_id or str(h["request_id"]).startswith(f"{external_id}-")
        ]


class EngineServer:
    """The commands an engine process serves (called by name from the parent)."""

    def __init__(self, cfg: EngineConfig) -> None:
        from vllm import LLM

        kw: dict[str, Any] = dict(
            model=cfg.model,
            max_model_len=cfg.max_model_len,
            enforce_eager=True,  # no torch.compile: ~4 s start instead of ~55 s
            block_size=cfg.block_size,
            dtype=cfg.dtype,
            enable_prefix_caching=cfg.enable_prefix_caching,
            kv_transfer_config=cfg.kv_transfer_config,
            disable_log_stats=False,  # connector stats reach Prometheus only with stats on
        )
        if cfg.num_blocks is not None:
            kw["num_gpu_blocks_override"] = cfg.num_blocks
        kw.update(cfg.llm_kwargs)
        self.cfg = cfg
        if cfg.kv_transfer_config is not None:
            # What the plugin does for an API server's command line: vLLM picks
            # some settings by connector name and cannot see inside the wrapper.
            from kvtail_connector.facade.name_keyed import prepare_environment

            prepare_environment(cfg.kv_transfer_config)
        self.llm = LLM(**kw)
        core: Any = self.llm.llm_engine.engine_core  # an InprocClient: the engine in-process
        self.rec = _Recorder(core.engine_core.scheduler)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        kv_transfer_params: list[dict[str, Any] | None] | None = None,
    ) -> list[dict[str, Any]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = kv_transfer_params or [None] * len(prompts)
        sps = [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=True,
                extra_args={"kv_transfer_params": p} if p is not None else None,
            )
            for p in params
        ]
        n_hits = len(self.rec.hits)
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sps, use_tqdm=False
        )
        results = []
        for prompt, out in zip(prompts, outs, strict=True):
            rid, rec = self.rec.find(out.request_id)
            gen = GenResult(
                request_id=out.request_id,
                engine_request_id=rid,
                prompt_token_ids=list(prompt),
                token_ids=list(out.outputs[0].token_ids),
                kv_transfer_params=out.kv_transfer_params,
                block_ids=rec["block_ids"] if rec else None,
                connector_hits=self.rec.hits_of(out.request_id, n_hits),
                finish_reason=out.outputs[0].finish_reason,
            )
            results.append(asdict(gen))
        return results

    def kv_info(self) -> dict[str, Any]:
        sched = self.rec.scheduler
        kcc = sched.kv_cache_config
        groups = [
            {
                "spec": type(g.kv_cache_spec).__name__,
                "block_size": g.kv_cache_spec.block_size,
                "layer_names": list(g.layer_names),
                "mamba_cache_mode": getattr(g.kv_cache_spec, "mamba_cache_mode", None),
            }
            for g in kcc.kv_cache_groups
        ]
        try:
            layout = self.rpc("layout")
        except NoSlotMapError as e:  # not CPU_ATTN, or a quantized cache: no slot map
            layout = {"error": str(e)}
        info = KVInfo(
            num_blocks=kcc.num_blocks,
            block_size=getattr(sched, "block_size", self.cfg.block_size),
            needs_kv_cache_zeroing=bool(getattr(kcc, "needs_kv_cache_zeroing", False)),
            cache_hit_alignment_tokens=getattr(kcc, "cache_hit_alignment_tokens", None),
            groups=groups,
            attn_layers=layout,
        )
        return asdict(info)

    def kvtail_counters(self) -> dict[str, int]:
        """The wrapper's counters so far (``vllm:kvtail_*`` in Prometheus, summed over
        labels, without the prefix); empty when the engine does not run the wrapper."""
        out: dict[str, int] = {}
        for metric in self.llm.get_metrics():
            if metric.name.startswith(KVTAIL_METRIC_PREFIX):
                name = metric.name[len(KVTAIL_METRIC_PREFIX) :].removesuffix("_total")
                out[name] = out.get(name, 0) + int(getattr(metric, "value", 0))
        return out

    def rpc(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.llm.collective_rpc(RPCS[name], args=args, kwargs=kwargs)[0]

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()


def _own_resource_tracker() -> None:
    """Give this process a resource tracker of its own (spawned children share the
    parent's): the semaphores vLLM leaves behind at ``os._exit`` are then reported
    in this engine's log, not on the parent's terminal."""
    tracker = resource_tracker.ResourceTracker()
    resource_tracker._resource_tracker = tracker
    for name in ("ensure_running", "register", "unregister", "getfd"):
        setattr(resource_tracker, name, getattr(tracker, name))


def engine_main(conn: Connection, cfg: EngineConfig, log_path: str) -> None:
    """Entry point of an engine process (spawned: a fresh interpreter)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    _own_resource_tracker()
    os.environ.update(BASE_ENV)
    os.environ.update(cfg.env)
    if cfg.nixl_progress_delay_us:  # whatever the connector is called, it may wrap NIXL
        slow_nixl_progress_thread(cfg.nixl_progress_delay_us)
    server: EngineServer | None = None
    code = 0
    try:
        try:
            t0 = time.monotonic()
            server = EngineServer(cfg)
            conn.send(("ok", {"startup_s": time.monotonic() - t0, "pid": os.getpid()}))
        except BaseException:
            conn.send(("err", traceback.format_exc()))
            code = 1
            return
        while True:
            try:
                method, args, kwargs = conn.recv()
            except (EOFError, OSError):
                return  # parent gone
            if method == "close":
                server.shutdown()
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", getattr(server, method)(*args, **kwargs)))
            except BaseException:
                conn.send(("err", traceback.format_exc()))
    finally:
        if server is not None:
            server.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip finalisers: NIXL may segfault in them
