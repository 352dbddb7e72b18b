"""``verify_kv: digest`` of region-described pages under TP > 1.

vLLM's CPU attention pages, ROCm's paged-attention planes and the DeepSeek
V3.2 fp8 indexer have no per-head view: a rank's page counts as one head.
Where TP shards the KV heads that key is the rank (its whole shard), where TP
replicates them it is the real head, counted once by P and compared on every
replica by D. Every P rank digests through ``RankDigests`` and the parts are
merged as the scheduler merges them; every D rank plans, checks and releases
its own load. Expected sums come from the plain reference
(``ops/digest/reference.py``); contents are written by the layouts' writers
(``tests/helpers/cpu_attn_writers.py``) or copied page by page, as a transfer
does, over poisoned pages.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import pytest
import torch

from kvtail_connector.extras.kv_verification.placement import HeadPlacement
from kvtail_connector.extras.metadata import MISMATCH, UNVERIFIED, VERIFIED
from kvtail_connector.extras.ops.digest.reference import reference_digest
from kvtail_connector.ops import RegionCache, indexer_cache
from kvtail_connector.pages.cpu import cpu_attn_regions
from kvtail_connector.pages.rocm import rocm_regions
from tests.helpers import cpu_attn_writers
from tests.helpers.kv_content import byte_views, logical_content
from tests.helpers.layouts import Backing, make_backing
from tests.scheduler.test_kv_digest import rank_heads, rank_part, rank_verdict

N = 16  # slots per page (one page per block)
D = 16  # head size (AMX tiles V by 16 elements)
LAYERS, PAGES, TOKENS = 2, 6, 40  # the last block holds tokens 32..39 of 48 slots
P_BLOCKS, D_BLOCKS = [4, 1, 5], [2, 5, 0]
HEAD_PAD = 16  # bytes after each head's page: served by no region
DTYPE = torch.bfloat16


def merged(parts: list[Any]) -> Any:
    """The ranks' parts folded as the scheduler folds them (after pickling,
    as the worker metadata crosses processes)."""
    parts = [pickle.loads(pickle.dumps(p)) for p in parts]
    out = parts[0]
    for part in parts[1:]:
        out = out.merged(part)
    assert out.ranks == len(parts)
    return out


def expected_sums(ranks: list[tuple[list[Any], int]], blocks: list[int]) -> dict:
    """Group 0's sums from the reference: each ``(caches, key)`` rank counted
    under ``key``."""
    out: dict[int, tuple[int, ...]] = {}
    for caches, key in ranks:
        spec = {"caches": caches, "head_offset": key}
        (sums,) = reference_digest([spec], [[(blocks, 0, TOKENS)]], 1024)[0]
        out.update({h: tuple(v) for h, v in sums.items()})
    return {0: out}


def verdicts(d_ranks: list[list[Any]], tp: int, total: int, digest: Any) -> list[str]:
    return [
        rank_verdict(caches, D_BLOCKS, TOKENS, digest, placement=HeadPlacement(r, tp, total))
        for r, caches in enumerate(d_ranks)
    ]


# ------------------------------------------------------------ CPU attention


class CpuRank:
    """One TP rank's CPU_ATTN caches (``[B, H, N, 2*D]`` per layer, each
    head's page padded by HEAD_PAD bytes) holding ``logical``'s tokens
    ``[0, TOKENS)`` of its heads, written by ``isa``'s writer into ``blocks``;
    every other byte poisoned."""

    def __init__(
        self, isa: str, logical: torch.Tensor, heads: list[int], blocks: list[int], seed: int
    ) -> None:
        self.isa, self.blocks = isa, blocks
        self.backing: Backing = make_backing(
            "LBHNC",
            num_layers=LAYERS,
            num_pages=PAGES,
            heads=len(heads),
            slots=N,
            content=2 * D,
            dtype=DTYPE,
            pad=(0, 0, HEAD_PAD, 0, 0),
            seed=seed,
        )
        slots = [blocks[t // N] * N + t % N for t in range(TOKENS)]
        for layer, view in enumerate(self.backing.views):
            kv = logical[layer, heads, :TOKENS].transpose(0, 1)  # [T, H, 2*D]
            cpu_attn_writers.write(isa, view, slots, kv[..., :D], kv[..., D:])
        writer = cpu_attn_writers.page_writer(isa)
        regions = cpu_attn_regions(self.backing.views[0], isa, writer=writer)
        self.caches = [RegionCache(v, N, regions) for v in self.backing.views]

    def flip_key(self, layer: int, token: int, head: int = 0) -> None:
        """Flip one byte of K element 0 of ``token`` (local ``head``)."""
        k_pos, _ = cpu_attn_writers.POSITIONS[self.isa](N, D)
        page = byte_views(self.backing.views, self.backing.raw)[layer][self.blocks[token // N]]
        at = int(k_pos[token % N, 0]) * DTYPE.itemsize
        page[head].view(-1)[at] ^= 0x10

    def flip_padding(self, layer: int, block_index: int) -> None:
        """Flip a byte after head 0's page of a block the load writes."""
        view = byte_views(self.backing.views, self.backing.raw)[layer]
        at = view[self.blocks[block_index], 0].storage_offset() + N * 2 * D * DTYPE.itemsize
        self.backing.raw.view(torch.uint8)[at] ^= 0x10


def cpu_ranks(
    isa: str, logical: torch.Tensor, tp: int, blocks: list[int], seed: int
) -> list[CpuRank]:
    total = logical.shape[1]
    return [CpuRank(isa, logical, rank_heads(r, tp, total), blocks, seed + r) for r in range(tp)]


def producer_digest(ranks: list[CpuRank], total: int) -> Any:
    tp = len(ranks)
    parts = [
        rank_part(rank.caches, P_BLOCKS, TOKENS, HeadPlacement(r, tp, total))
        for r, rank in enumerate(ranks)
    ]
    return merged(parts).digest()


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_sharded_cpu_pages_are_digested_per_rank_and_checked_per_rank(isa):
    logical = logical_content(LAYERS, 4, TOKENS, 2 * D, DTYPE, seed=1)
    p = cpu_ranks(isa, logical, 2, P_BLOCKS, seed=10)
    dg = producer_digest(p, total=4)
    assert dg is not None
    # Each rank's whole shard (two KV heads) under the rank's key.
    assert dg.sums == expected_sums([(p[0].caches, 0), (p[1].caches, 1)], P_BLOCKS)

    d = cpu_ranks(isa, logical, 2, D_BLOCKS, seed=20)
    assert verdicts([r.caches for r in d], 2, 4, dg) == [VERIFIED, VERIFIED]
    # Bytes no compared slot holds: the tail past the prompt, head padding.
    d[1].flip_key(layer=1, token=TOKENS + 3, head=1)
    d[1].flip_padding(layer=0, block_index=1)
    assert verdicts([r.caches for r in d], 2, 4, dg) == [VERIFIED, VERIFIED]
    d[1].flip_key(layer=1, token=21, head=1)  # a loaded token of global KV head 3
    assert verdicts([r.caches for r in d], 2, 4, dg) == [VERIFIED, MISMATCH]


def test_a_mismatch_in_a_sharded_page_names_the_ranks_heads(caplog):
    # The rank names what differs (at DEBUG; the scheduler side logs it once).
    caplog.set_level(logging.DEBUG)
    logical = logical_content(LAYERS, 4, TOKENS, 2 * D, DTYPE, seed=2)
    dg = producer_digest(cpu_ranks("vec", logical, 2, P_BLOCKS, seed=10), total=4)
    d = cpu_ranks("vec", logical, 2, D_BLOCKS, seed=20)
    d[1].flip_key(layer=0, token=5)
    assert verdicts([r.caches for r in d], 2, 4, dg) == [VERIFIED, MISMATCH]
    assert "KV cache group 0, KV heads 2-3 (digested as one page), tokens [0, 40)" in caplog.text


@pytest.mark.parametrize("d_tp", [1, 4])
def test_pages_sharded_over_another_tp_are_not_verified_never_a_mismatch(d_tp):
    # The same KV, P at TP 2 (two heads a page), D at TP 1 (four) or TP 4 (one).
    logical = logical_content(LAYERS, 4, TOKENS, 2 * D, DTYPE, seed=3)
    dg = producer_digest(cpu_ranks("vec", logical, 2, P_BLOCKS, seed=10), total=4)
    d = cpu_ranks("vec", logical, d_tp, D_BLOCKS, seed=20)
    assert verdicts([r.caches for r in d], d_tp, 4, dg) == [UNVERIFIED] * d_tp
    d[0].flip_key(layer=0, token=7)
    assert verdicts([r.caches for r in d], d_tp, 4, dg) == [UNVERIFIED] * d_tp


def test_replicated_cpu_pages_count_once_and_every_replica_is_checked():
    # TP 4 over 2 KV heads: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1.
    logical = logical_content(LAYERS, 2, TOKENS, 2 * D, DTYPE, seed=4)
    p = cpu_ranks("amx", logical, 4, P_BLOCKS, seed=10)
    dg = producer_digest(p, total=2)
    assert dg is not None
    assert dg.sums == expected_sums([(p[0].caches, 0), (p[2].caches, 1)], P_BLOCKS)
    d = cpu_ranks("amx", logical, 4, D_BLOCKS, seed=20)
    assert verdicts([r.caches for r in d], 4, 2, dg) == [VERIFIED] * 4
    d[3].flip_key(layer=1, token=33)
    assert verdicts([r.caches for r in d], 4, 2, dg) == [VERIFIED] * 3 + [MISMATCH]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 4), (4, 2)])
def test_one_head_pages_compare_across_tp(p_tp, d_tp):
    # Two KV heads at TP 2 (sharded) or TP 4 (replicated): one real head a
    # page either way, keyed by its global index.
    logical = logical_content(LAYERS, 2, TOKENS, 2 * D, DTYPE, seed=5)
    dg = producer_digest(cpu_ranks("vec", logical, p_tp, P_BLOCKS, seed=10), total=2)
    d = cpu_ranks("vec", logical, d_tp, D_BLOCKS, seed=20)
    assert verdicts([r.caches for r in d], d_tp, 2, dg) == [VERIFIED] * d_tp
    d[-1].flip_key(layer=0, token=0)
    assert verdicts([r.caches for r in d], d_tp, 2, dg) == [VERIFIED] * (d_tp - 1) + [MISMATCH]
    # TP 1 holds both heads in one page: another key.
    d1 = cpu_ranks("vec", logical, 1, D_BLOCKS, seed=30)
    assert verdicts([r.caches for r in d1], 1, 2, dg) == [UNVERIFIED]


# ------------------------------------------------- pages copied by a transfer


def copy_blocks(src: Backing, dst: Backing) -> None:
    """A transfer: every layer's P_BLOCKS pages of ``src`` into D_BLOCKS of ``dst``."""
    for s, d in zip(byte_views(src.views, src.raw), byte_views(dst.views, dst.raw), strict=True):
        for pb, db in zip(P_BLOCKS, D_BLOCKS, strict=True):
            d[db] = s[pb]


def test_sharded_rocm_planes_are_checked_per_rank():
    # ROCM_ATTN [B, 2, N, Hkv*D] views, 4 KV heads at TP 2: K x-packed, V plain.
    def rank(seed: int) -> tuple[Backing, list[RegionCache]]:
        b = make_backing(
            "LBHNC",
            num_layers=LAYERS,
            num_pages=PAGES,
            heads=2,
            slots=N,
            content=2 * D,
            dtype=DTYPE,
            seed=seed,
        )
        regions = rocm_regions(b.views[0], 2, D, v_interleaved=False)
        return b, [RegionCache(v, N, regions) for v in b.views]

    p = [rank(10 + r) for r in range(2)]
    parts = [rank_part(c, P_BLOCKS, TOKENS, HeadPlacement(r, 2, 4)) for r, (_, c) in enumerate(p)]
    dg = merged(parts).digest()
    assert dg is not None
    assert dg.sums == expected_sums([(p[0][1], 0), (p[1][1], 1)], P_BLOCKS)
    d = [rank(20 + r) for r in range(2)]
    for (pb, _), (db, _) in zip(p, d, strict=True):
        copy_blocks(pb, db)
    assert verdicts([c for _, c in d], 2, 4, dg) == [VERIFIED, VERIFIED]
    x = 16 // DTYPE.itemsize
    k_plane = byte_views(d[0][0].views, d[0][0].raw)[1][D_BLOCKS[2], 0].view(-1)
    k_plane[(TOKENS % N + 2) * x * DTYPE.itemsize] ^= 0x10  # K of slot 10: past the prompt
    assert verdicts([c for _, c in d], 2, 4, dg) == [VERIFIED, VERIFIED]
    k_plane[(TOKENS % N - 1) * x * DTYPE.itemsize] ^= 0x10  # K of the last prompt token
    assert verdicts([c for _, c in d], 2, 4, dg) == [MISMATCH, VERIFIED]


# --------------------------------------------------------- the fp8 indexer


def mla_rank(seed: int) -> tuple[list[Backing], list[Any]]:
    """DeepSeek V3.2's attention group on one rank: per layer an MLA latent
    ``[B, 1, N, C]`` and an fp8 indexer page (64-byte values of every slot,
    then 4-byte scales), both in one KV cache group."""
    latent = make_backing(
        "LBHNC",
        num_layers=LAYERS,
        num_pages=PAGES,
        heads=1,
        slots=N,
        content=8,
        dtype=DTYPE,
        seed=seed,
    )
    index = make_backing(
        "LBHNC",
        num_layers=LAYERS,
        num_pages=PAGES,
        heads=1,
        slots=N,
        content=68,
        dtype=torch.uint8,
        seed=seed + 1,
    )
    caches: list[Any] = []
    for view, page in zip(latent.views, index.views, strict=True):
        caches += [view, indexer_cache(page, 64, 4)]
    return [latent, index], caches


def same_pages(src: list[Backing], dst: list[Backing]) -> None:
    """``dst`` holds ``src``'s bytes (another replica of the same rank)."""
    for s, d in zip(src, dst, strict=True):
        d.raw.copy_(s.raw)


@pytest.fixture(scope="module")
def indexer_producer() -> tuple[list[Backing], Any]:
    """P at TP 2: the latent and indexer are replicated (MLA: one KV head),
    both ranks hold the same bytes. Its backing (rank 0) and merged digest."""
    ranks = [mla_rank(10), mla_rank(12)]
    same_pages(ranks[0][0], ranks[1][0])
    parts = [
        rank_part(c, P_BLOCKS, TOKENS, HeadPlacement(r, 2, 1)) for r, (_, c) in enumerate(ranks)
    ]
    assert parts[1].sums() == {0: {}}  # the second replica counts nothing
    dg = merged(parts).digest()
    assert dg is not None
    assert dg.sums == expected_sums([(ranks[0][1], 0)], P_BLOCKS)
    return ranks[0][0], dg


def consumer_ranks(p_backing: list[Backing], tp: int) -> list[tuple[list[Backing], list[Any]]]:
    ranks = [mla_rank(20 + 2 * r) for r in range(tp)]
    for backings, _ in ranks:
        for s, d in zip(p_backing, backings, strict=True):
            copy_blocks(s, d)
    return ranks


@pytest.mark.parametrize("d_tp", [1, 2, 4])
def test_replicated_indexer_pages_are_checked_on_every_rank(indexer_producer, d_tp):
    p_backing, dg = indexer_producer
    d = consumer_ranks(p_backing, d_tp)
    assert verdicts([c for _, c in d], d_tp, 1, dg) == [VERIFIED] * d_tp
    # One byte of the last rank's copy of a loaded token's fp8 values.
    index = d[-1][0][1]
    page = byte_views(index.views, index.raw)[1][D_BLOCKS[1]].view(-1)
    page[(20 % N) * 64 + 5] ^= 0x10
    assert verdicts([c for _, c in d], d_tp, 1, dg) == [VERIFIED] * (d_tp - 1) + [MISMATCH]


def test_indexer_scales_past_the_prompt_are_not_compared(indexer_producer):
    p_backing, dg = indexer_producer
    d = consumer_ranks(p_backing, 2)
    index = d[1][0][1]
    page = byte_views(index.views, index.raw)[0][D_BLOCKS[2]].view(-1)
    page[N * 64 + (TOKENS % N) * 4] ^= 0x10  # the scale of the first slot past the prompt
    assert verdicts([c for _, c in d], 2, 1, dg) == [VERIFIED, VERIFIED]
    page[N * 64 + (TOKENS % N - 1) * 4] ^= 0x10  # the last prompt token's scale
    assert verdicts([c for _, c in d], 2, 1, dg) == [VERIFIED, MISMATCH]


def test_pages_keyed_over_other_heads_per_rank_are_not_compared_even_with_equal_regions():
    # Region pages whose description does not show how many KV heads they
    # hold (a values-then-scales page), placed as if 4 KV heads were sharded:
    # at TP 2 a key sums two heads, at TP 4 one. The regions alone match.
    def ranks(tp: int, seed: int) -> list[list[Any]]:
        return [mla_rank(seed + 2 * r)[1][1::2] for r in range(tp)]

    parts = [
        rank_part(c, P_BLOCKS, TOKENS, HeadPlacement(r, 2, 4)) for r, c in enumerate(ranks(2, 10))
    ]
    dg = merged(parts).digest()
    assert dg is not None and sorted(dg.sums[0]) == [0, 1]
    assert verdicts(ranks(4, 20), 4, 4, dg) == [UNVERIFIED] * 4
    assert verdicts(ranks(2, 30), 2, 4, dg) == [MISMATCH] * 2  # the same key: compared
