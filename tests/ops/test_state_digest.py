"""The state-group digest (``mix64-state-1``) against an independent reference,
and a producer's and a consumer's state digests of one request compared."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtail_connector import entry
from kvtail_connector.entry import Digest, Limits, StateDigest
from kvtail_connector.features.kv_verification.rank_states import RankStates, StateSet
from kvtail_connector.kvgroups import state_block
from kvtail_connector.metadata import (
    MISMATCH,
    UNVERIFIED,
    VERIFIED,
    ExpectedDigest,
    GroupLoad,
    LoadRecord,
)
from kvtail_connector.ops.state_digest import StateDigester, StateLayer

MASK = (1 << 64) - 1
WORD_MUL = 0xBF58476D1CE4E5B9


def _fmix(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK
    return x ^ (x >> 33)


def _reference(group: int, layers: list[StateLayer], block: int, shard: int) -> int:
    """The definition, over the page's raw bytes with numpy and Python ints."""
    seed = int.from_bytes(b"mix64-s1", "little")
    total = 0
    for li, layer in enumerate(layers):
        page = layer.pages[block].numpy().tobytes()
        for si, (offset, nbytes) in enumerate(layer.states):
            data = page[offset : offset + nbytes]
            data += b"\0" * (-len(data) % 4)
            words = np.frombuffer(data, dtype="<u4")
            plane = _fmix(_fmix(_fmix(_fmix(seed ^ group) ^ li) ^ si) ^ shard)
            for w, x in enumerate(words.tolist()):
                total += _fmix(((plane + w * WORD_MUL) & MASK) ^ x)
    return total & MASK


def _layers(seed: int, blocks: int = 6) -> list[StateLayer]:
    """Two layers: a bf16 conv state with an odd element count (a partial
    word) and a float32 SSM state, packed from offset 0 of padded pages."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        pages = torch.randint(0, 256, (blocks, 96), dtype=torch.uint8, generator=g)
        out.append(StateLayer(pages, ((0, 3 * 5 * 2), (30, 4 * 4 * 4))))
    return out


def test_sums_match_the_reference_per_request_and_group() -> None:
    a, b = _layers(1), _layers(2)
    digester = StateDigester([(1, a), (3, b)], shard=2)
    blocks = [[4, 0], [None, 5], [2, None]]
    got = digester.digest(blocks)
    for i, per in enumerate(blocks):
        for j, (gid, layers) in enumerate(((1, a), (3, b))):
            want = 0 if per[j] is None else _reference(gid, layers, per[j], 2)
            assert int(got[i, j]) & MASK == want, (i, j)


def test_placement_does_not_change_the_sum_and_any_byte_does() -> None:
    a = _layers(3)
    copy = [StateLayer(layer.pages.roll(2, dims=0).clone(), layer.states) for layer in a]
    here = StateDigester([(0, a)], shard=0).digest([[1]])
    there = StateDigester([(0, copy)], shard=0).digest([[3]])  # the same page, block 3
    assert int(here[0, 0]) == int(there[0, 0])
    assert int(StateDigester([(0, a)], shard=1).digest([[1]])[0, 0]) != int(here[0, 0])
    for layer, byte in ((0, 0), (1, 29), (1, 30 + 63)):
        copy[layer].pages[3, byte] ^= 0x10
        assert int(StateDigester([(0, copy)], shard=0).digest([[3]])[0, 0]) != int(here[0, 0])
        copy[layer].pages[3, byte] ^= 0x10
    # Padding past the states is not digested.
    copy[0].pages[3, 95] ^= 0xFF
    assert int(StateDigester([(0, copy)], shard=0).digest([[3]])[0, 0]) == int(here[0, 0])


def test_a_state_that_does_not_fit_its_page_is_refused() -> None:
    pages = torch.zeros((2, 16), dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not fit"):
        StateDigester([(0, [StateLayer(pages, ((8, 12),))])], shard=0)


def test_the_state_block_is_the_last_before_the_scratch_blocks() -> None:
    assert state_block([7], 0) == (0, 7)
    assert state_block([0, 0, 9, 4, 5], 2) == (2, 9)
    assert state_block([9], 2) == (0, 9)  # before scratch allocation
    assert state_block([], 0) is None


def _set(layers: list[StateLayer], gid: int = 1) -> StateSet:
    return StateSet(gid, layers, ["m0", "m1"], ["[(3, 5)]:bf16", "[(4, 4)]:f32"])


def _producer_digest(p: RankStates, block: int, n: int = 40) -> Digest:
    record = LoadRecord("r", 0, n, (), states=(GroupLoad(1, 0, (block,)),))
    part = p.digest_prompts([record])["r"]
    states = part.digest()
    assert states is not None
    return Digest("mix64-1", 1024, "0" * 16, {}, states)


def _check(d: RankStates, digest: Digest, block: int) -> str:
    record = LoadRecord(
        "r", 0, 40, (), expected=ExpectedDigest(40, digest), states=(GroupLoad(1, 0, (block,)),)
    )
    d.check_loads([record])
    finished, bad = d.release()
    verdict = d.take_verdicts()["r"]
    assert (finished, bad) == ({"r"}, {"r"} if verdict == MISMATCH else set())
    return verdict


def test_a_consumer_verifies_the_producer_state_and_catches_a_changed_byte() -> None:
    p_layers = _layers(5)
    # D holds the same states in other blocks of its own pool.
    d_layers = [StateLayer(layer.pages.roll(1, dims=0).clone(), layer.states) for layer in p_layers]
    p = RankStates([_set(p_layers)])
    d = RankStates([_set(d_layers)])
    digest = _producer_digest(p, block=2)
    assert digest.states is not None
    assert digest.states.sums == {1: {0: _reference(1, p_layers, 2, 0)}}
    assert _check(d, digest, block=3) == VERIFIED
    d_layers[1].pages[3, 31] ^= 1
    assert _check(d, digest, block=3) == MISMATCH
    # Another layout (here: TP size) is not compared.
    other = RankStates([_set(d_layers)], tp_rank=0, tp_size=2)
    other.check_loads(
        [
            LoadRecord(
                "r",
                0,
                40,
                (),
                expected=ExpectedDigest(40, digest),
                states=(GroupLoad(1, 0, (3,)),),
            )
        ]
    )
    assert other.held == set() and other.take_verdicts() == {"r": UNVERIFIED}


def test_the_state_digest_crosses_the_entry_and_back() -> None:
    digest = Digest(
        "mix64-1",
        1024,
        "ab" * 8,
        {0: {0: (5,)}},
        StateDigest("mix64-state-1", "cd" * 8, {1: {0: MASK, 1: 7}}),
    )
    made = entry.Entry(
        num_tokens=40,
        geometry=entry.Geometry((16,), 1, 1, "ef" * 8),
        tail_zero=False,
        digest=digest,
        binding="0" * 32,
    )
    limits = Limits(max_tokens=256, num_groups=2, num_kv_heads=1)
    reading = entry.read({entry.KEY: made.to_json()}, limits)
    assert reading.why == "ok" and reading.digest_why == "ok"
    assert reading.entry is not None and reading.entry.digest == digest
    # A state group or shard outside the bounds makes the dg malformed.
    for bad in ({"2": {"0": "0" * 16}}, {"1": {str(entry.MAX_STATE_SHARDS): "0" * 16}}):
        raw = made.to_json()
        raw["dg"]["st"]["g"] = bad
        assert entry.read({entry.KEY: raw}, limits).digest_why == "malformed"
