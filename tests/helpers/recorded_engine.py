"""A recorded engine for the differential run (scripts/differential.py): vLLM's
Scheduler and a worker, both running KVTailConnector around a landing double
(tests/helpers/landing_doubles.py), every hook vLLM or the runner calls traced.

:class:`Engine` builds both sides the way tests/helpers/vllm_factories.py does
(vLLM's factory, vLLM's KV views), drives the worker in the model runner's order
with a forward that writes every scheduled token's KV layer by layer, and after
each step returns what the wrapper showed vLLM: each hook's answer
(build_connector_meta's and build_connector_worker_meta's inner part only: the
wrapper's own records are internal, their effects traced), vLLM's zero list, the
requests' states, the stats payload, the Prometheus values, a hash of the KV bytes.

Only the facade and ``kvtail_connector.connectors`` are touched: the same file
drives two versions of the package, whose internal modules may differ.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import zlib
from typing import Any

import torch
import vllm.triton_utils
from prometheus_client import Counter, Gauge, Histogram
from vllm.platforms.cpu import CpuPlatform

from tests.helpers import landing_doubles as doubles
from tests.helpers import vllm_factories as vf

# vLLM 0.34's CPU platform refuses every config on an x86 CPU without Triton;
# nothing here runs a vLLM kernel: told it is there, as tests/scheduler/conftest.py does.
if "HAS_TRITON" in inspect.getsource(CpuPlatform.check_and_update_config):
    vllm.triton_utils.HAS_TRITON = True

VERSION = "?"  # the package's version, traced as "<version>" (set_version): a bump is no change


def set_version(version: str) -> None:
    global VERSION
    VERSION = version


def canon(x: Any) -> Any:
    """``x`` as plain, ordered JSON: sets sorted, stats by payload, dataclasses by field."""
    if x is None or isinstance(x, (bool, int)):
        return x
    if isinstance(x, str):
        return "<version>" if x == VERSION else x
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, (set, frozenset)):
        return sorted((canon(i) for i in x), key=repr)
    if isinstance(x, (list, tuple)):
        return [canon(i) for i in x]
    if isinstance(x, dict):
        return {str(k): canon(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if callable(getattr(x, "to_dict", None)):
        return canon(x.to_dict())
    if dataclasses.is_dataclass(x):
        return {f.name: canon(getattr(x, f.name)) for f in dataclasses.fields(x)}
    return type(x).__name__


def scrub(exc: BaseException | str) -> str:
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return re.sub(r"0x[0-9a-fA-F]+", "0x?", text)


def argument(x: Any) -> Any:
    """A hook argument as traced: requests by id, blocks by ids, plain values; other
    objects (scheduler outputs, metadata, tensors) are traced by their effects."""
    if hasattr(x, "request_id"):
        return x.request_id
    if callable(getattr(x, "get_block_ids", None)):
        return canon(x.get_block_ids())
    plain = isinstance(x, (bool, int, str, set, frozenset, list, tuple)) or x is None
    return canon(x) if plain else None


def record_hooks(connector: Any, side: str, log: list[dict]) -> None:
    """Each outermost call of a public method of ``connector`` (what vLLM and the
    runner call) appends {hook, args, ret} to ``log``; the calls it makes inside
    are its own business (a refactor may route them differently)."""
    depth = [0]

    def recorded(name: str, method: Any) -> Any:
        def hook(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return method(*args, **kwargs)
            entry: dict[str, Any] = {"hook": f"{side}.{name}", "args": [argument(a) for a in args]}
            log.append(entry)
            depth[0] += 1
            try:
                result = method(*args, **kwargs)
            except Exception as exc:
                entry["raised"] = scrub(exc)
                raise
            finally:
                depth[0] -= 1
            inner = name in ("build_connector_meta", "build_connector_worker_meta")
            entry["ret"] = canon(getattr(result, "inner", result) if inner else result)
            return result

        return hook

    for name in dir(type(connector)):
        attr = inspect.getattr_static(type(connector), name)
        skipped = isinstance(attr, (classmethod, staticmethod, property)) or not callable(attr)
        if not (name.startswith("_") or skipped):
            setattr(connector, name, recorded(name, getattr(connector, name)))


class Metric:
    """Every Prometheus metric class for build_prom_metrics: values into a dict."""

    def __init__(self, values: dict[str, int], name: str, **_: Any) -> None:
        self.values, self.name = values, name

    def labels(self, *_: Any) -> Metric:
        return self

    def inc(self, amount: int = 1) -> None:
        self.values[self.name] = self.values.get(self.name, 0) + amount

    def set(self, value: int) -> None:
        self.values[self.name] = value


class Engine:
    """One engine: vLLM's Scheduler and a worker, both the wrapper, hooks recorded.

    ``extra``: the wrapper's settings (its ``kv_connector_extra_config``);
    ``model``: "plain" (one attention group), "hybrid" (attention + Mamba, block
    64) or "mixed" (fp8 MLA + a float group); ``failure_policy``: vLLM's
    ``kv_load_failure_policy``."""

    def __init__(self, role: str, extra: dict, model: str, failure_policy: Any) -> None:
        shape: dict[str, Any] = {"max_num_batched_tokens": 256}  # long prompts are chunked
        if model == "hybrid":
            kv = vf.make_hybrid_mamba_kv_cache_config(block_size=64, num_blocks=40)
            shape.update(block_size=64, enable_prefix_caching=True, mamba_cache_mode="align")
            shape.update(prefix_match_unit=16)
        elif model == "mixed":
            kv = vf.make_mixed_precision_kv_cache_config(block_size=16, num_blocks=96)
        else:
            kv = vf.make_kv_cache_config(block_size=16, num_blocks=96)
        self.vllm_config = config = vf.make_vllm_config(
            kv_connector="KVTailConnector",
            kv_connector_module_path="kvtail_connector",
            kv_connector_extra_config=extra,
            kv_role=role,
            kv_load_failure_policy=failure_policy,
            **shape,
        )
        self.scheduler = vf.make_scheduler(config, kv)
        self.kv_cache_config = self.scheduler.kv_cache_config
        self.worker = vf.make_worker_connector(config, self.kv_cache_config)
        self.caches = doubles.allocate(self.kv_cache_config)
        config.compilation_config.static_forward_context.update(self.caches.layers)
        self.worker.register_kv_caches(self.caches.views)
        self.hooks: list[dict] = []
        record_hooks(self.scheduler.connector, "s", self.hooks)
        record_hooks(self.worker, "w", self.hooks)
        self.prom: dict[str, int] = {}
        metric = lambda *a, **k: Metric(self.prom, *a, **k)  # noqa: E731
        build_prom = type(self.worker).build_prom_metrics
        types: Any = dict.fromkeys((Counter, Gauge, Histogram), metric)
        self.metrics = build_prom(config, types, ["e"], {0: ["0"]})
        self.finished_params: dict[str, Any] = {}  # the last step's, by request

    def add(self, req_id: str, prompt: int, params: dict, max_tokens: int) -> str:
        size = self.scheduler.hash_block_size
        self.scheduler.add_request(
            vf.make_request(
                req_id,
                prompt,
                block_size=size,
                max_tokens=max_tokens,
                kv_transfer_params=params or None,
            )
        )
        return f"add {req_id} ({prompt} tokens)"

    def requests(self) -> list[Any]:
        return sorted(self.scheduler.requests.values(), key=lambda r: r.request_id)

    def step(self) -> dict[str, Any]:
        """One engine step: schedule, the worker (with a forward), update."""
        self.hooks.clear()
        out = self.scheduler.schedule()
        kv_out = self.worker_step(out)
        runner = vf.make_model_runner_output(
            out, scheduler=self.scheduler, kv_connector_output=kv_out
        )
        finished, stats, self.finished_params = {}, None, {}
        for outs in self.scheduler.update_from_output(out, runner).values():
            for o in outs.outputs:
                if o.finish_reason is not None:
                    finished[o.request_id] = [o.finish_reason.name, canon(o.kv_transfer_params)]
                    self.finished_params[o.request_id] = o.kv_transfer_params
            if outs.scheduler_stats is not None:
                stats = outs.scheduler_stats.kv_connector_stats
        if stats and self.metrics is not None:
            self.metrics.observe(stats)
        return {
            "hooks": self.hooks[:],
            "zero": sorted(out.new_block_ids_to_zero or ()),
            "finished": finished,
            "stats": canon(stats),
            "prom": canon(self.prom),
            "requests": [
                [r.request_id, r.status.name, r.num_computed_tokens] for r in self.requests()
            ],
            "kv": self.kv_hash(),
        }

    def worker_step(self, out: Any) -> Any:
        """vllm_factories.run_worker_step, with the forward writing every layer's KV."""
        return vf.run_worker_step(self.worker, out, forward=self.forward)

    def forward(self, out: Any) -> None:
        """Per attention layer: wait_for_layer_load, each scheduled token's KV
        written (a value of request, position and layer), save_kv_layer."""
        scheduled = []  # (salt, positions, per-group block ids)
        for req_id, count in sorted(out.num_scheduled_tokens.items()):
            end = self.scheduler.requests[req_id].num_computed_tokens  # schedule() advanced it
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            scheduled.append(
                (zlib.crc32(req_id.encode()) % 251, torch.arange(end - count, end), blocks)
            )
        for g, group in enumerate(self.kv_cache_config.kv_cache_groups):
            if not any(layer in self.caches.views for layer in group.layer_names):
                continue  # Mamba: no views here
            size = group.kv_cache_spec.block_size
            positions = torch.cat([t for _, t, _ in scheduled])
            salts = torch.cat([torch.full_like(t, salt) for salt, t, _ in scheduled])
            rows = torch.cat([torch.tensor(b[g])[t // size] for _, t, b in scheduled])
            for i, layer in enumerate(group.layer_names):
                view = self.caches.views[layer]
                self.worker.wait_for_layer_load(layer)
                values = ((positions * 7 + salts + i * 101) % 251 + 1).to(view.dtype)
                if view.dtype.is_floating_point:
                    values *= 0.01
                view[rows, :, positions % size, :] = values.view(-1, 1, 1)
                self.worker.save_kv_layer(layer, view, None)  # type: ignore[arg-type]

    def kv_hash(self) -> str:
        """A CRC-32 of every attention layer's bytes (a difference is what counts)."""
        crc = 0
        for raw in self.caches.raw:
            crc = zlib.crc32(raw.numpy(), crc)  # type: ignore[arg-type]
        return f"{crc:08x}"

    def pages(self, block_ids: list[list[int]]) -> dict[str, list[Any]]:
        """This engine's pages of ``block_ids`` (per group), by layer: what a transfer copies."""
        groups = zip(self.kv_cache_config.kv_cache_groups, block_ids, strict=False)
        views = self.caches.views
        return {
            n: [views[n][b].clone() for b in ids]
            for g, ids in groups
            for n in g.layer_names
            if n in views
        }
