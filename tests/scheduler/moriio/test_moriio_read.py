"""MoRIIO READ destinations and vLLM's block zeroing, on a real vLLM Scheduler.

The scheduler and the inner ``MoRIIOConnector`` scheduler class are vLLM's own;
only the worker side is absent: ``MoRIIOConnectorWorker`` needs ``mori`` (an
RDMA engine) and ROCm, so no test here builds one. The scheduler side needs
neither, nor a live peer: in READ mode it only reads the peer's address from
``kv_transfer_params``; in WRITE mode it queues a ZMQ notify on a DEALER socket
that ``Scheduler.shutdown`` closes.

A READ-mode remote prefill needs these ``kv_transfer_params`` (0.32 and 0.33,
``MoRIIOConnectorScheduler.update_state_after_alloc`` and
``MoRIIOConnectorMetadata.add_new_req``): ``do_remote_prefill``,
``remote_block_ids`` (one list per transfer group; for a Mamba hybrid the
attention list first), ``remote_engine_id``, and, unless the request id embeds
the router's ZMQ address, ``remote_host``, ``remote_handshake_port`` and
``remote_notify_port``. ``transfer_id`` is synthesized when missing. The
constructor binds nothing: it only reads ``handshake_port`` / ``notify_port``
(defaults written in when absent) and ``host_ip`` (else ``get_ip()``).

0.32 vs 0.33: in READ mode 0.32's ``get_num_new_matched_tokens`` does not check
``do_remote_prefill`` (any consumer request "matches" ``N - computed - 1``
tokens, but only real READs reach ``reqs_to_recv``); 0.33 returns 0 for them.
READ tails are recorded on both: workers zero them after ``start_load_kv`` (0.33)
or per layer after ``wait_for_layer_load`` (0.32), once the READ has landed.

Expected block sets are computed from what the scheduler allocated
(``KVCacheManager.get_block_ids``) and from the remote list lengths, never from
the wrapper's output.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import vllm
from vllm.v1.core.sched.scheduler import Scheduler

from kvtail_connector.core.metadata import KVTailMetadata
from kvtail_connector.core.stats import COUNTERS
from kvtail_connector.facade.connector import KVTailConnector
from kvtail_connector.facade.inner import wrapper_fields
from tests.helpers.vllm_factories import (
    make_hybrid_mamba_kv_cache_config,
    make_kv_cache_config,
    make_mixed_precision_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
    run_step,
)

BLOCK = 16
HOST = "127.0.0.1"
NUM_BLOCKS = 64


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _moriio_extra(read: bool) -> dict[str, Any]:
    # host_ip avoids get_ip(); the scheduler side binds none of these ports.
    return {
        "read_mode": "true" if read else "false",
        "host_ip": HOST,
        "handshake_port": _free_port(),
        "notify_port": _free_port(),
    }


def _peer_params(remote_block_ids: list[list[int]], *, req_id: str) -> dict[str, Any]:
    """What the proxy forwards from the prefill's ``request_finished``."""
    port = _free_port()
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": remote_block_ids,
        "remote_engine_id": f"{HOST}:{port}",
        "remote_host": HOST,
        "remote_handshake_port": port,
        "remote_notify_port": _free_port(),
        "transfer_id": f"xfer-{req_id}",
    }


class Run:
    """One real scheduler with MoRIIO, plain or wrapped by KVTailConnector."""

    def __init__(
        self,
        *,
        wrapped: bool,
        kv_cache_config: Any,
        read: bool = True,
        kv_role: str = "kv_consumer",
        zero_tails: str = "auto",
        vouch_tails: str = "auto",
        **config_kwargs: Any,
    ) -> None:
        inner_extra = _moriio_extra(read)
        if wrapped:
            vllm_config = make_vllm_config(
                **wrapper_fields(
                    {
                        "backend": "MoRIIOConnector",
                        "backend_extra_config": inner_extra,
                        "zero_tails": zero_tails,
                        "vouch_tails": vouch_tails,
                    }
                ),
                kv_role=kv_role,
                **config_kwargs,
            )
        else:
            vllm_config = make_vllm_config(
                kv_connector="MoRIIOConnector",
                kv_role=kv_role,
                kv_connector_extra_config=inner_extra,
                **config_kwargs,
            )
        self.scheduler: Scheduler = make_scheduler(vllm_config, kv_cache_config)
        self.wrapped = wrapped
        connector = self.scheduler.connector
        moriio = connector.inner if wrapped else connector
        assert type(moriio).__name__ == "MoRIIOConnector"
        assert isinstance(connector, KVTailConnector) == wrapped
        # The list object the scheduler built this step, before any connector saw it.
        self.built: list[list[int] | None] = []
        build = self.scheduler._get_new_block_ids_to_zero

        def capture() -> list[int] | None:
            ids = build()
            self.built.append(ids)
            return ids

        self.scheduler._get_new_block_ids_to_zero = capture  # type: ignore[method-assign]
        # How often the wrapper looked up READ destinations (0: it left the list alone).
        self.lookups = 0
        if wrapped:
            adapter = connector._scheduler._adapter
            read_destinations = adapter.read_destinations

            def spy(inner_meta: Any) -> Any:
                self.lookups += 1
                return read_destinations(inner_meta)

            adapter.read_destinations = spy

    def add(self, req_id: str, num_tokens: int, params: dict[str, Any] | None = None, **kw: Any):
        request = make_request(
            req_id,
            num_tokens,
            block_size=self.scheduler.hash_block_size,
            kv_transfer_params=params,
            **kw,
        )
        self.scheduler.add_request(request)
        return request

    def blocks(self, req_id: str) -> tuple[list[int], ...]:
        return tuple(list(g) for g in self.scheduler.kv_cache_manager.get_block_ids(req_id))

    def inner_meta(self, out: Any) -> Any:
        meta = out.kv_connector_metadata
        if self.wrapped:
            assert isinstance(meta, KVTailMetadata)
            return meta.inner
        return meta


@pytest.fixture
def make_run() -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []

    def factory(**kw: Any) -> Run:
        run = Run(**kw)
        runs.append(run)
        return run

    yield factory
    for run in runs:
        run.scheduler.shutdown()  # closes MoRIIO's ZMQ sockets (WRITE notifies)


def _flat(groups: Any) -> list[int]:
    return [b for g in groups for b in g]


def _mixed() -> Any:
    kv = make_mixed_precision_kv_cache_config(block_size=BLOCK, num_blocks=NUM_BLOCKS)
    assert kv.needs_kv_cache_zeroing and not kv.has_mamba_layers
    return kv


# ----------------------------------------------------------- 1. mixed precision


# A 97-token prompt takes 7 local blocks per group; the prefill sends 6 (it
# computed 96 tokens), so MoRIIO's _align_read_blocks keeps the 7th block, which
# holds the locally recomputed last token, out of the READ.
READ_TOKENS = 97
REMOTE_BLOCKS = 6
LOCAL_BLOCKS = 7
OTHER_TOKENS = 40  # a second request in the same step, no remote prefill


def _read_step(run: Run) -> tuple[Any, dict[str, tuple[list[int], ...]]]:
    remote = [list(range(1000, 1000 + REMOTE_BLOCKS)), list(range(2000, 2000 + REMOTE_BLOCKS))]
    run.add("read", READ_TOKENS, _peer_params(remote, req_id="read"))
    run.add("other", OTHER_TOKENS)
    out = run.scheduler.schedule()
    alloc = {r: run.blocks(r) for r in ("read", "other")}
    assert [len(g) for g in alloc["read"]] == [LOCAL_BLOCKS, LOCAL_BLOCKS]
    (built,) = run.built
    # No prefix caching: every block of both requests in both (attention)
    # groups is new this step, and vLLM recorded all of them for zeroing
    # (the READ is synchronous, so nothing was skipped).
    assert built is not None
    assert sorted(built) == sorted(_flat(alloc["read"]) + _flat(alloc["other"]))
    # MoRIIO READs into the first REMOTE_BLOCKS local blocks of every group.
    recv = run.inner_meta(out).reqs_to_recv
    assert list(recv) == ["read"]
    assert [list(g) for g in recv["read"].local_block_ids] == [
        g[:REMOTE_BLOCKS] for g in alloc["read"]
    ]
    return out, alloc


def test_mixed_precision_read_destinations_are_kept_from_zeroing(make_run):
    run = make_run(wrapped=True, kv_cache_config=_mixed())
    out, alloc = _read_step(run)
    dests = {b for g in alloc["read"] for b in g[:REMOTE_BLOCKS]}
    assert len(dests) == 2 * REMOTE_BLOCKS
    (built,) = run.built
    # Exactly the READ destinations of both groups left, order kept.
    assert out.new_block_ids_to_zero == [b for b in built if b not in dests]
    kept = set(out.new_block_ids_to_zero)
    assert not kept & dests
    # The local recompute tail blocks and the other request's blocks stay.
    assert {g[REMOTE_BLOCKS] for g in alloc["read"]} <= kept
    assert set(_flat(alloc["other"])) <= kept
    assert run.lookups == 1
    # 96 tokens read: block-aligned, so no READ tail to record (either version).
    assert out.kv_connector_metadata.read_loads == ()


def test_plain_moriio_leaves_read_destinations_in_the_zeroing_list(make_run):
    # The race the wrapper closes: vLLM's own filter runs for Mamba hybrids only.
    run = make_run(wrapped=False, kv_cache_config=_mixed())
    out, alloc = _read_step(run)
    expected = _flat(alloc["read"]) + _flat(alloc["other"])
    assert sorted(out.new_block_ids_to_zero) == sorted(expected)
    for g in alloc["read"]:
        assert set(g[:REMOTE_BLOCKS]) <= set(out.new_block_ids_to_zero)


def test_read_exclusion_does_not_depend_on_tail_zeroing(make_run):
    run = make_run(wrapped=True, kv_cache_config=_mixed(), zero_tails="off")
    out, alloc = _read_step(run)
    dests = {b for g in alloc["read"] for b in g[:REMOTE_BLOCKS]}
    assert sorted(out.new_block_ids_to_zero) == sorted(
        set(_flat(alloc["read"]) + _flat(alloc["other"])) - dests
    )
    # Block 6 (the recomputed token 96) is not read, so there is no READ tail.
    assert out.kv_connector_metadata.read_loads == ()


# ------------------------------------------------------------------ 6. stats


def test_scheduler_stats_count_the_exempted_blocks(make_run):
    run = make_run(wrapped=True, kv_cache_config=_mixed())
    remote = [list(range(1000, 1000 + REMOTE_BLOCKS)), list(range(2000, 2000 + REMOTE_BLOCKS))]
    run.add("read", READ_TOKENS, _peer_params(remote, req_id="read"), max_tokens=3)
    run.add("other", OTHER_TOKENS, max_tokens=3)
    # The real path: update_from_output takes the scheduler connector's stats
    # and ships them in SchedulerStats.
    out, outputs = run_step(run.scheduler)
    (built,) = run.built
    removed = len(built) - len(out.new_block_ids_to_zero)
    alloc = run.blocks("read")
    assert removed == 2 * REMOTE_BLOCKS == len({b for g in alloc for b in g[:REMOTE_BLOCKS]})
    payload = outputs[0].scheduler_stats.kv_connector_stats
    assert payload is not None and payload["read_blocks_exempted"] == removed
    # Taken once: the next step (decode, no READ) reports nothing more.
    _, outputs = run_step(run.scheduler)
    payload = outputs[0].scheduler_stats.kv_connector_stats
    assert payload is None or payload["read_blocks_exempted"] == 0
    assert _counted_nothing(run)


def test_get_kv_connector_stats_right_after_the_step(make_run):
    run = make_run(wrapped=True, kv_cache_config=_mixed())
    out, alloc = _read_step(run)
    stats = run.scheduler.connector.get_kv_connector_stats()
    assert stats is not None
    assert stats["read_blocks_exempted"] == 2 * REMOTE_BLOCKS
    assert stats.to_dict()["read_blocks_exempted"] == len(run.built[0]) - len(
        out.new_block_ids_to_zero
    )


# ---------------------------------------------------------------- 2. WRITE mode


def _write_step(run: Run) -> tuple[Any, dict[str, tuple[list[int], ...]]]:
    params = _peer_params([[], []], req_id="write")  # WRITE: P writes into our blocks
    run.add("write", 100, params)
    run.add("other", OTHER_TOKENS)
    out = run.scheduler.schedule()
    return out, {r: run.blocks(r) for r in ("write", "other")}


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "wrapped"])
def test_write_mode_list_is_untouched(make_run, wrapped):
    run = make_run(wrapped=wrapped, kv_cache_config=_mixed(), read=False)
    out, alloc = _write_step(run)
    assert out.num_scheduled_tokens == {"other": OTHER_TOKENS}  # "write" awaits P's WRITE
    assert len(_flat(alloc["write"])) == 2 * 7  # 100 tokens, both groups
    # vLLM skips zeroing an async load's blocks itself; the other request's stay.
    assert sorted(out.new_block_ids_to_zero) == sorted(_flat(alloc["other"]))
    # Nothing received: the wrapper hands the scheduler's own list through.
    (built,) = run.built
    assert out.new_block_ids_to_zero is built
    assert not run.inner_meta(out).reqs_to_recv
    assert run.lookups == 0  # WRITE loads are async: no READ exclusion at all


def test_write_mode_wrapped_equals_plain(make_run):
    plain_out, plain_alloc = _write_step(
        make_run(wrapped=False, kv_cache_config=_mixed(), read=False)
    )
    wrapped = make_run(wrapped=True, kv_cache_config=_mixed(), read=False)
    out, alloc = _write_step(wrapped)
    assert alloc == plain_alloc  # same allocation, so the lists are comparable
    assert out.new_block_ids_to_zero == plain_out.new_block_ids_to_zero
    assert _counted_nothing(wrapped)


# ------------------------------------------------------------ 3. Mamba hybrid


HYBRID_BLOCK = 64
HYBRID_TOKENS = 129  # 3 attention blocks; the prefill computed 128 (2 blocks)


def _hybrid_run(make_run: Callable[..., Run], wrapped: bool) -> Run:
    kv = make_hybrid_mamba_kv_cache_config(block_size=HYBRID_BLOCK, num_blocks=NUM_BLOCKS)
    assert kv.needs_kv_cache_zeroing and kv.has_mamba_layers
    return make_run(
        wrapped=wrapped,
        kv_cache_config=kv,
        block_size=HYBRID_BLOCK,
        enable_prefix_caching=True,
        mamba_cache_mode="align",
        prefix_match_unit=16,
    )


def _hybrid_step(run: Run) -> tuple[Any, dict[str, tuple[list[int], ...]]]:
    # Hybrid READ payload: the attention list first, then one list per Mamba group.
    remote = [[1000, 1001], [2000]]
    run.add("read", HYBRID_TOKENS, _peer_params(remote, req_id="read"))
    run.add("other", OTHER_TOKENS)
    out = run.scheduler.schedule()
    alloc = {r: run.blocks(r) for r in ("read", "other")}
    attn = alloc["read"][0]
    assert len(attn) == 3
    recv = run.inner_meta(out).reqs_to_recv["read"]
    assert list(recv.local_block_ids[0]) == attn[:2]  # the recompute tail block is not read
    return out, alloc


def test_mamba_hybrid_read_is_left_to_vllm(make_run):
    plain = _hybrid_run(make_run, wrapped=False)
    plain_out, plain_alloc = _hybrid_step(plain)
    wrapped = _hybrid_run(make_run, wrapped=True)
    out, alloc = _hybrid_step(wrapped)
    assert alloc == plain_alloc
    # Only attention pages are zeroed (Mamba state is not an AttentionSpec);
    # vLLM's own MoRIIO filter removed the READ's attention destinations, so
    # what is left is the recompute tail block and the other request's page.
    expected = [alloc["read"][0][2], *alloc["other"][0]]
    assert sorted(plain_out.new_block_ids_to_zero) == sorted(expected)
    assert out.new_block_ids_to_zero == plain_out.new_block_ids_to_zero
    # The wrapper itself removed nothing.
    stats = wrapped.scheduler.connector.get_kv_connector_stats()
    assert stats is None or stats["read_blocks_exempted"] == 0
    # It looked once, for READ tails: the attention tail block is not read
    # (MoRIIO recomputes it) and vLLM zeroes it, so no record either.
    assert wrapped.lookups == 1
    assert out.kv_connector_metadata.read_loads == ()


# ------------------------------------------------------- 4. uniform precision


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "wrapped"])
def test_uniform_precision_has_nothing_to_zero(make_run, wrapped):
    kv = make_kv_cache_config(block_size=BLOCK, num_blocks=NUM_BLOCKS)
    assert not kv.needs_kv_cache_zeroing
    run = make_run(wrapped=wrapped, kv_cache_config=kv)
    remote = [list(range(1000, 1000 + LOCAL_BLOCKS))]
    run.add("read", READ_TOKENS, _peer_params(remote, req_id="read"))
    out = run.scheduler.schedule()
    assert run.built == [None]
    assert out.new_block_ids_to_zero is None
    assert list(run.inner_meta(out).reqs_to_recv) == ["read"]  # the READ did happen
    if wrapped:
        assert out.kv_connector_metadata.read_loads == ()  # "auto": vLLM zeroes nothing
        assert _counted_nothing(run)
        assert run.lookups == 0


# ------------------------------------------------ 5. nothing received this step


@pytest.mark.parametrize("side", ["producer", "consumer_local"])
def test_nothing_received_means_no_work_and_no_copy(make_run, side):
    if side == "producer":
        run = make_run(wrapped=True, kv_cache_config=_mixed(), kv_role="kv_producer")
        params: dict[str, Any] | None = {"do_remote_decode": True, "transfer_id": "xfer-p"}
    else:
        run = make_run(wrapped=True, kv_cache_config=_mixed())
        params = None  # a decode instance serving a request locally
    run.add("req", 100, params)
    out = run.scheduler.schedule()
    alloc = run.blocks("req")
    assert not run.inner_meta(out).reqs_to_recv
    (built,) = run.built
    assert out.new_block_ids_to_zero is built  # the same object: not rebuilt, not copied
    assert sorted(built) == sorted(_flat(alloc))
    assert _counted_nothing(run)


def test_read_into_cached_blocks_only_leaves_the_list_alone(make_run):
    # A READ whose destinations are all prefix-cache hits (MoRIIO reads into the
    # request's whole block list, aligned to the remote one): none of them is
    # new, so nothing is removed and the scheduler's list is kept as it is.
    run = make_run(wrapped=True, kv_cache_config=_mixed(), enable_prefix_caching=True)
    prompt = list(range(3, 3 + 100))
    cached = 6 * BLOCK
    run.add("warm", cached + 16, prompt_token_ids=prompt[:cached] + [500] * 16, max_tokens=1)
    run_step(run.scheduler)
    remote = [list(range(1000, 1006)), list(range(2000, 2006))]
    run.add("read", 100, _peer_params(remote, req_id="read"), prompt_token_ids=prompt)
    run.lookups = 0
    out = run.scheduler.schedule()
    alloc = run.blocks("read")
    recv = run.inner_meta(out).reqs_to_recv["read"]
    assert [list(g) for g in recv.local_block_ids] == [g[:6] for g in alloc]
    built = run.built[-1]
    assert sorted(built) == sorted(g[6] for g in alloc)  # only the recompute tail blocks
    assert out.new_block_ids_to_zero is built
    assert run.lookups == 1  # it looked (READ, zeroing on), found nothing to remove
    assert _counted_nothing(run)


# ---------------------------------------------------------------- 7. READ tails


def _vllm_minor() -> tuple[int, int]:
    major, minor = vllm.__version__.split(".")[:2]
    return int(major), int(minor)


@pytest.mark.parametrize("zero_tails", ["auto", "off"])
def test_read_load_record_matches_moriio_count(make_run, zero_tails):
    # "off" too: the READ's destinations are kept from vLLM's zeroing, so the
    # producer's tail it copies must still be zeroed by the wrapper.
    run = make_run(
        wrapped=True, kv_cache_config=_mixed(), enable_prefix_caching=True, zero_tails=zero_tails
    )
    prompt = list(range(3, 3 + 100))
    shared = 4 * BLOCK
    # Warm the prefix cache with the first 64 tokens (4 full blocks per group).
    run.add("warm", shared + 16, prompt_token_ids=prompt[:shared] + [500] * 16, max_tokens=1)
    warm_out, _ = run_step(run.scheduler)
    assert warm_out.kv_connector_metadata.read_loads == ()  # no READ, no record
    remote = [list(range(1000, 1000 + LOCAL_BLOCKS)), list(range(2000, 2000 + LOCAL_BLOCKS))]
    run.add("read", 100, _peer_params(remote, req_id="read"), prompt_token_ids=prompt)
    out = run.scheduler.schedule()
    alloc = run.blocks("read")

    # MoRIIO READ returns num_prompt - computed - 1 (the last token is recomputed).
    (new_req,) = [r for r in out.scheduled_new_reqs if r.req_id == "read"]
    assert new_req.num_computed_tokens == shared + (100 - shared - 1)
    assert out.num_scheduled_tokens["read"] == 1
    assert out.kv_connector_metadata.loads == ()  # a READ is not an async load

    # The tail block (token 99 at slot 3) is a READ destination the wrapper kept
    # from vLLM's zeroing (the READ overwrites it whole, producer's tail included).
    tail_blocks = {alloc[gid][99 // BLOCK] for gid in (0, 1)}
    assert tail_blocks <= {
        b for g in run.inner_meta(out).reqs_to_recv["read"].local_block_ids for b in g
    }
    assert not tail_blocks & set(out.new_block_ids_to_zero or ())

    # The record (both versions) counts the recomputed token too: the READ brings
    # the producer's whole tail block, this step's forward writes token 99 (slot 3),
    # and workers zero slots 4..15 once the READ has landed (0.33: after
    # start_load_kv; 0.32: per layer, after wait_for_layer_load, where a backend
    # that writes the KV before attention has already written slot 3).
    (record,) = out.kv_connector_metadata.read_loads
    assert record.req_id == "read"
    assert (record.num_local, record.num_loaded) == (shared, 99 + 1)
    first = shared // BLOCK
    assert [(g.group, g.first_block, list(g.block_ids)) for g in record.groups] == [
        (gid, first, alloc[gid][first:LOCAL_BLOCKS]) for gid in (0, 1)
    ]


@pytest.mark.parametrize("spec", [0, 2], ids=["no-spec", "spec-padded"])
@pytest.mark.parametrize("per_layer", [True, False], ids=["per-layer (0.32)", "at start"])
def test_read_record_zeroes_only_never_written_slots_as_reads_land(make_run, per_layer, spec):
    # The real scheduler's READ record, handed to a worker over CPU caches: each
    # layer's READ lands (the producer's whole pages, NaN-bearing tail included)
    # after the backend already wrote the recomputed token 99 (slot 3 of block 6)
    # and, with speculative decoding, the 1 + k padded rows (slots 3..3+k); the
    # READ puts the producer's bytes back there. The producer's KV is valid up
    # to its prompt (slot 3), so the worker must zero slots 4..15 of that block
    # (padded rows included) and nothing else.
    from kvtail_connector.ops import reference_zero_kv_blocks
    from tests.helpers.layouts import rebase
    from tests.helpers.worker_caches import allocate, make_tail_worker

    kv = _mixed()
    run = make_run(
        wrapped=True,
        kv_cache_config=kv,
        enable_prefix_caching=True,
        num_speculative_tokens=spec,
    )
    prompt = list(range(3, 3 + 100))
    shared = 4 * BLOCK
    run.add("warm", shared + 16, prompt_token_ids=prompt[:shared] + [500] * 16, max_tokens=1)
    run_step(run.scheduler)
    remote = [list(range(1000, 1000 + LOCAL_BLOCKS)), list(range(2000, 2000 + LOCAL_BLOCKS))]
    run.add("read", 100, _peer_params(remote, req_id="read"), prompt_token_ids=prompt)
    out = run.scheduler.schedule()
    assert out.num_scheduled_tokens["read"] == 1 + spec  # vLLM pads the new decode
    alloc = run.blocks("read")
    dests = run.inner_meta(out).reqs_to_recv["read"].local_block_ids

    caches = allocate(kv)
    worker = make_tail_worker(kv, zeroes_reads_by_layer=per_layer)
    worker.register_kv_caches(caches.views, kv, caches.layers)
    worker.bind(out.kv_connector_metadata)
    if per_layer:
        worker.reads_started(landed=False)
    gen = torch.Generator().manual_seed(0)
    layers = [(gid, name) for gid, g in enumerate(kv.kv_cache_groups) for name in g.layer_names]
    for gid, name in layers:
        page = caches.views[name].view(torch.int8)  # [B, H, N, C bytes]
        tail_block = alloc[gid][6]
        page[tail_block, :, 3 : 4 + spec].fill_(0x11)  # the step's KV update
        for block in dests[gid]:  # the READ lands, whole producer pages
            page[block].copy_(torch.randint(-128, 128, page[block].shape, generator=gen))
        if per_layer:
            expected = caches.raw[gid].clone()
            reference_zero_kv_blocks(rebase([caches.views[name]], expected), (), [(tail_block, 4)])
            worker.layer_loaded(name)
            assert torch.equal(caches.raw[gid], expected), name
    if not per_layer:
        expected_all = {gid: raw.clone() for gid, raw in caches.raw.items()}
        for gid, name in layers:
            reference_zero_kv_blocks(
                rebase([caches.views[name]], expected_all[gid]), (), [(alloc[gid][6], 4)]
            )
        worker.reads_started(landed=True)
        for gid, raw in caches.raw.items():
            assert torch.equal(raw, expected_all[gid])
    worker.end_step()
    assert worker.num_tracked == 0


def _counted_nothing(run: Any) -> bool:
    """True when the scheduler side counted nothing (a level it reports, the
    held_requests gauge, is not a count)."""
    stats = run.scheduler.connector.get_kv_connector_stats()
    return stats is None or not any(stats[name] for name in COUNTERS)


@pytest.mark.parametrize("vouch_tails", ["auto", "trust"])
def test_a_read_producer_vouches_by_default_where_reads_land_per_layer(make_run, vouch_tails):
    # auto: a producer vouches where an auto consumer on the same vLLM may skip
    # on the claim (READ tails zeroed layer by layer, 0.32); trust: everywhere.
    from kvtail_connector import _compat

    run = make_run(
        wrapped=True, kv_cache_config=_mixed(), kv_role="kv_producer", vouch_tails=vouch_tails
    )
    connector = run.scheduler.connector
    assert isinstance(connector, KVTailConnector)
    per_layer = _compat.moriio_reads_may_land_per_layer()
    assert connector._policy.vouches_for_tails is (vouch_tails == "trust" or per_layer)
    consumer = make_run(wrapped=True, kv_cache_config=_mixed(), vouch_tails=vouch_tails)
    assert isinstance(consumer.scheduler.connector, KVTailConnector)
    assert consumer.scheduler.connector._policy.trusts_read_claims is (
        vouch_tails == "trust" or per_layer
    )


@pytest.mark.parametrize("vouch_tails", ["auto", "trust"])
@pytest.mark.parametrize("per_layer", [True, False], ids=["per-layer (0.32)", "at start"])
def test_a_vouched_read_costs_no_zeroing_launch(make_run, per_layer, vouch_tails):
    # The producer vouched for its tail (a kvtail entry for this geometry and a
    # 100-token prompt, bound to this READ's params): the READ copies its blocks,
    # zero past the prompt at the source, so the worker arms no layer and zeroes
    # nothing. By default (auto) only in a step whose READ tails are zeroed per
    # layer (0.32, the READs not all landed at start), where skipping saves
    # milliseconds a step; where one launch at start zeroes them (0.33, or 0.32
    # under FULL CUDA graphs) the tail is zeroed and the claim counted unused.
    # With trust, skipped everywhere. A mismatched length, or an entry copied
    # from another transfer, gets today's zeroing.
    from kvtail_connector import _compat
    from kvtail_connector.core.stats import KVTailStats
    from kvtail_connector.extras import entry, entry_values, trust
    from tests.helpers.worker_caches import allocate, make_tail_worker

    kv = _mixed()
    geometry = entry_values.geometry([g.kv_cache_spec for g in kv.kv_cache_groups], 1, 1)
    trusted = vouch_tails == "trust" or _compat.moriio_reads_may_land_per_layer()
    for n, copied, vouched in ((100, False, trusted), (99, False, False), (100, True, False)):
        run = make_run(wrapped=True, kv_cache_config=kv, vouch_tails=vouch_tails)
        remote = [list(range(1000, 1000 + LOCAL_BLOCKS)), list(range(2000, 2000 + LOCAL_BLOCKS))]
        params = _peer_params(remote, req_id="read")
        bound = trust.binding(_peer_params(remote, req_id="other") if copied else params, 10**4)
        params[entry.KEY] = entry.Entry(n, geometry, tail_zero=True, binding=bound).to_json()
        run.add("read", 100, params)
        out = run.scheduler.schedule()
        meta = out.kv_connector_metadata
        (record,) = meta.read_loads
        assert (meta.extra is not None and record.req_id in meta.extra.vouched) is vouched
        counted = run.scheduler.connector.get_kv_connector_stats()
        # The binding is checked only where the claim can skip a zeroing: a
        # copied entry is declined there, elsewhere only counted unused.
        declined = n != 100 or (copied and trusted)
        assert counted["vouches_declined"] == declined
        assert counted["vouches_unused"] == (not declined and not vouched)

        caches = allocate(kv)
        stats = KVTailStats()
        worker = make_tail_worker(
            kv,
            zeroes_reads_by_layer=per_layer,
            checks_claims=True,  # as resolve_policy has it wherever a claim can be vouched
            trusts_load_claims=vouch_tails == "trust",
            stats=stats,
        )
        worker.register_kv_caches(caches.views, kv, caches.layers)
        worker.bind(out.kv_connector_metadata)
        before = {gid: raw.clone() for gid, raw in caches.raw.items()}
        worker.reads_started(landed=not per_layer)
        for g in kv.kv_cache_groups:
            for name in g.layer_names:
                worker.layer_loaded(name)
        worker.end_step()
        skipped = vouched and (per_layer or vouch_tails == "trust")
        unchanged = all(torch.equal(caches.raw[g], before[g]) for g in before)
        assert unchanged is skipped
        assert (stats["vouched_tails"], stats["tails_zeroed"]) == ((1, 0) if skipped else (0, 1))
        assert (stats["tail_bytes_zeroed"] == 0) is skipped
        # A vouched READ zeroed at start under auto: its claim was not used.
        assert stats["vouches_unused"] == (vouched and not skipped)
        assert worker.num_tracked == 0
