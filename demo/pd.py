"""A prefill engine and a decode engine doing P/D KV transfer on loopback.

NIXL (UCX, CPU buffers): the prefill engine runs the prompt with
``do_remote_decode`` and hands its block ids back in ``kv_transfer_params``; the
decode engine pulls them (``do_remote_prefill``). "The producer's never-written
tail" is then slots ``[prompt_len % block_size, block_size)`` of the last of
those blocks, which ``PDPair.run`` can poison after the prefill, before the pull.

MooncakeStore: both engines talk to a local ``mooncake_master``; the prefill
engine stores the prompt's full blocks, the decode engine runs the same prompt
and loads what the store holds.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from demo.engine import EngineProcess, start_engines
from demo.mooncake import MooncakeMaster, private_lookup_channel
from demo.procs import free_ports
from demo.records import DEFAULT_BLOCK_SIZE, EngineConfig, GenResult, KVInfo
from kvtail_connector.facade.inner import wrap_kv_transfer_config

Backend = Literal["nixl", "mooncake"]
ZeroTails = Literal["auto", "always", "off"]


def kv_config(
    backend: Backend,
    role: Literal["producer", "consumer"],
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``kv_transfer_config`` for one engine of a P/D pair with vLLM's plain connector.

    One call per engine: a MooncakeStore config names a lookup channel of its own
    (``private_lookup_channel``). ``overrides`` is merged on top
    (``kv_connector_extra_config`` key by key).
    """
    if backend == "nixl":
        cfg: dict[str, Any] = {
            "kv_connector": "NixlConnector",
            # kv_both is deprecated for NIXL; explicit roles say which side pulls.
            "kv_role": "kv_producer" if role == "producer" else "kv_consumer",
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {},
        }
    elif backend == "mooncake":
        # The store is symmetric: the producer saves, the consumer looks up and loads.
        cfg = {
            "kv_connector": "MooncakeStoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lookup_rpc_port": private_lookup_channel()},
        }
    else:
        raise ValueError(f"unknown backend {backend!r}")
    for k, v in (overrides or {}).items():
        if k == "kv_connector_extra_config":
            cfg[k] = {**cfg.get(k, {}), **v}
        else:
            cfg[k] = v
    return cfg


def wrapped_kv_config(
    backend: Backend,
    role: Literal["producer", "consumer"],
    zero_tails: ZeroTails = "auto",
    probe_stale_tails: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """The same side with ``KVTailConnector`` wrapping the plain connector: the plain
    connector's name and extra config move into ``kv_connector_extra_config``; every
    other field (``kv_role``, ``kv_buffer_device``) stays where it is. ``options``:
    the wrapper's other fields (e.g. ``verify_kv``)."""
    return wrap_kv_transfer_config(
        kv_config(backend, role),
        zero_tails=zero_tails,
        probe_stale_tails=probe_stale_tails,
        **options,
    )


def make_prompt(n: int, seed: int = 0, vocab: int = 512) -> list[int]:
    """A deterministic prompt of ``n`` ids (avoiding the special ids 0-2)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@dataclass
class PDResult:
    prompt_token_ids: list[int]
    prefill: GenResult
    decode: GenResult
    producer_blocks: list[int]  # the producer's attention block ids for the prompt
    poisoned_slots: int  # (layer, block, slot) triples set on the producer
    decode_blocks: list[int] | None  # the consumer's attention block ids (allocation record)
    # Consumer's last prompt block, per layer: NaN elements per slot, read after decode.
    decode_last_block_nan: dict[str, list[int]] | None
    decode_nan: int | None  # NaN elements in all the consumer's blocks of the request
    kvtail: dict[str, int]  # the decode engine's wrapper counters during the run (deltas)
    attn_block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def decode_failed(self) -> bool:
        """The decode request ended without computing its prompt (``finish_reason``
        "error": its KV load failed and the engine's policy is "fail")."""
        return self.decode.finish_reason not in ("length", "stop")

    @property
    def hit(self) -> int | None:
        """Tokens the decode engine's connector reported it would load (first lookup)."""
        hits = self.decode.connector_hits
        return hits[0]["matched"] if hits else None

    def decode_tail_nan_slots(self) -> dict[str, list[int]]:
        """Per layer: slots of the consumer's last prompt block holding any NaN."""
        return {
            k: [i for i, c in enumerate(v) if c]
            for k, v in (self.decode_last_block_nan or {}).items()
        }


class PDPair:
    """A prefill engine and a decode engine (and, for Mooncake, a master).

    ``prefill_kv`` / ``decode_kv`` override the default (plain) connector configs,
    e.g. ``wrapped_kv_config("nixl", "consumer", "always")``.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        backend: Backend = "nixl",
        prefill_kv: dict[str, Any] | None = None,
        decode_kv: dict[str, Any] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        engine_overrides: dict[str, Any] | None = None,
        name: str = "",
    ) -> None:
        self.model = str(model)
        self.backend: Backend = backend
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="kvtail-pd-"))
        self.prefill_kv = prefill_kv or kv_config(backend, "producer")
        self.decode_kv = decode_kv or kv_config(backend, "consumer")
        self.engine_overrides = engine_overrides or {}
        self.name = name
        self.master: MooncakeMaster | None = None
        self.prefill: EngineProcess | None = None
        self.decode: EngineProcess | None = None
        self.kv: KVInfo | None = None

    def engine_configs(self) -> list[EngineConfig]:
        """The two engines' configs; for Mooncake, starts the master first (its
        address goes into the engines' environment)."""
        env_p: dict[str, str] = {}
        env_d: dict[str, str] = {}
        if self.backend == "nixl":
            # NIXL listens on base port + DP index (0 here): one port each.
            p_port, d_port = free_ports(2)
            env_p["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(p_port)
            env_d["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(d_port)
        elif self.master is None:
            self.master = MooncakeMaster(self.log_dir / "mooncake").start()
        if self.master is not None:
            env_p.update(self.master.env)
            env_d.update(self.master.env)
        common = dict(model=self.model, **self.engine_overrides)
        extra_env = common.pop("env", {})
        prefix = f"{self.name}-" if self.name else ""
        return [
            EngineConfig(
                name=f"{prefix}prefill",
                kv_transfer_config=self.prefill_kv,
                env={**extra_env, **env_p},
                **common,
            ),
            EngineConfig(
                name=f"{prefix}decode",
                kv_transfer_config=self.decode_kv,
                env={**extra_env, **env_d},
                **common,
            ),
        ]

    def attach(self, prefill: EngineProcess, decode: EngineProcess) -> PDPair:
        """Use two engines started elsewhere (e.g. with other pairs' engines at once)."""
        self.prefill, self.decode = prefill, decode
        self.kv = decode.kv_info()
        return self

    def start(self, timeout: float = 300.0) -> PDPair:
        try:
            prefill, decode = start_engines(self.engine_configs(), self.log_dir, timeout)
            self.attach(prefill, decode)
        except BaseException:
            self.close()
            raise
        return self

    @property
    def attn_block_size(self) -> int:
        assert self.kv is not None
        return self.kv.attn_block_size

    def close(self) -> None:
        for e in (self.decode, self.prefill):
            if e is not None:
                e.close()
        if self.master is not None:
            self.master.close()

    def __enter__(self) -> PDPair:
        return self.start() if self.prefill is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the two-step request ---------------------------------------------
    def run(
        self,
        prompt: Sequence[int],
        max_tokens: int = 8,
        poison_tail: float | None = None,
        store_wait_s: float = 10.0,
        poison_consumer: float | None = None,
        corrupt_slot: tuple[int, float] | None = None,
        corrupt_state: tuple[int, float] | None = None,
    ) -> PDResult:
        """Prefill on one engine, decode on the other, return both outputs and KV facts.

        NIXL: prefill with max_tokens=1 and ``do_remote_decode``; optionally poison
        the producer's never-written tail slots of the last prompt block (after its
        prefill, before the consumer pulls); then decode with the returned params
        (``do_remote_prefill``). Mooncake: prefill stores, wait until the master holds
        the keys, then the decode engine runs the same prompt and hits the store.

        ``corrupt_slot`` ``(token, value)`` (NIXL) sets the producer's slot of that
        prompt token, in every attention layer, to ``value`` after its prefill
        (after anything the producer computed over its KV, a digest included) and
        before the consumer pulls: the bytes change between producer and consumer.

        ``corrupt_state`` ``(state, value)`` (NIXL, hybrids) sets element 0 of that
        state (0 conv, 1 SSM / recurrent) of the state block the producer sends, in
        every state layer, at the same point: a state byte changed on the way.

        ``poison_consumer`` fills every attention slot of the (idle) decode engine
        first, standing for stale bytes left by earlier requests. NaN there is only
        meaningful where vLLM zeroes new blocks (hybrid models): on a uniform model
        the consumer's own partial blocks keep the poison and break it regardless.

        Poison outlives the request: freed blocks go back to the pool with it and
        break the next request that gets one as a partial block. Call ``scrub()``
        after a poisoned run (after inspecting whatever you need).
        """
        assert self.prefill is not None and self.decode is not None and self.kv is not None
        bs = self.attn_block_size
        prompt = list(prompt)
        if self.backend == "nixl":
            before = None
            pre = self.prefill.generate([prompt], 1, [{"do_remote_decode": True}])[0]
        else:
            assert self.master is not None
            before = self.master.puts()
            pre = self.prefill.generate([prompt], 1)[0]

        params = pre.kv_transfer_params or {}
        producer_blocks = self.kv.attn_ids(params.get("remote_block_ids") or pre.block_ids)
        poisoned = 0
        if poison_tail is not None and len(prompt) % bs and producer_blocks:
            last = producer_blocks[(len(prompt) - 1) // bs]
            poisoned = self.prefill.fill_slots([last], len(prompt) % bs, None, poison_tail)
        if corrupt_slot is not None and producer_blocks:
            token, value = corrupt_slot
            block = producer_blocks[token // bs]
            poisoned += self.prefill.fill_slots([block], token % bs, token % bs + 1, value)
        if corrupt_state is not None:
            state_blocks = self.kv.state_ids(params.get("remote_block_ids"))
            if not state_blocks:
                raise RuntimeError(f"no state block in the producer's params: {params}")
            poisoned += self.prefill.fill_state(state_blocks, *corrupt_state)

        if self.backend == "mooncake":
            self._wait_store(before, store_wait_s)
            dparams = None
        else:
            dparams = [{**params, "do_remote_prefill": True, "do_remote_decode": False}]
        if poison_consumer is not None:
            self.decode.fill_all(poison_consumer)
        counters = self.decode.kvtail_counters()
        dec = self.decode.generate([prompt], max_tokens, dparams)[0]
        after = self.decode.kvtail_counters()
        kvtail = {k: v - counters.get(k, 0) for k, v in after.items()}

        decode_blocks = self.kv.attn_ids(dec.block_ids) if dec.block_ids else None
        if dec.finish_reason not in ("length", "stop"):
            # It never computed its prompt (its load failed under the engines'
            # kv_load_failure_policy "fail"): its last allocation was the load's,
            # whose blocks cover the loaded tokens only. No KV facts to read.
            decode_blocks = None
        elif decode_blocks and len(decode_blocks) < -(-len(prompt) // bs):
            raise RuntimeError(
                f"decode request {dec.engine_request_id} finished ({dec.finish_reason}) "
                f"with {len(decode_blocks)} attention blocks recorded for a prompt of "
                f"{len(prompt)} tokens in {bs}-token blocks"
            )
        last_nan = total_nan = None
        if decode_blocks and "error" not in self.kv.attn_layers:  # slot views exist
            counts = self.decode.slot_nan_counts(decode_blocks)
            last_id = decode_blocks[(len(prompt) - 1) // bs]
            last_nan = {k: v[last_id] for k, v in counts.items()}
            total_nan = sum(sum(c) for per_block in counts.values() for c in per_block.values())
        return PDResult(
            prompt,
            pre,
            dec,
            producer_blocks,
            poisoned,
            decode_blocks,
            last_nan,
            total_nan,
            kvtail,
            bs,
        )

    def scrub(self) -> tuple[int, int]:
        """Replace NaN by 0 in both engines (after a poisoned run), so freed
        poisoned blocks cannot break later requests. Returns NaN counts removed."""
        assert self.prefill is not None and self.decode is not None
        return self.prefill.scrub_nan(), self.decode.scrub_nan()

    def _wait_store(self, before: tuple[float, float] | None, timeout: float) -> None:
        """Saves are asynchronous: wait until the master has seen new puts and none is
        in flight. If nothing new starts within 2 s (the blocks were already stored),
        go on."""
        assert self.master is not None
        t0 = time.monotonic()
        stable = 0
        while time.monotonic() - t0 < timeout:
            started, ended = self.master.puts()
            moved = before is not None and started > before[0]
            idle = started == ended
            if idle and (moved or time.monotonic() - t0 > 2.0):
                stable += 1
                if stable >= 3:
                    return
            else:
                stable = 0
            time.sleep(0.1)
        raise TimeoutError(f"Mooncake puts still in flight after {timeout} s")
