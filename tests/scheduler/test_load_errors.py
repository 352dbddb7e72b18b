"""Load errors belong to the load that held the block when they were reported.

A failed load's blocks are freed and handed to the next request; an invalid
block id reported for the old load must never make the wrapper treat the new
owner's successful load as failed (zeroing its valid KV, or leaving its tail
stale). Real vLLM Scheduler, both failure policies, a pool so small that the
next request gets exactly the failed load's blocks.
"""

from __future__ import annotations

import pytest

from tests.helpers.lifecycle import BLOCK, Harness, slot_state

# The worker gets its metadata both ways: pickled (TP > 1) and as built (TP 1).
pytestmark = pytest.mark.usefixtures("both_deliveries")

PROMPT = 80  # five 16-token blocks, no new block for the prefill or the one token
LOADED_TOKENS = 75  # 4 whole blocks + 11 slots of the fifth
# The null block, C's five and A's five: D can only get A's blocks back.
POOL = 11
LAYER = "model.layers.0.self_attn.attn"


def _run_to_reuse(h: Harness, **a_params: object) -> tuple[list[int], list[int]]:
    """C keeps a load in flight; A's load ends in error; D then gets A's blocks
    and its transport writes all of D's tokens. Returns (A's blocks, D's)."""
    h.add("C", PROMPT, max_tokens=1, double_load_tokens=LOADED_TOKENS, double_finish_after_steps=40)
    h.add(
        "A",
        PROMPT,
        max_tokens=1,
        double_load_tokens=LOADED_TOKENS,
        double_finish_after_steps=2,
        **a_params,
    )
    h.step()
    a_blocks = list(h.inner_scheduler.blocks_by_req["A"][0])
    for _ in range(12):  # A fails, is freed (and, with recompute, runs again locally)
        h.step()
        if "A" not in h.scheduler.requests:
            break
    assert "A" not in h.scheduler.requests
    h.add("D", PROMPT, max_tokens=1, double_load_tokens=LOADED_TOKENS, double_finish_after_steps=2)
    h.step()
    d_blocks = list(h.inner_scheduler.blocks_by_req["D"][0])
    h.land("D", 0, 0, LOADED_TOKENS)
    h.step()  # D's load completes
    assert "D" in h.inner_scheduler.finished_recving_seen
    assert "D" not in h.inner_scheduler.failed_recving_seen
    return a_blocks, d_blocks


def _assert_d_intact(h: Harness, d_blocks: list[int]) -> None:
    view = h.caches.views[LAYER]
    for b in d_blocks[:4]:
        assert slot_state(view, b) == ["loaded"] * BLOCK
    tail = LOADED_TOKENS % BLOCK
    assert slot_state(view, d_blocks[4]) == ["loaded"] * tail + ["zero"] * (BLOCK - tail)


@pytest.mark.parametrize(
    ("policy", "invalid"),
    [("fail", [2]), ("recompute", [0])],  # recompute frees only when nothing stays computed
)
def test_one_invalid_block_then_reuse_leaves_the_next_load_intact(policy: str, invalid: list[int]):
    h = Harness(num_gpu_blocks=POOL, kv_load_failure_policy=policy)
    a_blocks, d_blocks = _run_to_reuse(h, double_invalid_block_indices=invalid)
    assert set(d_blocks) == set(a_blocks), "the pool must hand D exactly A's blocks"
    _assert_d_intact(h, d_blocks)
    h.finish()
    assert h.stats["failed_loads"] == 1


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_all_blocks_invalid_and_failed_then_reuse_leaves_the_next_load_intact(policy: str):
    # NIXL's behaviour: a failed transfer reports every destination block too.
    h = Harness(num_gpu_blocks=POOL, kv_load_failure_policy=policy)
    a_blocks, d_blocks = _run_to_reuse(
        h, double_fail=True, double_invalid_block_indices=list(range(5))
    )
    assert set(d_blocks) == set(a_blocks)
    _assert_d_intact(h, d_blocks)
    h.finish()
    assert h.stats["failed_loads"] == 1


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_errors_reported_a_pass_after_completion_are_not_kept(policy: str):
    # A transport that reports A's invalid block one pass late: by then A's
    # load is done, so no later load may inherit the id.
    h = Harness(num_gpu_blocks=POOL, kv_load_failure_policy=policy)
    _, d_blocks = _run_to_reuse(h, double_invalid_block_indices=[0], double_invalid_late=True)
    _assert_d_intact(h, d_blocks)
    h.finish()
