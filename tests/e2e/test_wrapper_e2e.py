"""``KVTailConnector`` between two real vLLM CPU engines.

(a) NIXL behind the wrapper: NaN planted in the producer's never-written tail
    never reaches decoding - the decode engine's blocks hold no NaN, the output
    equals a single-engine run, and the wrapper's counters (read from the decode
    engine's Prometheus metrics) show the tail zeroed and what the probe saw.
    Both sides run the wrapper; P (vouch_tails "trust") zeroes its tail and
    vouches for it; the NaN is planted after that claim. D (vouch_tails "auto",
    the default) checks the claim, counts it, and zeroes the tail itself all the
    same, NaN or not. A
    plain P and a plain D each interoperate with a wrapped other side.
(b) The control: the same request through the plain NixlConnector delivers the
    NaN tail and breaks decoding, so (a) can fail.
(c) MooncakeStore behind the wrapper on a uniform model: transparent (hits are
    whole blocks; nothing to zero; outputs equal).
(d) MooncakeStore behind the wrapper on a hybrid model whose store hits end
    mid-block (zero_tails "auto" applies: the model needs KV-cache zeroing).
(e) The demo command itself.

Engines are shared per class and stopped when the class is done.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from demo import procs
from demo.engine import start_engines
from demo.pd import PDPair, PDResult, make_prompt, wrapped_kv_config
from demo.tiny_model import ensure_tiny_hybrid
from kvtail_connector.extras import entry
from tests.e2e.support import mid_block_hit, require, require_bf16

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
PARTIAL = make_prompt(45, seed=21)  # last block: 13 of 32 slots written
LONG = make_prompt(77, seed=22)  # 2 full blocks + 13
FULL = make_prompt(64, seed=23)  # block-aligned: no tail
F32_NAN_NONZERO_BYTES = 2  # float32 NaN 0x7FC00000: two of its four bytes are non-zero
FINITE_STALE = 12345.0


def _slot_bytes(pd: PDPair, elem_size: int) -> int:
    """Bytes of one token slot in one attention layer (K and V, all heads)."""
    assert pd.kv is not None
    per_slot = {v["elements_per_slot"] for v in pd.kv.attn_layers.values()}
    assert len(per_slot) == 1, pd.kv.attn_layers
    return per_slot.pop() * elem_size


def _tail_nonzero(pd: PDPair, r: PDResult, first: int) -> dict[str, list[int]]:
    """Per layer: slots >= ``first`` of the consumer's last prompt block holding non-zero bytes."""
    assert pd.decode is not None and r.decode_blocks is not None
    n = len(r.prompt_token_ids)
    last = r.decode_blocks[(n - 1) // r.attn_block_size]
    counts = pd.decode.slot_nonzero_counts([last])
    return {
        layer: [s for s, c in enumerate(v[last]) if c and s >= first] for layer, v in counts.items()
    }


# --------------------------------------------------------------------------- #
# NIXL: (a) the wrapper, (b) the plain connector
# --------------------------------------------------------------------------- #


@dataclass
class NixlPairs:
    plain: PDPair
    wrapped: PDPair
    refs: dict[int, list[int]]  # prompt length -> single-engine greedy output


class TestNixl:
    @pytest.fixture(scope="class")
    def pairs(self, model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NixlPairs]:
        require("nixl._api")
        logs = tmp_path_factory.mktemp("wrap-nixl")
        plain = PDPair(model, "nixl", log_dir=logs / "plain", name="plain")
        wrapped = PDPair(
            model,
            "nixl",
            # An auto P vouches only where an auto D would skip on the claim
            # (not over NIXL): trust, so that D has claims to check.
            wrapped_kv_config("nixl", "producer", "always", vouch_tails="trust"),
            wrapped_kv_config("nixl", "consumer", "always"),
            log_dir=logs / "wrapped",
            name="wrapped",
        )
        try:
            engines = start_engines(plain.engine_configs() + wrapped.engine_configs(), logs)
            plain.attach(*engines[:2])
            wrapped.attach(*engines[2:])
            assert plain.prefill is not None
            # The reference: each prompt start to finish on one plain engine, no transfer.
            prompts = [PARTIAL, LONG, FULL]
            outs = plain.prefill.generate(prompts, MAX_TOKENS)
            refs = {len(p): o.token_ids for p, o in zip(prompts, outs, strict=True)}
            yield NixlPairs(plain, wrapped, refs)
        finally:
            plain.close()
            wrapped.close()

    def test_wrapper_zeroes_the_planted_nan_tail(self, pairs: NixlPairs) -> None:
        pd = pairs.wrapped
        assert pd.kv is not None and not pd.kv.needs_kv_cache_zeroing  # hence "always"
        slot_bytes = _slot_bytes(pd, 4)  # float32
        layers, block = len(pd.kv.attn_layers), pd.attn_block_size
        for prompt in (PARTIAL, LONG):
            n = len(prompt)
            written = n % block
            try:
                r = pd.run(prompt, MAX_TOKENS, poison_tail=math.nan)
                assert r.hit == n
                assert r.poisoned_slots == layers * (block - written)
                # Nothing of the NaN reached the decode engine's blocks, and it decoded
                # exactly like one engine.
                assert r.decode_nan == 0, r.decode_tail_nan_slots()
                assert r.decode.token_ids == pairs.refs[n], n
                # P vouched for a clean tail before the NaN was planted: D checked the
                # claim (bound, matching: counted unused) and zeroed the tail itself,
                # as it does by default for every async load; its probe saw the NaN.
                k = r.kvtail
                assert k["vouches_unused"] == 1 and k["vouches_declined"] == 0, k
                assert k["false_vouches"] == 0 and k["vouched_tails"] == 0, k
                assert k["tails_zeroed"] == 1, k
                assert k["tail_bytes_zeroed"] == r.poisoned_slots * slot_bytes, k
                assert k["probed_tails"] == 1, k
                planted = r.poisoned_slots * slot_bytes // 4
                assert k["stale_nonzero_bytes"] == planted * F32_NAN_NONZERO_BYTES, k
                assert k["failed_loads"] == 0, k
                # Slots past the ones decoding wrote are still exactly zero; the loaded
                # slots are intact (decoding recomputes the last prompt token, slot
                # written - 1, and writes one slot per generated token but the last).
                first_untouched = written + MAX_TOKENS - 1
                assert _tail_nonzero(pd, r, first_untouched) == {
                    layer: [] for layer in pd.kv.attn_layers
                }
            finally:
                pd.scrub()

    def test_probe_counts_the_nan_it_zeroes(self, pairs: NixlPairs) -> None:
        pd = pairs.wrapped
        try:
            r = pd.run(PARTIAL, MAX_TOKENS, poison_tail=math.nan)
        finally:
            pd.scrub()
        planted = r.poisoned_slots * _slot_bytes(pd, 4) // 4
        assert r.kvtail["stale_nonfinite_values"] == planted, r.kvtail

    def test_wrapper_is_transparent_without_poison(self, pairs: NixlPairs) -> None:
        # Both sides wrapped: P zeroes its tail and vouches; D checks the claim
        # (bound to this transfer: counted, not declined) and, by default, zeroes
        # the tail itself all the same (it arrived zero: the probe saw nothing).
        pd = pairs.wrapped
        for prompt, tails in ((PARTIAL, 1), (FULL, 0)):
            r = pd.run(prompt, MAX_TOKENS)
            assert r.decode.token_ids == pairs.refs[len(prompt)], len(prompt)
            k = r.kvtail
            assert (k["vouches_unused"], k["tails_zeroed"], k["vouched_tails"]) == (tails, tails, 0)
            assert (k["tail_bytes_zeroed"] > 0) == bool(tails), k
            assert k["stale_nonzero_bytes"] == 0, k
            assert k["false_vouches"] == 0 and k["vouches_declined"] == 0, k
            assert r.decode_nan == 0

    def test_a_plain_side_interoperates_with_a_wrapped_one(self, pairs: NixlPairs) -> None:
        """A wrapped P's entry is ignored by a plain vLLM D; a plain P sends none,
        and a wrapped D then zeroes the tail itself."""
        for p_pair, d_pair, wrapped_p in (
            (pairs.wrapped, pairs.plain, True),
            (pairs.plain, pairs.wrapped, False),
        ):
            assert p_pair.prefill is not None and d_pair.decode is not None
            pre = p_pair.prefill.generate([PARTIAL], 1, [{"do_remote_decode": True}])[0]
            params = dict(pre.kv_transfer_params or {})
            assert (entry.KEY in params) is wrapped_p, params
            before = d_pair.decode.kvtail_counters()
            decode_params = {**params, "do_remote_prefill": True, "do_remote_decode": False}
            dec = d_pair.decode.generate([PARTIAL], MAX_TOKENS, [decode_params])[0]
            assert dec.token_ids == pairs.refs[len(PARTIAL)], wrapped_p
            if not wrapped_p:
                after = d_pair.decode.kvtail_counters()
                assert after["tails_zeroed"] - before.get("tails_zeroed", 0) == 1

    def test_plain_connector_delivers_the_nan_tail(self, pairs: NixlPairs) -> None:
        """The control: without the wrapper the same request breaks."""
        pd = pairs.plain
        assert pd.kv is not None
        block = pd.attn_block_size
        written = len(PARTIAL) % block
        try:
            r = pd.run(PARTIAL, MAX_TOKENS, poison_tail=math.nan)
            assert r.kvtail == {}  # no wrapper, no counters
            tail = r.decode_tail_nan_slots()
            assert all(
                set(range(written + MAX_TOKENS - 1, block)) <= set(v) for v in tail.values()
            ), tail
            assert r.decode_nan
            assert r.decode.token_ids != pairs.refs[len(PARTIAL)]
        finally:
            pd.scrub()


# --------------------------------------------------------------------------- #
# MooncakeStore: (c) uniform model, (d) hybrid with mid-block hits
# --------------------------------------------------------------------------- #


class TestMooncake:
    @pytest.fixture(scope="class")
    def pd(self, model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
        require("mooncake.store")
        with PDPair(
            model,
            "mooncake",
            wrapped_kv_config("mooncake", "producer", "always"),
            wrapped_kv_config("mooncake", "consumer", "always"),
            log_dir=tmp_path_factory.mktemp("wrap-mc"),
        ) as pair:
            yield pair

    def test_wrapper_is_transparent_on_whole_block_hits(self, pd: PDPair) -> None:
        assert pd.prefill is not None
        refs = [g.token_ids for g in pd.prefill.generate([PARTIAL, LONG], MAX_TOKENS)]
        for prompt, ref in zip((PARTIAL, LONG), refs, strict=True):
            # Stale finite bytes everywhere in the decode engine: harmless, and no
            # reason for the wrapper to act.
            r = pd.run(prompt, MAX_TOKENS, poison_consumer=FINITE_STALE)
            assert r.decode.token_ids == ref, len(prompt)
            block = pd.attn_block_size
            assert r.hit == (len(prompt) // block) * block  # whole blocks only
            k = r.kvtail
            assert k["tails_zeroed"] == 0 and k["tail_bytes_zeroed"] == 0, k
            assert k["probed_tails"] == 0 and k["failed_loads"] == 0, k


class TestHybridMooncake:
    @pytest.fixture(scope="class")
    def pd(self, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
        require("mooncake.store")
        require_bf16()
        path = str(ensure_tiny_hybrid(kind="qwen3_next"))
        engine = {
            "dtype": "bfloat16",  # the CPU GDN kernel takes bf16 only
            "enable_prefix_caching": True,
            "llm_kwargs": {"mamba_cache_mode": "align", "prefix_match_unit": 32},
        }
        with PDPair(
            path,
            "mooncake",
            wrapped_kv_config("mooncake", "producer", "auto"),
            wrapped_kv_config("mooncake", "consumer", "auto"),
            log_dir=tmp_path_factory.mktemp("wrap-hyb"),
            engine_overrides=engine,
        ) as pair:
            yield pair

    def test_mid_block_hit_tail_is_zeroed(self, pd: PDPair) -> None:
        assert pd.kv is not None and pd.prefill is not None
        assert pd.kv.needs_kv_cache_zeroing  # "auto" zeroes tails on this model
        assert pd.kv.cache_hit_alignment_tokens == 32  # prefix_match_unit
        block = pd.attn_block_size  # follows the Mamba page size: the engine says
        length, expected_hit = mid_block_hit(block, 32)
        prompt = make_prompt(length, seed=24)
        local = pd.prefill.generate([prompt], MAX_TOKENS)[0].token_ids
        try:
            r = pd.run(prompt, MAX_TOKENS, poison_consumer=math.nan)
            assert r.hit == expected_hit, (r.hit, block)
            assert r.decode.token_ids == local
            assert r.decode_nan == 0
            k = r.kvtail
            assert k["tails_zeroed"] == 1, k
            assert k["tail_bytes_zeroed"] == (block - r.hit % block) * _slot_bytes(pd, 2), k
            # The store load copies the producer's whole page, so slots past the hit
            # held the producer's bytes (its KV of the prompt's last tokens) when zeroed.
            assert k["probed_tails"] == 1 and k["stale_nonzero_bytes"] > 0, k
            first_untouched = len(prompt) + MAX_TOKENS - 1 - (len(prompt) - 1) // block * block
            assert _tail_nonzero(pd, r, first_untouched) == {
                layer: [] for layer in pd.kv.attn_layers
            }
        finally:
            pd.scrub()


# --------------------------------------------------------------------------- #
# (e) the demo command
# --------------------------------------------------------------------------- #


def test_demo_command_passes(model: str) -> None:
    require("nixl._api")
    r = subprocess.run(
        [sys.executable, "-m", "demo", "--lengths", "45", "--max-tokens", "4"],
        env={**os.environ, "PYTHONPATH": procs.child_pythonpath(os.environ)},
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    plain = next(line for line in lines if line.split()[1:2] == ["NixlConnector"])
    wrapped = next(line for line in lines if "KVTailConnector(NixlConnector)" in line)
    assert plain.rstrip().split()[-1] not in ("yes",), plain  # the bug shows without it
    assert wrapped.rstrip().endswith("yes"), wrapped
    assert "OK:" in r.stdout
