"""Plain, picklable data crossing between the parent and an engine process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Environment every engine process gets (before vLLM is imported there).
BASE_ENV: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in-process: fast start, reachable
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default (92% of RAM) fails on this machine
    "HF_HUB_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",  # else vLLM/Mooncake register the machine's public address
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "TOKENIZERS_PARALLELISM": "false",
}

DEFAULT_BLOCK_SIZE = 32  # CPU attention needs a multiple of 32
DEFAULT_NUM_BLOCKS = 1024  # small cache: quick NIXL registration and NaN census


@dataclass
class EngineConfig:
    """One engine: ``LLM(...)`` arguments and the process environment."""

    model: str
    kv_transfer_config: dict[str, Any] | None = None
    name: str = "engine"
    block_size: int = DEFAULT_BLOCK_SIZE
    max_model_len: int = 256
    dtype: str = "float32"  # bf16 + NIXL crashed (SIGILL in AMX attention) on the decode side
    enable_prefix_caching: bool = False  # off, or the engine's own cache answers, not the connector
    num_blocks: int | None = DEFAULT_NUM_BLOCKS
    llm_kwargs: dict[str, Any] = field(default_factory=dict)  # anything else for LLM(...)
    env: dict[str, str] = field(default_factory=dict)  # on top of BASE_ENV
    # NIXL's progress thread polls UCX with no pause (nixl _api.py sets pthrDelay=0),
    # so each idle NIXL engine burns a whole core; on 2 cores two idle engines halve
    # the speed of everything else. A pause of this many microseconds between polls
    # stops that and only delays progress by as much. None keeps NIXL's default.
    nixl_progress_delay_us: int | None = 1000


@dataclass
class GenResult:
    request_id: str  # the id LLM.generate reported (external id)
    engine_request_id: str | None  # the scheduler's id (external id + random suffix)
    prompt_token_ids: list[int]
    token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    block_ids: list[list[int]] | None  # per KV cache group, as allocated by the scheduler
    connector_hits: list[dict[str, Any]]  # each get_num_new_matched_tokens call for it
    # "length" or "stop": it computed its prompt; "error": it ended before (e.g. its
    # KV load failed under kv_load_failure_policy "fail"), block_ids not the prompt's.
    finish_reason: str | None = None


@dataclass
class KVInfo:
    num_blocks: int
    block_size: int  # scheduler block size
    needs_kv_cache_zeroing: bool
    cache_hit_alignment_tokens: int | None
    groups: list[dict[str, Any]]  # per group: spec type, block_size, layer names
    attn_layers: dict[str, dict[str, Any]]  # per attention layer: shape, dtype, kernel block size

    @property
    def attn_block_size(self) -> int:
        """Token slots per attention block. Not the scheduler's block size, which
        for hybrid models is the lcm over all groups (e.g. 256 with Mamba state)."""
        sizes = [g["block_size"] for g in self.groups if "Attention" in g["spec"]]
        return sizes[0] if sizes else self.block_size

    def state_ids(self, block_ids: Any) -> list[int]:
        """Block ids of every state (Mamba) group from a per-group list."""
        if not block_ids or isinstance(block_ids[0], int):
            return []
        return [
            b
            for g, ids in zip(self.groups, block_ids, strict=False)
            if g["spec"] == "MambaSpec"
            for b in ids
        ]

    def attn_ids(self, block_ids: Any) -> list[int]:
        """Block ids of the first attention group from a per-group list (or a flat list)."""
        if not block_ids:
            return []
        if isinstance(block_ids[0], int):
            return list(block_ids)
        for g, ids in zip(self.groups, block_ids, strict=False):
            if "Attention" in g["spec"]:
                return list(ids)
        return list(block_ids[0])


class EngineError(RuntimeError):
    """The engine process died, timed out, or failed to start."""


class EngineCallError(EngineError):
    """A command raised inside the engine process; the engine is still usable."""
