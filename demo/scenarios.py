"""The demo's scenarios: the same P/D requests through the plain connector and the wrapper.

Each scenario starts two P/D pairs at once (their imports overlap): one with
vLLM's plain connector on both sides, one with ``KVTailConnector`` wrapping it
on both sides. Every request runs through both, and each run gives a
:class:`Row`: what the probe found in the stale tail, what the wrapper zeroed
(its counters, read from the decode engine's Prometheus metrics), the NaN left
in the decode engine's blocks of the request, and whether the output equals a
single-engine run of the same prompt.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo.engine import start_engines
from demo.pd import (
    Backend,
    PDPair,
    PDResult,
    ZeroTails,
    kv_config,
    make_prompt,
    wrapped_kv_config,
)
from demo.tiny_model import ensure_tiny_hybrid, ensure_tiny_llama

INNER_NAMES = {"nixl": "NixlConnector", "mooncake": "MooncakeStoreConnector"}
FINITE_POISON = 12345.0


@dataclass
class Scenario:
    name: str
    backend: Backend
    model: Callable[[], Path]
    title: str
    notes: list[str]
    zero_tails: ZeroTails
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig overrides
    poison_tail: float | None = None  # planted in the producer's tail after its prefill
    poison_consumer: float | None = None  # every decode-engine slot, before each decode


def scenario(name: str) -> Scenario:
    """``hybrid_nixl`` (the main line: the Granite hybrid over NIXL), ``nixl`` (the
    uniform Llama over NIXL), ``mooncake`` (the Llama, MooncakeStore) or ``hybrid``
    (MooncakeStore with the Qwen3-Next hybrid)."""
    if name == "hybrid_nixl":
        return Scenario(
            name="hybrid_nixl",
            backend="nixl",
            model=lambda: ensure_tiny_hybrid(kind="granite"),
            title="NixlConnector (UCX, CPU buffers), tiny Granite hybrid (Mamba2 + attention), "
            "float32",
            notes=[
                "vLLM zeroes new blocks of hybrid models, but NIXL then copies the producer's "
                "whole last block: its never-written tail slots arrive with it.",
                "NaN planted in those slots after the producer's prefill, before the decode "
                "engine pulls the blocks: bytes an earlier request could have left there.",
                'zero_tails="auto", no other setting: the model needs KV-cache zeroing (Mamba '
                "layers), so the wrapper zeroes the tail; the attention block follows the "
                "Mamba page size.",
            ],
            zero_tails="auto",
            poison_tail=math.nan,
        )
    if name == "nixl":
        return Scenario(
            name="nixl",
            backend="nixl",
            model=ensure_tiny_llama,
            title="NixlConnector (UCX, CPU buffers), tiny random Llama, float32, 32-token blocks",
            notes=[
                "NaN planted in the producer's never-written tail slots after its prefill, "
                "before the decode engine pulls the blocks.",
                'Both sides wrapped, vouch_tails "auto": the consumer zeroes every async-load '
                "tail itself, so the producer makes no claim it would not use (over NIXL), and "
                "the NaN planted after the prefill never reaches decoding.",
                'zero_tails="always": this model has one KV precision, so vLLM zeroes no new '
                'blocks (needs_kv_cache_zeroing=False) and "auto" would leave the tail alone.',
            ],
            zero_tails="always",
            poison_tail=math.nan,
        )
    if name == "mooncake":
        return Scenario(
            name="mooncake",
            backend="mooncake",
            model=ensure_tiny_llama,
            title="MooncakeStoreConnector (local mooncake_master), tiny random Llama, float32",
            notes=[
                f"Every slot of the decode engine holds a finite stale value ({FINITE_POISON}) "
                "before each request.",
                "On a uniform model the store serves whole blocks only: no tail to zero, "
                "and the wrapper must be transparent.",
                'zero_tails="always" (uniform precision: "auto" would not zero at all).',
            ],
            zero_tails="always",
            poison_consumer=FINITE_POISON,
        )
    if name == "hybrid":
        return Scenario(
            name="hybrid",
            backend="mooncake",
            model=lambda: ensure_tiny_hybrid(kind="qwen3_next"),
            title="MooncakeStoreConnector, tiny Qwen3-Next hybrid (Gated DeltaNet + attention), "
            "bfloat16, prefix caching, mamba_cache_mode=align, prefix_match_unit=32",
            notes=[
                "This option does not show the bug: the plain rows are right too. It shows the "
                "wrapper zeroing the tail of a mid-block store hit and changing nothing.",
                "Store hits end on 32-token units, inside attention blocks whose size follows "
                "the Mamba page size (below).",
                "Why the plain rows are right: MooncakeStore gets whole pages, so the load "
                "overwrites the decode engine's whole last block, the NaN planted in every "
                "slot before each request included. The slots past the hit then hold the "
                "producer's page as it saved it: KV of the prompt's next tokens (recomputed "
                "here) and, past the prompt, bytes vLLM zeroed when the producer allocated "
                "the block. The save leaves from the producer's own step, so unlike NIXL "
                "(pulled after the prefill returned) there is no point at which to plant "
                "NaN in it.",
                'zero_tails="auto": the model needs KV-cache zeroing (Mamba layers), so the '
                "wrapper zeroes the tail anyway (its probe counts the producer's finite bytes).",
            ],
            zero_tails="auto",
            engine={
                "dtype": "bfloat16",  # the CPU GDN kernel takes bf16 only
                "enable_prefix_caching": True,
                "llm_kwargs": {"mamba_cache_mode": "align", "prefix_match_unit": 32},
            },
            poison_consumer=math.nan,
        )
    raise ValueError(f"unknown scenario {name!r}")


@dataclass
class Row:
    prompt_len: int
    connector: str
    wrapped: bool
    hit: int | None  # tokens the decode engine's connector loaded
    tail: tuple[int, int] | None  # slots [first, end) of the last loaded block left stale
    planted_nan: int  # NaN values planted in the producer's tail
    probe_nonzero_bytes: int | None  # what the wrapper's probe found (None: no wrapper)
    probe_nonfinite: int | None
    bytes_zeroed: int | None
    nan_left: int | None  # NaN values in the decode engine's blocks of the request
    output_ok: bool
    tokens: list[int]
    reference: list[int]
    # The decode request ended without computing its prompt ("error": its KV load
    # failed; the engines keep vLLM's kv_load_failure_policy "fail"): its log.
    decode_failed_log: str | None = None


@dataclass
class Outcome:
    scenario: Scenario
    rows: list[Row]
    needs_kv_cache_zeroing: bool
    attn_block_size: int
    attn_isa: str  # the CPU attention ISA the engines picked ("vec", "amx", ...)
    startup_s: float
    log_dir: Path

    def failures(self) -> list[str]:
        """What makes the demo fail: the wrapper left NaN or changed the output."""
        out = []
        for r in self.rows:
            if r.wrapped and r.nan_left:
                out.append(f"{r.connector}, prompt {r.prompt_len}: {r.nan_left} NaN left")
            if r.decode_failed_log is not None:
                out.append(
                    f"{r.connector}, prompt {r.prompt_len}: the decode request ended with an "
                    f"error (its KV load failed; see {r.decode_failed_log})"
                )
            elif r.wrapped and not r.output_ok:
                out.append(f"{r.connector}, prompt {r.prompt_len}: output differs from reference")
        return out


def _row(
    r: PDResult,
    connector: str,
    wrapped: bool,
    reference: list[int],
    elements_per_slot: int,
    decode_log: str,
) -> Row:
    bs = r.attn_block_size
    hit = r.hit
    tail = (hit % bs, bs) if hit and hit % bs else None
    return Row(
        prompt_len=len(r.prompt_token_ids),
        connector=connector,
        wrapped=wrapped,
        hit=hit,
        tail=tail,
        planted_nan=r.poisoned_slots * elements_per_slot,
        probe_nonzero_bytes=r.kvtail.get("stale_nonzero_bytes") if wrapped else None,
        probe_nonfinite=r.kvtail.get("stale_nonfinite_values") if wrapped else None,
        bytes_zeroed=r.kvtail.get("tail_bytes_zeroed") if wrapped else None,
        nan_left=r.decode_nan,
        output_ok=not r.decode_failed and r.decode.token_ids == reference,
        tokens=r.decode.token_ids,
        reference=reference,
        decode_failed_log=decode_log if r.decode_failed else None,
    )


def run(
    sc: Scenario,
    lengths: Sequence[int],
    max_tokens: int,
    log_dir: Path,
    say: Callable[[str], None] = print,
) -> Outcome:
    """Start both pairs, run every prompt through each, stop everything."""
    model = str(sc.model())
    prompts = [make_prompt(n, seed=100 + n) for n in lengths]
    inner = INNER_NAMES[sc.backend]
    variants = [
        (inner, False, kv_config(sc.backend, "producer"), kv_config(sc.backend, "consumer")),
        (
            f"KVTailConnector({inner})",
            True,
            wrapped_kv_config(sc.backend, "producer", sc.zero_tails),
            wrapped_kv_config(sc.backend, "consumer", sc.zero_tails),
        ),
    ]
    with ExitStack() as stack:
        pairs = []
        for i, (_, _, p_kv, d_kv) in enumerate(variants):
            pair = PDPair(
                model,
                sc.backend,
                p_kv,
                d_kv,
                log_dir / f"{sc.name}-{'wrapped' if i else 'plain'}",
                sc.engine,
                name="wrapped" if i else "plain",
            )
            stack.callback(pair.close)
            pairs.append(pair)
        say(f"starting 4 vLLM CPU engines (2 P/D pairs; logs in {log_dir}) ...")
        t0 = time.monotonic()
        cfgs = [c for pair in pairs for c in pair.engine_configs()]
        engines = start_engines(cfgs, log_dir / sc.name)
        for k, pair in enumerate(pairs):
            pair.attach(engines[2 * k], engines[2 * k + 1])
        startup = time.monotonic() - t0
        say(f"engines up in {startup:.0f} s")

        kv = pairs[0].kv
        assert kv is not None and pairs[0].prefill is not None
        per_slot = {v.get("elements_per_slot", 0) for v in kv.attn_layers.values()}
        elements_per_slot = per_slot.pop() if len(per_slot) == 1 else 0
        # The single-engine reference: each prompt run start to finish on one engine
        # (the plain pair's prefill engine, before anything is poisoned).
        refs = [g.token_ids for g in pairs[0].prefill.generate(prompts, max_tokens)]

        rows: list[Row] = []
        for prompt, ref in zip(prompts, refs, strict=True):
            for pair, (name, wrapped, _, _) in zip(pairs, variants, strict=True):
                try:
                    r = pair.run(
                        prompt,
                        max_tokens,
                        poison_tail=sc.poison_tail,
                        poison_consumer=sc.poison_consumer,
                    )
                finally:
                    pair.scrub()  # poison must not leak into the next request
                assert pair.decode is not None
                log = str(pair.decode.log_path)
                rows.append(_row(r, name, wrapped, ref, elements_per_slot, log))
        isas = sorted({str(v["isa"]) for v in kv.attn_layers.values() if isinstance(v, dict)})
        return Outcome(
            sc,
            rows,
            kv.needs_kv_cache_zeroing,
            kv.attn_block_size,
            ", ".join(isas) or "unknown",
            startup,
            log_dir,
        )
