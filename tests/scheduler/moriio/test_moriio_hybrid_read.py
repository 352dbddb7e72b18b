"""MoRIIO READ on a Mamba hybrid with two attention groups (issue 36, item 6).

On a Mamba hybrid vLLM's MoRIIO removes READ destinations from
``new_block_ids_to_zero`` itself (``MoRIIOConnectorScheduler.build_connector_meta``,
gated on ``_has_mamba``). 0.32 and 0.33 accept exactly one attention transfer
group in hybrid READ (``MoRIIOError`` otherwise) and filter ``block_ids[0]``;
0.34 accepts several and filters ``block_ids[:len(_attn_group_ids)]`` ("hybrid
READ metadata puts the aligned attention groups first"). Mamba pages are never
on the list: ``SingleTypeKVCacheManager`` records new blocks for zeroing only
in ``AttentionSpec`` groups that are not ``CircularBufferSpec``. So the wrapper
adds nothing to that filter on Mamba hybrids (``TailPolicy.excludes_reads`` is
off there) and only ships a READ-tail record, so that workers zero the
producer's stale tail of every attention group once the READ has landed.

The model here: full attention + sliding window (64 tokens) + Mamba, 64-token
blocks. The producer of a hybrid computes N - 1 prompt tokens
(``_truncate_mamba_request_for_prefill``) and sends, per attention group, its
window-clipped blocks of those, and the Mamba running-state slot. Expected
block sets come from the scheduler's allocation and the remote list lengths,
and are compared with what the plain MoRIIO's own ``build_connector_meta``
made of the very same scheduler output, never with the wrapper's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import MoRIIOError
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvtail_connector import _compat
from kvtail_connector.core.metadata import NULL_BLOCK
from tests.helpers.vllm_factories import HEAD_DIM, NUM_KV_HEADS
from tests.scheduler.moriio.test_moriio_read import NUM_BLOCKS, OTHER_TOKENS, Run, _peer_params

BLOCK = 64
WINDOW = 64
SWA_BLOCKS = -(-WINDOW // BLOCK) + 1  # MoRIIO's blocks_per_sw: the window, +1 for overlap
READ_TOKENS = 200  # the producer computed 199: 4 blocks, its tail stale from slot 7 of block 3
PRODUCER_BLOCKS = -(-(READ_TOKENS - 1) // BLOCK)
FULL, SWA, MAMBA = 0, 1, 2
ATTENTION = (FULL, SWA)

several_attention_groups = pytest.mark.skipif(
    _compat.check_vllm_version() < (0, 34),
    reason="vLLM 0.32/0.33 refuse hybrid READ with several attention groups",
)


def _hybrid_kv() -> KVCacheConfig:
    attn: dict[str, Any] = dict(
        block_size=BLOCK, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16
    )
    mamba = MambaSpec(
        block_size=BLOCK,
        shapes=((4, 64), (8, 16, 16)),  # conv, ssm: sizes are irrelevant here
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode="align",
    )
    kv = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(**attn)),
            KVCacheGroupSpec(
                ["model.layers.1.self_attn.attn"], SlidingWindowSpec(**attn, sliding_window=WINDOW)
            ),
            KVCacheGroupSpec(["model.layers.2.mixer"], mamba),
        ],
    )
    assert kv.needs_kv_cache_zeroing and kv.has_mamba_layers
    return kv


@pytest.fixture
def hybrid_run() -> Iterator[Callable[..., Run]]:
    """Builds a real scheduler with MoRIIO READ (plain or wrapped) on
    :func:`_hybrid_kv`; shut down after the test."""
    runs: list[Run] = []

    def factory(*, wrapped: bool) -> Run:
        run = Run(
            wrapped=wrapped,
            kv_cache_config=_hybrid_kv(),
            block_size=BLOCK,
            enable_prefix_caching=True,
            mamba_cache_mode="align",
            prefix_match_unit=16,
        )
        runs.append(run)
        return run

    yield factory
    for run in runs:
        run.scheduler.shutdown()


def _remote() -> list[list[int]]:
    """What a hybrid producer's ``request_finished`` sends for 199 computed
    tokens: each attention group's window-clipped blocks, then the Mamba slot."""
    full = list(range(1000, 1000 + PRODUCER_BLOCKS))
    swa = list(range(2000, 2000 + PRODUCER_BLOCKS))[-SWA_BLOCKS:]
    return [full, swa, [3000]]


class Step:
    """One scheduled step with a READ and a local request, and what the plain
    MoRIIO's ``build_connector_meta`` left in the list before the wrapper ran."""

    def __init__(self, run: Run) -> None:
        moriio = run.scheduler.connector.inner if run.wrapped else run.scheduler.connector
        build = moriio.build_connector_meta
        self.after_inner: list[list[int]] = []

        def spy(scheduler_output: Any) -> Any:
            meta = build(scheduler_output)
            self.after_inner.append(list(scheduler_output.new_block_ids_to_zero or ()))
            return meta

        moriio.build_connector_meta = spy
        run.add("read", READ_TOKENS, _peer_params(_remote(), req_id="read"))
        run.add("other", OTHER_TOKENS)
        self.out = run.scheduler.schedule()
        self.alloc = {r: run.blocks(r) for r in ("read", "other")}
        (self.built,) = run.built
        self.recv = run.inner_meta(self.out).reqs_to_recv["read"]

    def read_destinations(self) -> dict[int, list[int]]:
        """Per attention group, the blocks the READ writes, from the allocation:
        MoRIIO clips a sliding-window group to its window, then pairs the
        local suffix with the remote list (``_align_read_blocks``)."""
        read = self.alloc["read"]
        remote = _remote()
        return {
            FULL: read[FULL][: len(remote[FULL])],
            SWA: read[SWA][-SWA_BLOCKS:][: len(remote[SWA])],
        }


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "wrapped"])
def test_hybrid_read_takes_several_attention_groups_from_0_34(hybrid_run, wrapped):
    if _compat.check_vllm_version() < (0, 34):
        with pytest.raises(MoRIIOError, match="exactly one transferable attention group"):
            hybrid_run(wrapped=wrapped)
        return
    run = hybrid_run(wrapped=wrapped)
    moriio = run.scheduler.connector.inner if wrapped else run.scheduler.connector
    scheduler = moriio.connector_scheduler
    assert (scheduler._attn_group_ids, scheduler._mamba_group_ids) == ([FULL, SWA], [MAMBA])
    if wrapped:
        assert not run.scheduler.connector._policy.excludes_reads  # left to vLLM


@several_attention_groups
def test_every_attention_groups_read_destinations_are_left_to_vllm(hybrid_run):
    plain = Step(hybrid_run(wrapped=False))
    run = hybrid_run(wrapped=True)
    step = Step(run)
    assert step.alloc == plain.alloc  # the same allocation: the lists compare
    dests = step.read_destinations()
    read, other = step.alloc["read"], step.alloc["other"]
    assert [list(g) for g in step.recv.local_block_ids[:2]] == [dests[FULL], dests[SWA]]
    assert [len(dests[g]) for g in ATTENTION] == [PRODUCER_BLOCKS, SWA_BLOCKS]

    # vLLM recorded every new attention page of both requests for zeroing
    # (not the null block filling the sliding window's gap), and no Mamba
    # page: the READ's Mamba slot is not on the list to begin with.
    null = _compat.NULL_BLOCK_ID
    attention_pages = [b for r in (read, other) for g in ATTENTION for b in r[g] if b != null]
    assert sorted(step.built) == sorted(attention_pages)
    mamba_slot = list(step.recv.local_block_ids[2])
    assert len(mamba_slot) == 1 and not set(mamba_slot) & set(step.built)
    read_dests = set(dests[FULL]) | set(dests[SWA])
    assert read_dests <= set(step.built)  # so removing them is a real change

    # vLLM's own filter removed the READ destinations of both attention groups.
    expected = [b for b in step.built if b not in read_dests]
    assert plain.out.new_block_ids_to_zero == expected
    assert step.after_inner == [expected]
    # The wrapper zeroes exactly what plain vLLM zeroes: none of what vLLM
    # excluded, and every new page vLLM keeps (the local request's here).
    assert step.out.new_block_ids_to_zero == expected
    assert not read_dests & set(step.out.new_block_ids_to_zero)
    assert {b for g in ATTENTION for b in other[g]} <= set(step.out.new_block_ids_to_zero)
    stats = run.scheduler.connector.get_kv_connector_stats()
    assert stats is None or stats["read_blocks_exempted"] == 0


@several_attention_groups
def test_read_tail_record_covers_every_attention_groups_tail_block(hybrid_run):
    step = Step(hybrid_run(wrapped=True))
    dests = step.read_destinations()
    read = step.alloc["read"]
    # The READ brings the producer's block 3, stale from slot 7 (token 199);
    # this step recomputes token 199 there; slots 8.. keep the producer's tail.
    (record,) = step.out.kv_connector_metadata.read_loads
    assert (record.req_id, record.num_local, record.num_loaded) == ("read", 0, READ_TOKENS)
    tail = READ_TOKENS // BLOCK
    assert READ_TOKENS % BLOCK  # not block-aligned: a tail to zero
    assert [load.group for load in record.groups] == list(ATTENTION)  # no Mamba group
    for load in record.groups:
        ids = [NULL_BLOCK if b == _compat.NULL_BLOCK_ID else b for b in read[load.group]]
        assert (load.first_block, list(load.block_ids)) == (0, ids[: tail + 1])
        assert load.block_ids[tail - load.first_block] in dests[load.group]


@several_attention_groups
def test_worker_zeroes_each_attention_groups_read_tail_once_landed(hybrid_run):
    # The real scheduler's record, handed to a worker over CPU caches: the
    # READ lands (whole producer pages, stale tails included) in both
    # attention groups; 0.34 has every READ landed when start_load_kv returns,
    # so the worker zeroes, before the forward, slots 8.. of each group's tail
    # block (the producer's KV is valid to slot 6, this step writes slot 7)
    # and nothing else.
    from kvtail_connector.ops import reference_zero_kv_blocks
    from tests.helpers.layouts import rebase
    from tests.helpers.worker_caches import allocate, make_tail_worker

    assert _compat.moriio_reads_landed_at_start(None)
    kv = _hybrid_kv()
    step = Step(hybrid_run(wrapped=True))
    dests = step.read_destinations()
    tail_block = {g: step.alloc["read"][g][READ_TOKENS // BLOCK] for g in ATTENTION}
    caches = allocate(kv)  # attention layers only: Mamba state has no token slots
    worker = make_tail_worker(kv)
    worker.register_kv_caches(caches.views, kv, caches.layers)
    worker.bind(step.out.kv_connector_metadata)
    gen = torch.Generator().manual_seed(0)
    expected = {}
    for g in ATTENTION:
        (name,) = kv.kv_cache_groups[g].layer_names
        page = caches.views[name].view(torch.int8)  # [B, H, N, C bytes]
        for block in dests[g]:  # the READ lands
            page[block].copy_(torch.randint(-128, 128, page[block].shape, generator=gen))
        expected[g] = caches.raw[g].clone()
        first_stale = READ_TOKENS % BLOCK
        reference_zero_kv_blocks(
            rebase([caches.views[name]], expected[g]), (), [(tail_block[g], first_stale)]
        )
        assert not torch.equal(expected[g], caches.raw[g])  # a stale tail to zero
    worker.reads_started(landed=True)
    for g in ATTENTION:
        assert torch.equal(caches.raw[g], expected[g]), g
    worker.end_step()
    assert worker.num_tracked == 0
