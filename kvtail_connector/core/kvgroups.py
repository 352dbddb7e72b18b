"""Which KV cache groups have token tails, and how many tokens a block covers.

Derived once from vLLM's ``KVCacheConfig``; the scheduler and worker sides
receive these plain values instead of re-reading vLLM's config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GroupInfo:
    """One KV cache group, as far as tails are concerned.

    Attributes:
        group_id: index in ``kv_cache_config.kv_cache_groups``.
        has_tails: attention pages addressed slot by slot (not Mamba state,
            ring buffers, raw buffers or host-resident pools).
        block_size: tokens of one rank-local block.
        dcp_size: ranks a block's tokens are dealt to (1 when replicated).
        state_scratch: for a state group (vLLM's ``MambaSpec``, device
            resident), the speculative scratch blocks trailing its block
            list; None for any other group.
    """

    group_id: int
    has_tails: bool
    block_size: int
    dcp_size: int
    state_scratch: int | None = None

    @property
    def effective_block(self) -> int:
        """Tokens one manager block covers across DCP ranks."""
        return self.block_size * self.dcp_size


def _per_layer(group_spec: Any) -> Mapping[str, Any] | None:
    """The layers' own specs where one group spec holds several
    (``UniformTypeKVCacheSpecs.kv_cache_specs``); None where every layer of
    the group has ``group_spec`` itself."""
    return getattr(group_spec, "kv_cache_specs", None) or None


def _layer_specs(group_spec: Any) -> list[Any]:
    per_layer = _per_layer(group_spec)
    return list(per_layer.values()) if per_layer else [group_spec]


def layer_spec(group_spec: Any, layer: str) -> Any:
    """The spec of ``layer``, one of the group's ``layer_names``."""
    per_layer = _per_layer(group_spec)
    return per_layer[layer] if per_layer else group_spec


def group_infos(kv_cache_config: Any, dcp_world_size: int) -> tuple[GroupInfo, ...]:
    """Tail facts for every group of ``kv_cache_config``."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    infos = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        specs = _layer_specs(group.kv_cache_spec)
        attention = all(isinstance(s, AttentionSpec) for s in specs)
        has_tails = (
            attention
            and not getattr(group, "host_resident", False)
            and all(getattr(s, "uses_slot_mapping", True) for s in specs)
            and all(getattr(s, "has_layer_views", True) for s in specs)
        )
        sharded = attention and all(getattr(s, "dcp_sharded", False) for s in specs)
        state = all(isinstance(s, MambaSpec) for s in specs) and not getattr(
            group, "host_resident", False
        )
        infos.append(
            GroupInfo(
                group_id=gid,
                has_tails=has_tails,
                block_size=int(group.kv_cache_spec.block_size),
                dcp_size=dcp_world_size if sharded else 1,
                state_scratch=int(getattr(specs[0], "num_speculative_blocks", 0))
                if state
                else None,
            )
        )
    return tuple(infos)


def state_block(block_ids: Any, scratch: int) -> tuple[int, int] | None:
    """``(index, block id)`` of the block of a state group's list holding the
    request's running state: the last one before the speculative scratch
    blocks (vLLM's ``clip_ssm_state_blocks``: the block NIXL sends); None for
    an empty list."""
    ids = list(block_ids)
    if not ids:
        return None
    index = len(ids) - 1 - min(scratch, len(ids) - 1)
    return index, int(ids[index])
