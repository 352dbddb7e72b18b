"""vLLM's decisions keyed on the connector's NAME, applied to the connector inside.

vLLM decides several things by comparing ``kv_transfer_config.kv_connector``
with a name, directly or through ``KVTransferConfig.has_connector`` (the name,
or a child of a ``MultiConnector`` by that name; one level, no class
ancestry). Behind the wrapper it sees ``"KVTailConnector"``, never the
connector inside. This module owns the mirror: each rule is applied to the
inner connector's transfer config (``backend``, or the children of an
inner ``MultiConnector``) with vLLM's own ``has_connector`` (and its other
``KVTransferConfig`` methods), so that the wrapped engine behaves as the plain
one would: the rule is applied where the wrapper's code runs before it
matters, else the engine is refused at start-up with one message that names
the setting that makes it work. Nothing differs silently.

The audit, one row a decision with its sites per release, is
:data:`kvtail_connector.facade.name_keyed_table.RULES` (re-exported here);
``docs/name-keyed.md`` is the same table with the reasons.

Where the wrapper's code runs early enough for the conv-state layout: vLLM
picks it in the front end's ``CpuPlatform.check_and_update_config`` (inside
``VllmConfig.__post_init__``), before any connector class is asked anything on
CPU (``requires_piecewise_for_cudagraph`` only on static-graph platforms,
``supports_sleep_mode`` only with sleep mode and after it,
``get_required_kvcache_layout`` in the engine core after the model is
loaded); the engine core and the workers inherit the front end's environment,
and each process pins the layout (``get_conv_state_layout`` is an
``lru_cache``) when the model's Mamba shapes are first made, before any
connector is built. The only wrapper code that runs before all of that is
the ``vllm.general_plugins`` entry point, which has no config but runs in the
front end while vLLM builds its argument parser:
:func:`kvtail_connector.plugin.apply_command_line_environment`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtail_connector import _compat

# The audit, re-exported: name_keyed.RULES is the table these checks apply.
from kvtail_connector.facade.name_keyed_table import RULES as RULES
from kvtail_connector.facade.name_keyed_table import Rule as Rule
from kvtail_connector.facade.name_keyed_table import Site as Site
from kvtail_connector.facade.name_keyed_table import rules_for as rules_for

WRAPPER = "KVTailConnector"
MULTI = "MultiConnector"
CONV_STATE_LAYOUT_ENV = "VLLM_SSM_CONV_STATE_LAYOUT"
# platforms/cpu.py: the names it picks the DS conv-state layout for.
NIXL_NAMES = ("NixlConnector", "NixlPullConnector", "NixlPushConnector")
# config/vllm.py _verify_aux_output_compatibility: refused with routed experts.
ROUTED_EXPERTS_REFUSED = (*NIXL_NAMES, "MoRIIOConnector", "MooncakeConnector")


# ------------------------------------------------------------- the first hook


def _as_dict(value: Any) -> Mapping[str, Any] | None:
    if isinstance(value, Mapping):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return None
        return parsed if isinstance(parsed, Mapping) else None
    return None


def wrapped_configs(kv_transfer_config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The inner connectors' configs (as vLLM's ``KVTransferConfig`` fields) of
    every ``KVTailConnector`` in a ``kv_transfer_config`` written as a dict: the
    top level, or a child of a top-level ``MultiConnector``."""
    top = _as_dict(kv_transfer_config) or {}
    if top.get("kv_connector") == MULTI:
        extra = _as_dict(top.get("kv_connector_extra_config")) or {}
        children = extra.get("connectors")
        candidates = (
            [c for c in children if isinstance(c, Mapping)] if isinstance(children, list) else []
        )
    else:
        candidates = [top]
    inners = []
    for cfg in candidates:
        if cfg.get("kv_connector") != WRAPPER:
            continue
        extra = _as_dict(cfg.get("kv_connector_extra_config")) or {}
        inner_name = extra.get("backend")
        if isinstance(inner_name, str):
            inners.append(
                {
                    # As KVTailConfig reads it: surrounding spaces dropped.
                    "kv_connector": inner_name.strip(),
                    "kv_connector_extra_config": _as_dict(extra.get("backend_extra_config")) or {},
                }
            )
    return inners


def has_connector(config: Mapping[str, Any], name: str) -> bool:
    """vLLM's ``KVTransferConfig.has_connector`` on a config written as a dict."""
    if config.get("kv_connector") == name:
        return True
    children = (_as_dict(config.get("kv_connector_extra_config")) or {}).get("connectors")
    return (
        config.get("kv_connector") == MULTI
        and isinstance(children, list)
        and any(isinstance(c, Mapping) and c.get("kv_connector") == name for c in children)
    )


def early_environment(kv_transfer_config: Mapping[str, Any], is_cpu: bool) -> dict[str, str]:
    """The variables vLLM's platform sets for the connectors inside the wrapper
    and does not set for ``KVTailConnector`` (empty when nothing differs):
    on the CPU platform, the DS conv-state layout for NIXL."""
    if not is_cpu:
        return {}
    for inner in wrapped_configs(kv_transfer_config):
        if any(has_connector(inner, name) for name in NIXL_NAMES):
            return {CONV_STATE_LAYOUT_ENV: "DS"}
    return {}


def prepare_environment(
    kv_transfer_config: Mapping[str, Any],
    environ: MutableMapping[str, str] = os.environ,
    is_cpu: bool | None = None,
) -> dict[str, str]:
    """Set in ``environ`` what vLLM's platform would set for the connector inside
    the wrapper (:func:`early_environment`), keeping any value already there (the
    user's, as vLLM keeps it). Returns what was set. For a Python launcher
    (``LLM(...)``, a harness starting engines): call it before vLLM builds the
    engine's config. The plugin calls it for an API server's command line
    (:func:`kvtail_connector.plugin.apply_command_line_environment`). ``is_cpu``:
    the platform (None: vLLM's)."""
    cpu = _compat.platform_is_cpu() if is_cpu is None else is_cpu
    wanted = early_environment(kv_transfer_config, cpu)
    applied = {k: v for k, v in wanted.items() if k not in environ}
    environ.update(applied)
    return applied


# ------------------------------------------------------------ start-up checks


@dataclass(frozen=True)
class _Inner:
    """The inner connector's transfer config, its label for messages, and its
    MultiConnector children as ``(label, kv_connector name)``."""

    ktc: Any
    label: str
    children: tuple[tuple[str, str], ...]

    def find(self, names: Sequence[str]) -> tuple[str, str] | None:
        """``(name, label)`` of the first of ``names`` vLLM's ``has_connector``
        finds: the inner connector itself, or the child of that name."""
        for name in names:
            if self.ktc.has_connector(name):
                if self.ktc.kv_connector == name:
                    return name, self.label
                child = next((lbl for lbl, n in self.children if n == name), self.label)
                return name, child
        return None


def _check_routed_experts(vllm_config: Any, inner: _Inner) -> None:
    aux = getattr(vllm_config, "aux_output_config", None)
    found = inner.find(ROUTED_EXPERTS_REFUSED) if aux is not None and aux.enabled else None
    if found is not None:
        name, label = found
        raise ValueError(
            f"{label} behind KVTailConnector: --enable-return-routed-experts is incompatible "
            f"with {name}; PD auxiliary output is not supported. vLLM refuses this for {name} "
            "by name, as the wrapper does for it. Remove --enable-return-routed-experts."
        )


def _check_nixl_dcp(vllm_config: Any, inner: _Inner, kv_block_size: int | None) -> None:
    parallel = vllm_config.parallel_config
    dcp = _compat.dcp_world_size(parallel)
    found = inner.find(("NixlConnector",)) if dcp > 1 else None
    if found is None:
        return
    label = found[1]
    transfer_tp = max(int(parallel.tensor_parallel_size), _compat.pcp_world_size(parallel))
    if dcp != transfer_tp:
        raise ValueError(
            f"{label} behind KVTailConnector: decode_context_parallel_size={dcp} "
            f"must be 1 or equal to the NIXL transfer parallel size={transfer_tp}."
        )
    model = getattr(vllm_config, "model_config", None)
    if model is not None and not getattr(model, "use_mla", False):
        raise ValueError(
            f"{label} behind KVTailConnector: PD with "
            "decode_context_parallel_size > 1 is only supported for MLA models."
        )
    # vLLM's own flag (0.32-0.34; absent: its default, True): False where the
    # user set the interleave, which vLLM then keeps for a plain NIXL too.
    if not getattr(parallel, "_allow_auto_resolve_cp_interleave_size", True):
        return
    # vLLM's value: the smallest KV cache group block size (rank-local).
    block_size = int(kv_block_size or vllm_config.cache_config.block_size)
    interleave = _compat.dcp_interleave_size(parallel)
    if interleave != block_size:
        raise ValueError(
            f"{label} behind KVTailConnector with decode_context_parallel_size="
            f"{dcp}: vLLM sets cp_kv_cache_interleave_size to the block size only when "
            "it sees NixlConnector by name, and it cannot see through the wrapper. "
            f"Set --cp-kv-cache-interleave-size {block_size} (now {interleave})."
        )


def _check_hisparse(inner: _Inner) -> None:
    found = inner.find(("HiSparseConnector",))
    if found is not None:
        label = found[1]
        raise ValueError(
            f"{label}: HiSparseConnector cannot run behind KVTailConnector. vLLM turns "
            "HiSparse on and reads its host_pool_gib only from a kv_connector, or a "
            "MultiConnector child, named HiSparseConnector, and no setting changes that. "
            'Name it as a MultiConnector child next to KVTailConnector: {"kv_connector": '
            '"MultiConnector", "kv_connector_extra_config": {"connectors": '
            '[{"kv_connector": "HiSparseConnector", ...}, {"kv_connector": '
            '"KVTailConnector", ...}]}}.'
        )


def _check_simple_cpu_offload(vllm_config: Any, inner: _Inner) -> None:
    if not vllm_config.cache_config.enable_prefix_caching:
        return
    found = inner.find(("SimpleCPUOffloadConnector",))
    if found is not None and _compat.simple_cpu_offload_pool_sized_by_name():
        label = found[1]
        raise ValueError(
            f"{label}: with prefix caching on, vLLM sizes SimpleCPUOffloadConnector's "
            "scheduler-side CPU pool from its workers only when it sees the connector by "
            "name, which it cannot behind KVTailConnector. Pass --no-enable-prefix-caching, "
            "or name SimpleCPUOffloadConnector outside the wrapper."
        )


# One kv_role for each (is producer, is consumer) vLLM can derive.
_ROLE_OF = {(True, True): "kv_both", (True, False): "kv_producer", (False, True): "kv_consumer"}


def _check_roles(vllm_config: Any, inner: _Inner) -> None:
    # vLLM's own KVTransferConfig properties, which its scheduler reads (0.34:
    # defer_block_free for a consumer under async scheduling or PP; partial-tail
    # offloads for a producer). 0.34 takes a MultiConnector's from its
    # children's kv_role, not its own; behind the wrapper it reads
    # KVTailConnector's kv_role (0.32, 0.33: the same role both ways).
    outer = getattr(vllm_config, "kv_transfer_config", None)
    if outer is None:
        return
    plain = (bool(inner.ktc.is_kv_producer), bool(inner.ktc.is_kv_consumer))
    wrapped = (bool(outer.is_kv_producer), bool(outer.is_kv_consumer))
    if plain == wrapped:
        return
    role = _ROLE_OF.get(plain)
    fix = f"Set kv_role to {role!r}" if role else "List its connectors, each with a kv_role"
    raise ValueError(
        f"{inner.label} behind KVTailConnector: vLLM takes a MultiConnector's roles from "
        "its connectors' kv_role (producer={}, consumer={}), but behind the wrapper from "
        "KVTailConnector's kv_role={!r} (producer={}, consumer={}), and its scheduler "
        "decides by them (deferred block frees, partial-tail offloads). {}: the role "
        "its connectors give it.".format(*plain, outer.kv_role, *wrapped, fix)
    )


def _check_custom_mem_pool(vllm_config: Any, inner: _Inner) -> None:
    # 0.34: VllmConfig turns the extensible KV cache off (or refuses it) where
    # KVTransferConfig.uses_custom_mem_pool(): the top level's extra config or a
    # MultiConnector child's. The inner connector's is the wrapper's
    # backend_extra_config, out of its sight.
    uses = getattr(inner.ktc, "uses_custom_mem_pool", None)
    if uses is None or not uses():
        return
    if getattr(vllm_config.cache_config, "enable_extensible_kv_cache", False):
        raise ValueError(
            f"{inner.label} behind KVTailConnector: custom_mem_pool allocates the KV cache "
            "from the connector's memory pool, which the extensible KV cache cannot use. "
            "vLLM turns it off by itself only for a custom_mem_pool it finds in "
            "kv_connector_extra_config or a MultiConnector child's, not in the wrapper's "
            "backend_extra_config. Pass --no-enable-extensible-kv-cache."
        )


def _check_conv_state_layout(inner: _Inner, has_mamba: bool) -> None:
    found = inner.find(NIXL_NAMES) if has_mamba else None
    if found is None:
        return
    label = found[1]
    layout = _compat.conv_state_layout()
    if layout == "DS":
        return
    if _compat.platform_is_cpu():
        why = (
            "vLLM's CPU platform picks DS only when it sees a NIXL connector by name, and "
            "the wrapper could not set it before vLLM did (it does so for an API server's "
            "--kv-transfer-config JSON on the command line)"
        )
    else:
        # Not the wrapper's doing: vLLM picks DS by name on the CPU platform
        # alone, so a plain NIXL pair of this model stops here too.
        why = "vLLM picks DS for NIXL on the CPU platform only; a plain NIXL pair needs it too"
    raise ValueError(
        f"{label} behind KVTailConnector: NIXL moves Mamba conv state only in the DS "
        f"layout, and this process uses {layout}; {why}. Set {CONV_STATE_LAYOUT_ENV}=DS in "
        "the environment of both the prefill and the decode server (from Python: call "
        "kvtail_connector.facade.name_keyed.prepare_environment(kv_transfer_config) before "
        "building the engine)."
    )


def check_start_up(
    vllm_config: Any,
    inner_ktc: Any,
    label: str,
    *,
    children: Sequence[tuple[str, str]] = (),
    has_mamba: bool,
    is_worker: bool,
    kv_block_size: int | None = None,
) -> None:
    """Apply vLLM's name-keyed refusals to the inner connector; raise the one
    ValueError of the first that fails.

    Args:
        inner_ktc: the inner connector's ``KVTransferConfig``; vLLM's
            ``has_connector`` on it looks into a MultiConnector's children, as
            vLLM's rules do.
        label: the inner connector in messages.
        children: a MultiConnector's children as ``(label, kv_connector)``, so
            that a message names the child a rule is about.
        has_mamba, is_worker: the conv-state layout is checked where caches
            are made (workers), for models with Mamba layers.
        kv_block_size: the smallest block size of this engine's KV cache
            groups (what vLLM sets the NIXL DCP interleave to); None: the
            cache config's block size.
    """
    inner = _Inner(inner_ktc, label, tuple(children))
    _check_routed_experts(vllm_config, inner)
    _check_nixl_dcp(vllm_config, inner, kv_block_size)
    _check_hisparse(inner)
    _check_simple_cpu_offload(vllm_config, inner)
    _check_roles(vllm_config, inner)
    _check_custom_mem_pool(vllm_config, inner)
    if is_worker:
        _check_conv_state_layout(inner, has_mamba)
