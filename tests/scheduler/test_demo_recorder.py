"""The demo's block record of a decode request whose KV load failed.

``make demo ARGS=--hybrid`` once failed with ``IndexError`` in ``PDPair.run``
(``decode_blocks[(len(prompt) - 1) // bs]``): the decode request's recorded
attention blocks were fewer than its prompt's. The recorder keeps a request's
block ids after its last successful ``allocate_slots``; the demo's engines keep
vLLM's default ``kv_load_failure_policy: "fail"``; a request whose async load
fails then ends (``finish_reason`` "error") right after the load's allocation,
whose blocks cover the loaded tokens only, never the prompt. The demo read them
as the prompt's.

Here a real vLLM Scheduler with a hybrid (attention + Mamba, "align") KV cache,
the wrapper around the transport double, the demo's own recorder on it, and a
load that fails: the record is the one the demo met, and ``PDPair.run`` fed
with it (through test doubles of the two engine processes) must report the
failed decode instead of reading blocks the request never had.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from demo.pd import PDPair, make_prompt
from demo.records import GenResult, KVInfo
from demo.scenarios import Outcome, _row, scenario
from demo.server import _Recorder
from tests.helpers.lifecycle import Harness
from tests.helpers.vllm_factories import make_hybrid_mamba_kv_cache_config, run_step

BS = 64  # the attention (and Mamba) block size
PROMPT = 100  # two attention blocks
LOADED = 64  # the load covers the first block only
MAX_TOKENS = 4
ATTN_LAYER = "model.layers.0.self_attn.attn"


def _hybrid(policy: str) -> Harness:
    kv = make_hybrid_mamba_kv_cache_config(block_size=BS, num_blocks=64)
    return Harness(
        "auto",
        kv,
        block_size=BS,
        enable_prefix_caching=True,
        mamba_cache_mode="align",
        prefix_match_unit=32,
        kv_load_failure_policy=policy,
    )


def _decode(h: Harness, rec: _Recorder, external_id: str, fail: bool) -> tuple[str, Any]:
    """Run one decode request with a load of ``LOADED`` tokens to its end; returns
    (its finish reason, its record)."""
    internal = f"{external_id}-0123abcd"  # vLLM's internal id: external + 8 hex
    h.add(
        internal,
        PROMPT,
        max_tokens=MAX_TOKENS,
        double_load_tokens=LOADED,
        double_fail=fail,
        double_finish_after_steps=2,
    )
    reason = None
    for _ in range(30):
        if not h.scheduler.has_requests():
            break
        _, outputs = run_step(h.scheduler, h.worker)
        for engine_outputs in outputs.values():
            for o in engine_outputs.outputs:
                if o.request_id == internal and o.finish_reason is not None:
                    reason = str(o.finish_reason)
    assert not h.scheduler.has_requests(), "the request did not finish"
    rid, record = rec.find(external_id)
    assert rid == internal, (rid, internal)
    assert reason is not None
    return reason, record


def test_a_failed_load_under_policy_fail_leaves_only_the_loads_blocks_recorded() -> None:
    h = _hybrid("fail")
    rec = _Recorder(h.scheduler)
    reason, record = _decode(h, rec, "7", fail=True)
    assert reason == "error"
    attn = record["block_ids"][0]
    assert len(attn) == -(-LOADED // BS) < -(-PROMPT // BS)  # the load's block only

    # The same request whose load succeeds computes its prompt: every prompt block.
    reason, record = _decode(h, rec, "8", fail=False)
    assert reason == "length"
    assert len(record["block_ids"][0]) >= -(-PROMPT // BS)


class _Engine:
    """Test double of an ``EngineProcess``: canned ``generate`` answers."""

    def __init__(self, kv: KVInfo, answer: GenResult) -> None:
        self.kv, self.answer = kv, answer
        self.log_path = "decode.log"
        self.nan_reads: list[list[int]] = []

    def kv_info(self) -> KVInfo:
        return self.kv

    def generate(self, prompts: Any, max_tokens: int, params: Any = None) -> list[GenResult]:
        return [self.answer]

    def kvtail_counters(self) -> dict[str, int]:
        return {}

    def slot_nan_counts(self, block_ids: list[int]) -> dict[str, dict[int, list[int]]]:
        self.nan_reads.append(list(block_ids))
        return {ATTN_LAYER: {b: [0] * BS for b in block_ids}}


def test_the_demo_reports_a_failed_decode_instead_of_reading_blocks_it_never_had() -> None:
    h = _hybrid("fail")
    rec = _Recorder(h.scheduler)
    reason, record = _decode(h, rec, "7", fail=True)
    kcc = h.scheduler.kv_cache_config
    kv = KVInfo(
        num_blocks=kcc.num_blocks,
        block_size=h.scheduler.block_size,
        needs_kv_cache_zeroing=True,
        cache_hit_alignment_tokens=32,
        groups=[
            {"spec": type(g.kv_cache_spec).__name__, "block_size": g.kv_cache_spec.block_size}
            for g in kcc.kv_cache_groups
        ],
        attn_layers={ATTN_LAYER: {"isa": "vec", "elements_per_slot": 64}},
    )
    assert kv.attn_block_size == BS
    prompt = make_prompt(PROMPT, seed=1)
    produced = GenResult("0", "0-x", prompt, [5], {"remote_block_ids": [[1, 2]]}, None, [])
    prefill = _Engine(kv, produced)
    decode = _Engine(
        kv,
        GenResult(
            "7", "7-0123abcd", prompt, [], None, record["block_ids"], [], finish_reason=reason
        ),
    )
    pair = PDPair("model", "nixl").attach(prefill, decode)  # type: ignore[arg-type]

    r = pair.run(prompt, MAX_TOKENS)

    assert r.decode_failed
    assert r.decode_blocks is None and decode.nan_reads == []
    row = _row(r, "KVTailConnector(x)", True, [9] * MAX_TOKENS, 64, "decode.log")
    assert not row.output_ok and row.decode_failed_log == "decode.log"
    outcome = Outcome(scenario("hybrid"), [row], True, BS, "vec", 0.0, None)  # type: ignore[arg-type]
    (failure,) = outcome.failures()
    assert "ended with an error" in failure and "decode.log" in failure
    assert asdict(r.decode)["finish_reason"] == "error"
