"""The state digest's parts: which block holds a request's state, a
producer's and a consumer's state digests of one request compared, and the
digest across the ``kvtail`` entry (the digest itself:
``tests/ops/test_state_digest.py``)."""

from __future__ import annotations

from kvtail_connector.core.kvgroups import state_block
from kvtail_connector.core.metadata import GroupLoad
from kvtail_connector.extras import entry, entry_values
from kvtail_connector.extras.entry_values import Digest, Limits, StateDigest
from kvtail_connector.extras.kv_verification.rank_states import RankStates, StateSet
from kvtail_connector.extras.metadata import (
    MISMATCH,
    UNVERIFIED,
    VERIFIED,
    CheckedLoad,
    ExpectedDigest,
)
from kvtail_connector.extras.ops.state_digest import StateLayer
from tests.ops.test_state_digest import MASK, _layers, _reference


def test_the_state_block_is_the_last_before_the_scratch_blocks() -> None:
    assert state_block([7], 0) == (0, 7)
    assert state_block([0, 0, 9, 4, 5], 2) == (2, 9)
    assert state_block([9], 2) == (0, 9)  # before scratch allocation
    assert state_block([], 0) is None


def _set(layers: list[StateLayer], gid: int = 1) -> StateSet:
    return StateSet(gid, layers, ["m0", "m1"], ["[(3, 5)]:bf16", "[(4, 4)]:f32"])


def _producer_digest(p: RankStates, block: int, n: int = 40) -> Digest:
    record = CheckedLoad("r", 0, n, (), states=(GroupLoad(1, 0, (block,)),))
    part = p.digest_prompts([record])["r"]
    states = part.digest()
    assert states is not None
    return Digest("mix64-1", 1024, "0" * 16, {}, states)


def _check(d: RankStates, digest: Digest, block: int) -> str:
    record = CheckedLoad(
        "r", 0, 40, (), expected=ExpectedDigest(40, digest), states=(GroupLoad(1, 0, (block,)),)
    )
    d.check_loads([record])
    finished, bad = d.release()
    verdict = d.take_verdicts()["r"]
    assert (finished, bad) == ({"r"}, {"r"} if verdict == MISMATCH else set())
    differs = d.take_differs()
    if verdict == MISMATCH:  # named for the scheduler's one log line
        assert "state group 1" in differs["r"]
    else:
        assert differs == {}
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
            CheckedLoad(
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
        geometry=entry_values.Geometry((16,), 1, 1, "ef" * 8),
        tail_zero=False,
        digest=digest,
        binding="0" * 32,
    )
    limits = Limits(max_tokens=256, num_groups=2, num_kv_heads=1)
    reading = entry.read({entry.KEY: made.to_json()}, limits)
    assert reading.why == "ok" and reading.digest_why == "ok"
    assert reading.entry is not None and reading.entry.digest == digest
    # A state group or shard outside the bounds makes the dg malformed.
    for bad in ({"2": {"0": "0" * 16}}, {"1": {str(entry_values.MAX_STATE_SHARDS): "0" * 16}}):
        raw = made.to_json()
        raw["dg"]["st"]["g"] = bad
        assert entry.read({entry.KEY: raw}, limits).digest_why == "malformed"
