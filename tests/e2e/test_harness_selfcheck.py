"""Self-check of the two-engine P/D harness with vLLM's plain connectors (no wrapper).

It proves that the harness can (1) move KV between two real CPU engines and get
the single-engine output, (2) reproduce the stale-tail bug - NaN planted in the
producer's never-written tail slots arrives in the consumer's last block and
breaks decoding - and (3) do the same round trip through a Mooncake store.
Two hybrid-model checks pin down facts the wrapper relies on: vLLM's own block
zeroing (hybrids) does not stop a NIXL tail, and MooncakeStore hits on a
hybrid with prefix caching end mid-block.

Engines are shared per class (start-up dominates: ~10 s of import per engine on
2 cores) and stopped when the class is done, so at most three run at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from demo.engine import EngineProcess
from demo.pd import PDPair, make_prompt
from demo.records import EngineConfig
from demo.tiny_model import ensure_tiny_hybrid
from tests.e2e.support import mid_block_hit, require, require_bf16

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
PARTIAL = make_prompt(45, seed=1)  # last block holds 13 of 32 slots
FULL = make_prompt(64, seed=2)  # last block full: no tail to go stale
LONG = make_prompt(77, seed=3)  # 2 full blocks + 13


class _References:
    """Greedy outputs of one plain engine (no connector) for every prompt used.

    Nothing starts until a test needs it (skipped tests cost nothing);
    `start()` lets the engine boot while a P/D pair boots too.
    """

    def __init__(self, model: str, log_dir: str) -> None:
        self._engine = EngineProcess(EngineConfig(model=model, name="reference"), log_dir)
        self._outs: dict[int, list[int]] | None = None

    def start(self) -> None:
        if self._outs is None and not self._engine.alive:
            self._engine.start()

    def close(self) -> None:
        self._engine.close()

    def __getitem__(self, prompt_len: int) -> list[int]:
        if self._outs is None:
            self.start()
            try:
                prompts = [PARTIAL, FULL, LONG]
                outs = self._engine.wait_ready().generate(prompts, MAX_TOKENS)
                self._outs = {len(p): o.token_ids for p, o in zip(prompts, outs, strict=True)}
            finally:
                self._engine.close()
        return self._outs[prompt_len]


@pytest.fixture(scope="module")
def references(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_References]:
    refs = _References(model, str(tmp_path_factory.mktemp("ref-logs")))
    yield refs
    refs.close()


class TestNixl:
    @pytest.fixture(scope="class")
    def pd(
        self, model: str, references: _References, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[PDPair]:
        require("nixl._api")
        references.start()  # boots alongside the pair
        with PDPair(model, "nixl", log_dir=tmp_path_factory.mktemp("nixl-logs")) as pair:
            yield pair

    def test_pd_matches_single_engine(self, pd: PDPair, references) -> None:
        for prompt in (PARTIAL, FULL, LONG):
            r = pd.run(prompt, MAX_TOKENS)
            assert r.decode.token_ids == references[len(prompt)], len(prompt)
            # The decode engine was served by the connector, not by computing the prompt.
            assert [h["matched"] for h in r.decode.connector_hits] == [len(prompt)]
            # The ids in kv_transfer_params are the blocks the producer's scheduler gave.
            assert r.prefill.block_ids is not None
            assert r.producer_blocks == r.prefill.block_ids[0]
            assert r.decode_tail_nan_slots() == {k: [] for k in r.decode_last_block_nan or {}}

    def test_stale_nan_tail_reaches_decode_and_breaks_it(self, pd: PDPair, references) -> None:
        pd.scrub()
        assert pd.decode is not None
        assert pd.decode.nan_census() == {}, "decode engine must start NaN-free"
        n, block = len(PARTIAL), pd.attn_block_size
        written = n % block  # 13 slots the producer wrote in its last block
        try:
            r = pd.run(PARTIAL, MAX_TOKENS, poison_tail=math.nan)
            assert r.decode_last_block_nan is not None
            layers = sorted(r.decode_last_block_nan)
            assert r.poisoned_slots == len(layers) * (block - written)

            # The consumer recomputes the last prompt token (slot 12) and writes
            # one slot per generated token but the last: slots 12 .. 19. Every
            # later slot still holds the producer's tail, copied over by NIXL.
            first = r.decode_last_block_nan[layers[0]]
            per_slot = max(first)  # K and V of every head: all elements NaN
            assert per_slot > 0
            assert all(first[s] == per_slot for s in range(written + MAX_TOKENS - 1, block)), first
            assert all(first[s] == 0 for s in range(written)), first

            # 0 * NaN in the masked attention poisons the logits: greedy decoding
            # degenerates (argmax over NaN logits gives token 0 every step).
            assert r.decode.token_ids != references[n]
            assert len(set(r.decode.token_ids)) == 1, r.decode.token_ids
        finally:
            pd.scrub()

    def test_full_last_block_has_no_tail_to_poison(self, pd: PDPair, references) -> None:
        try:
            r = pd.run(FULL, MAX_TOKENS, poison_tail=math.nan)
            assert r.poisoned_slots == 0
            assert r.decode.token_ids == references[len(FULL)]
        finally:
            pd.scrub()


class TestMooncake:
    @pytest.fixture(scope="class")
    def pd(self, model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
        require("mooncake.store")
        with PDPair(model, "mooncake", log_dir=tmp_path_factory.mktemp("mc-logs")) as pair:
            yield pair

    def test_store_round_trip(self, pd: PDPair, references) -> None:
        for prompt in (PARTIAL, LONG):
            r = pd.run(prompt, MAX_TOKENS)
            assert r.decode.token_ids == references[len(prompt)], len(prompt)
            # Uniform model: the store holds full blocks only, so hits are block aligned.
            hits = [h["matched"] for h in r.decode.connector_hits]
            block = pd.attn_block_size
            assert hits and hits[0] == (len(prompt) // block) * block, hits


class TestHybrid:
    def test_nixl_tail_survives_vllm_zeroing_on_mamba_hybrid(
        self, model: str, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        """vLLM zeroes new blocks of hybrid models, but NIXL's load comes later and
        copies whole blocks: the producer's stale tail still lands."""
        require("nixl._api")
        path = str(ensure_tiny_hybrid(kind="granite"))
        with PDPair(path, "nixl", log_dir=tmp_path_factory.mktemp("hyb-nixl")) as pd:
            assert pd.kv is not None and pd.prefill is not None
            assert pd.kv.needs_kv_cache_zeroing
            # The attention block follows the Mamba page size: whatever the engine says.
            block = pd.attn_block_size
            written = len(PARTIAL) % block
            assert written, block  # the prompt must end mid-block
            local = pd.prefill.generate([PARTIAL], MAX_TOKENS)[0].token_ids
            assert pd.run(PARTIAL, MAX_TOKENS).decode.token_ids == local
            r = pd.run(make_prompt(len(PARTIAL), seed=11), MAX_TOKENS, poison_tail=math.nan)
            assert r.poisoned_slots == block - written  # one attention layer
            tail = r.decode_tail_nan_slots()
            untouched = range(written + MAX_TOKENS - 1, block)
            assert all(s in v for v in tail.values() for s in untouched), tail
            assert len(set(r.decode.token_ids)) == 1, r.decode.token_ids

    def test_mooncake_hit_ends_mid_block_on_hybrid_with_prefix_caching(
        self, model: str, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        """Qwen3-Next (GDN) with prefix caching, align mode and a 32-token match
        unit: the store hit ends inside an attention block (of the size the engine
        reports; it follows the Mamba page size).
        vLLM zeroes the consumer's new blocks first, so its own NaN never shows."""
        require("mooncake.store")
        require_bf16()
        path = str(ensure_tiny_hybrid(kind="qwen3_next"))
        engine = {
            "dtype": "bfloat16",  # the CPU GDN kernel takes bf16 only
            "enable_prefix_caching": True,
            "llm_kwargs": {"mamba_cache_mode": "align", "prefix_match_unit": 32},
        }
        logs = tmp_path_factory.mktemp("hyb-mc")
        with PDPair(path, "mooncake", log_dir=logs, engine_overrides=engine) as pd:
            assert pd.kv is not None and pd.prefill is not None
            assert pd.kv.needs_kv_cache_zeroing
            assert pd.kv.cache_hit_alignment_tokens == 32
            length, expected_hit = mid_block_hit(pd.attn_block_size, 32)
            prompt = make_prompt(length, seed=12)
            local = pd.prefill.generate([prompt], MAX_TOKENS)[0].token_ids
            r = pd.run(prompt, MAX_TOKENS, poison_consumer=math.nan)
            hit = r.decode.connector_hits[0]["matched"]
            assert hit == expected_hit, (hit, pd.attn_block_size)
            assert r.decode.token_ids == local
            assert r.decode_tail_nan_slots() == {k: [] for k in r.decode_last_block_nan or {}}
