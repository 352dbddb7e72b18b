"""A real vLLM Scheduler and a worker, both running KVTailConnector around the
async transport double (tests/helpers/async_double.py).

The "transport" is simulated by writing the loaded tokens into the worker's KV
views (made with vLLM's own view helpers, poisoned with NaN) before the load
completes; tests then read each slot's state back.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtail_connector.config import KVTailConfig
from kvtail_connector.core.metadata import KVTailMetadata
from kvtail_connector.core.stats import KVTailStats
from kvtail_connector.facade.connector import KVTailConnector
from kvtail_connector.facade.inner import wrapper_fields
from tests.helpers import async_double
from tests.helpers.vllm_factories import (
    assert_scheduler_empty,
    make_request,
    make_scheduler,
    make_vllm_config,
    make_worker_connector,
    run_step,
)
from tests.helpers.worker_caches import allocate

BLOCK = 16
LOADED = 1.0  # what the simulated transport writes


class Harness:
    """A real scheduler and worker, both running KVTailConnector."""

    def __init__(self, zero_tails: str = "always", kv_cache_config: Any = None, **kw: Any):
        """``kw``: the wrapper's other settings (KVTailConfig fields such as
        ``probe_stale_tails``), the rest to ``make_vllm_config``."""
        extra = {
            "backend": "AsyncLoadDouble",
            "backend_module_path": async_double.MODULE_PATH,
            "zero_tails": zero_tails,
            "backend_extra_config": kw.pop("backend_extra_config", {}),
        }
        extra.update({k: kw.pop(k) for k in list(kw) if k in KVTailConfig.model_fields})
        kw.setdefault("kv_load_failure_policy", "recompute")
        self.vllm_config = make_vllm_config(
            **wrapper_fields(extra),
            **kw,
        )
        self.scheduler = make_scheduler(self.vllm_config, kv_cache_config)
        self.kv_cache_config = self.scheduler.kv_cache_config
        self.worker = make_worker_connector(self.vllm_config, self.kv_cache_config)
        assert isinstance(self.scheduler.connector, KVTailConnector)
        assert isinstance(self.worker, KVTailConnector)
        self.caches = allocate(self.kv_cache_config)
        self.worker.register_kv_caches(self.caches.publish(self.vllm_config))
        self.metas: list[KVTailMetadata] = []
        # What the worker and the scheduler side reported, summed (the
        # held_requests gauge: as last reported, per side).
        self.stats = KVTailStats()
        self.held: dict[str, int] = {}
        for side, connector in (("worker", self.worker), ("scheduler", self.scheduler.connector)):
            self._capture(side, connector)

    def _capture(self, side: str, connector: Any) -> None:
        report = connector.get_kv_connector_stats

        def capture() -> Any:
            if side == "scheduler":
                _check_holding(connector._scheduler)
            stats = report()
            if stats is not None:
                payload = stats.to_dict()
                if "held_requests" in payload:
                    self.held[side] = payload["held_requests"]
                self.stats.aggregate(KVTailStats.from_dict(payload))
            return stats

        connector.get_kv_connector_stats = capture

    @property
    def inner_scheduler(self) -> Any:
        return self.scheduler.connector.inner

    def add(self, req_id: str, num_tokens: int, max_tokens: int = 4, **params: Any) -> Any:
        request = make_request(
            req_id,
            num_tokens,
            block_size=self.scheduler.hash_block_size,
            kv_transfer_params=params or None,
            max_tokens=max_tokens,
        )
        self.scheduler.add_request(request)
        return request

    def step(self) -> Any:
        out, _ = run_step(self.scheduler, self.worker)
        assert isinstance(out.kv_connector_metadata, KVTailMetadata)
        self.metas.append(out.kv_connector_metadata)
        return out

    def land(self, req_id: str, group: int, num_local: int, num_loaded: int) -> None:
        """The transport writes tokens [num_local, num_loaded) of ``req_id``."""
        ids = self.inner_scheduler.blocks_by_req[req_id][group]
        bs = self.kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size
        for layer in self.kv_cache_config.kv_cache_groups[group].layer_names:
            view = self.caches.views[layer]
            for t in range(num_local, num_loaded):
                view[ids[t // bs], :, t % bs, :] = LOADED

    def finish(self, max_steps: int = 50) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                break
            self.step()
        else:
            raise AssertionError("requests did not finish")
        self.scheduler.schedule()
        assert_scheduler_empty(self.scheduler)
        assert self.worker.scheduler_state_is_empty(), "the worker kept load records"
        assert all(v == 0 for v in self.held.values()), f"held_requests gauge: {self.held}"

    def records(self) -> list[Any]:
        return [r for m in self.metas for r in m.loads]

    def vouched(self) -> list[bool]:
        """Per record of :meth:`records`: a producer's claim covers its tail
        (the extras' payload of its step says so)."""
        return [
            m.extra is not None and r.req_id in m.extra.vouched for m in self.metas for r in m.loads
        ]


def _check_holding(scheduler: Any) -> None:
    """The scheduler side's ``held_requests`` gauge is the union of every
    part's ``held()``."""
    ids: set[str] = set()
    for part in scheduler._holders:
        ids |= set(part.held())
    assert scheduler.held_requests() == len(ids)


def routed(p_params: dict[str, Any], kvtail: Any = ...) -> dict[str, Any]:
    """What a router hands D from P's answer (the transfer's identity and the
    ``kvtail`` entry, P's own or ``kvtail`` in its place), without the keys
    that would make the transport double expect a real P."""
    from kvtail_connector.extras import entry, trust

    out = {k: p_params[k] for k in trust.BINDING_KEYS if k in p_params}
    out[entry.KEY] = p_params[entry.KEY] if kvtail is ... else kvtail
    return out


def slot_state(view: torch.Tensor, block: int) -> list[str]:
    """Per slot of a block: 'loaded', 'zero' or 'stale' (anything else)."""
    out = []
    for s in range(view.shape[2]):
        slot = view[block, :, s, :]
        if torch.all(slot == LOADED):
            out.append("loaded")
        elif torch.all(slot == 0):
            out.append("zero")
        else:
            out.append("stale")
    return out
