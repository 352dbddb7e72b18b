"""vLLM's decisions keyed on the connector's NAME, and what the wrapper does about each.

vLLM decides several things by comparing ``kv_transfer_config.kv_connector``
with a name, directly or through ``KVTransferConfig.has_connector`` (the name,
or a child of a ``MultiConnector`` by that name; one level, no class
ancestry). Behind the wrapper it sees ``"KVTailConnector"``, never the
connector inside. This module owns the mirror: each rule is applied to the
inner connector's transfer config (``backend``, or the children of an
inner ``MultiConnector``) with vLLM's own ``has_connector``, so that the
wrapped engine behaves as the plain one would: the rule is applied where the
wrapper's code runs before it matters, else the engine is refused at start-up
with one message that names the setting that makes it work. Nothing differs
silently.

The audit (every ``has_connector(`` call and every comparison of
``kv_connector`` with a name in vLLM 0.32.0 and 0.33.0). :data:`RULES` holds
the same rows with their sites; ``tests/scheduler/test_name_keyed.py`` checks
each site against the installed release and that no other site exists. The
same table, one line a row, is in ``docs/name-keyed.md``.

Mamba conv-state layout -- 0.32 platforms/cpu.py:430, 0.33 platforms/cpu.py:447.
    vLLM: on the CPU platform, NixlConnector/NixlPullConnector/NixlPushConnector
    -> ``VLLM_SSM_CONV_STATE_LAYOUT=DS``, else SD on avx512-bf16 CPUs; an
    explicit value is kept. NIXL's worker asserts DS for models with Mamba layers.
    Wrapper: applied. The plugin sets the same variable in the front end before
    cpu.py runs, when the command line's ``--kv-transfer-config`` (JSON) wraps
    NIXL (CPU platform only; an explicit value is kept); the engine core and
    workers inherit it. Where it cannot (Python API, a config file), the worker
    refuses at start-up, before NIXL's assert, naming ``VLLM_SSM_CONV_STATE_LAYOUT=DS``.
--enable-return-routed-experts -- 0.32 config/vllm.py:1188, 0.33 config/vllm.py:1240.
    vLLM: refuses it with NIXL (3 names), MoRIIOConnector, MooncakeConnector.
    Wrapper: the same refusal at start-up.
NIXL DCP size -- 0.32 config/vllm.py:1476, 0.33 config/vllm.py:1575.
    vLLM: asserts DCP in (1, transfer TP size) and an MLA model for DCP > 1.
    Wrapper: the same refusals at start-up.
NIXL DCP interleave -- 0.32 config/vllm.py:3229, 0.33 config/vllm.py:3369.
    vLLM: with DCP > 1 each worker sets ``cp_kv_cache_interleave_size`` to the
    smallest KV cache group block size, unless the user set it explicitly (then
    kept). Wrapper: where vLLM would have changed it, refuses naming
    ``--cp-kv-cache-interleave-size`` and that block size; an explicit value is
    kept, as vLLM keeps it.
NIXL DCP interleave check -- 0.32 config/vllm.py:3266, 0.33 config/vllm.py:3402.
    vLLM: skips its interleave <= block size assert for NIXL. Wrapper: nothing;
    vLLM's assert runs (loud), and what it passes meets the row above.
HiSparse -- 0.32 and 0.33 config/kv_transfer.py:21,35; config/vllm.py 0.32:1803,
    0.33:1879. vLLM: turns HiSparse on, and finds its ``host_pool_gib``, only for
    a kv_connector or MultiConnector child named HiSparseConnector. Wrapper:
    refuses HiSparseConnector inside it (no setting makes vLLM find it there);
    the message shows it as a MultiConnector child next to the wrapper.
HiSparse connector warning -- 0.32 config/vllm.py:1837, 0.33 config/vllm.py:1913.
    vLLM: warns unless NIXL, MooncakeStore or MultiConnector. Wrapper: nothing;
    HiSparse runs only with its connector where vLLM sees it (row above), and
    with the wrapper on top vLLM fails its host-pool lookup as for a plain NIXL.
SimpleCPUOffload pool -- 0.33 v1/engine/core.py:376 (0.32: none).
    vLLM: with prefix caching, sizes the connector's scheduler-side CPU pool
    from its workers. Wrapper (0.33): refuses SimpleCPUOffloadConnector inside
    it with prefix caching on, naming ``--no-enable-prefix-caching``.
HMA of a MultiConnector -- 0.32 and 0.33 distributed/kv_transfer/kv_connector/factory.py:139.
    vLLM: a MultiConnector supports HMA if every child does. Wrapper: mirrored
    (``inner.hma_blocker``), naming ``--disable-hybrid-kv-cache-manager``.
Step5 DSA transfer -- 0.33 models/step5/nvidia/model.py:319-324 (0.32: none).
    vLLM: refuses connectors other than MooncakeStore or NIXL with CUDA buffers.
    Wrapper: nothing; vLLM refuses at model load, before any connector exists.
Kimi-K3 AMD specialized decode -- 0.33 models/kimi_k3/amd/specialized_decode/runtime:111.
    vLLM: refuses any connector but a MoRIIO consumer, naming ``decode_backend=auto``.
    Wrapper: nothing; vLLM's refusal names the fix.
has_connector itself -- 0.32 and 0.33 config/kv_transfer.py:143-146.
    The name, or a MultiConnector child by that name. Wrapper: every rule above
    is applied with it to the inner connector's transfer config.

Not rows: ``_post_init_kv_transfer_config`` (``--kv-offloading-size`` replaces
``kv_connector`` by a name, plain or wrapped alike), ``MultiConnector``'s
``type(connector).__name__`` (a message), ``v1/utils.py:707`` (usage
stats report the name: KVTailConnector is what runs), and the ``is not None``
tests of ``kv_connector``.

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
front end while vLLM builds its argument parser: :func:`environment_from_argv`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtail_connector import _compat

WRAPPER = "KVTailConnector"
MULTI = "MultiConnector"
CONV_STATE_LAYOUT_ENV = "VLLM_SSM_CONV_STATE_LAYOUT"
# platforms/cpu.py: the names it picks the DS conv-state layout for.
NIXL_NAMES = ("NixlConnector", "NixlPullConnector", "NixlPushConnector")
# config/vllm.py _verify_aux_output_compatibility: refused with routed experts.
ROUTED_EXPERTS_REFUSED = (*NIXL_NAMES, "MoRIIOConnector", "MooncakeConnector")


@dataclass(frozen=True)
class Site:
    """Where vLLM keys on the name: ``path`` under the ``vllm`` package, a line
    and text it holds (checked against the installed release by the tests)."""

    path: str
    line: int
    text: str


@dataclass(frozen=True)
class Rule:
    """One row of the audit (the module docstring's table)."""

    key: str
    sites: Mapping[str, tuple[Site, ...]]  # release ("0.32", "0.33") -> sites
    vllm_does: str
    wrapper_does: str


def _both(*sites: Site) -> dict[str, tuple[Site, ...]]:
    return {"0.32": sites, "0.33": sites}


_HAS_NIXL = 'has_connector("NixlConnector")'

RULES: tuple[Rule, ...] = (
    Rule(
        "conv_state_layout",
        {
            "0.32": (Site("platforms/cpu.py", 430, "kv_transfer_config.has_connector(name)"),),
            "0.33": (Site("platforms/cpu.py", 447, "kv_transfer_config.has_connector(name)"),),
        },
        "CPU platform: VLLM_SSM_CONV_STATE_LAYOUT=DS for NIXL, else SD on avx512-bf16",
        "plugin sets DS from the command line; else the worker refuses naming the variable",
    ),
    Rule(
        "routed_experts",
        {
            "0.32": (Site("config/vllm.py", 1188, "has_connector(connector_name)"),),
            "0.33": (Site("config/vllm.py", 1240, "has_connector(connector_name)"),),
        },
        "refuses --enable-return-routed-experts with NIXL, MoRIIO, Mooncake",
        "the same refusal at start-up",
    ),
    Rule(
        "nixl_dcp_size",
        {
            "0.32": (Site("config/vllm.py", 1476, _HAS_NIXL),),
            "0.33": (Site("config/vllm.py", 1575, _HAS_NIXL),),
        },
        "asserts DCP in (1, transfer TP) and an MLA model for DCP > 1",
        "the same refusals at start-up",
    ),
    Rule(
        "nixl_dcp_interleave",
        {
            "0.32": (Site("config/vllm.py", 3229, "has_connector("),),
            "0.33": (Site("config/vllm.py", 3369, _HAS_NIXL),),
        },
        "sets cp_kv_cache_interleave_size to the block size for NIXL with DCP",
        "refuses where vLLM would change it, naming --cp-kv-cache-interleave-size",
    ),
    Rule(
        "nixl_dcp_interleave_check",
        {
            "0.32": (Site("config/vllm.py", 3266, _HAS_NIXL),),
            "0.33": (Site("config/vllm.py", 3402, _HAS_NIXL),),
        },
        "skips the interleave <= block size assert for NIXL",
        "vLLM's assert runs; what it passes meets nixl_dcp_interleave",
    ),
    Rule(
        "hisparse",
        _both(
            Site("config/kv_transfer.py", 21, 'kv_connector == "MultiConnector"'),
            Site("config/kv_transfer.py", 35, '"HiSparseConnector"'),
        ),
        "turns HiSparse on and finds its host pool for HiSparseConnector by name",
        "refuses HiSparseConnector inside the wrapper",
    ),
    Rule(
        "hisparse_enable",
        {
            "0.32": (Site("config/vllm.py", 1803, 'has_connector("HiSparseConnector")'),),
            "0.33": (Site("config/vllm.py", 1879, 'has_connector("HiSparseConnector")'),),
        },
        "HiSparseConnector named: HiSparse on",
        "refuses HiSparseConnector inside the wrapper (rule hisparse)",
    ),
    Rule(
        "hisparse_warning",
        {
            "0.32": (Site("config/vllm.py", 1837, "self.kv_transfer_config.kv_connector"),),
            "0.33": (Site("config/vllm.py", 1913, "self.kv_transfer_config.kv_connector"),),
        },
        "warns for HiSparse unless NIXL, MooncakeStore or MultiConnector",
        "nothing: HiSparse runs only with its connector where vLLM sees it",
    ),
    Rule(
        "simple_cpu_offload",
        {
            "0.32": (),
            "0.33": (Site("v1/engine/core.py", 376, 'has_connector("SimpleCPUOffloadConnector")'),),
        },
        "with prefix caching, sizes SimpleCPUOffload's scheduler pool from its workers",
        "0.33: refuses it inside the wrapper with prefix caching on",
    ),
    Rule(
        "multi_hma",
        _both(
            Site(
                "distributed/kv_transfer/kv_connector/factory.py",
                139,
                'kv_connector != "MultiConnector"',
            )
        ),
        "a MultiConnector supports HMA if every child does",
        "mirrored by inner.hma_blocker",
    ),
    Rule(
        "step5_dsa",
        {
            "0.32": (),
            "0.33": (
                Site("models/step5/nvidia/model.py", 319, 'kv_connector == "MultiConnector"'),
                Site("models/step5/nvidia/model.py", 323, '"MooncakeStoreConnector"'),
                Site("models/step5/nvidia/model.py", 324, '"NixlConnector"'),
            ),
        },
        "refuses connectors other than MooncakeStore or NIXL with CUDA buffers",
        "nothing: vLLM's own refusal, at model load",
    ),
    Rule(
        "kimi_k3_amd_decode",
        {
            "0.32": (),
            "0.33": (
                Site(
                    "models/kimi_k3/amd/specialized_decode/runtime/__init__.py",
                    111,
                    '"MoRIIOConnector"',
                ),
            ),
        },
        "refuses connectors other than a MoRIIO consumer; names decode_backend=auto",
        "nothing: vLLM's own refusal names the fix",
    ),
    Rule(
        "has_connector",
        _both(
            Site("config/kv_transfer.py", 143, "self.kv_connector == connector_name"),
            Site("config/kv_transfer.py", 145, 'self.kv_connector == "MultiConnector"'),
            Site("config/kv_transfer.py", 146, 'child.get("kv_connector") == connector_name'),
        ),
        "the name, or a MultiConnector child by that name",
        "every rule above is applied with it to the inner transfer config",
    ),
)


def rules_for(release: str) -> list[tuple[Rule, Site]]:
    """``(rule, site)`` for every site of ``release`` ("0.32", "0.33")."""
    return [(rule, site) for rule in RULES for site in rule.sites.get(release, ())]


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


def _argv_transfer_config(argv: Sequence[str]) -> str | None:
    # FlexibleArgumentParser's JSON forms: "--kv-transfer-config JSON" and
    # "--kv-transfer-config=JSON" (underscores too); the last one given wins.
    found = None
    for i, arg in enumerate(argv):
        for flag in ("--kv-transfer-config", "--kv_transfer_config"):
            if arg == flag and i + 1 < len(argv):
                found = argv[i + 1]
            elif arg.startswith(flag + "="):
                found = arg[len(flag) + 1 :]
    return found


def environment_from_argv(argv: Sequence[str], is_cpu: bool) -> dict[str, str]:
    """:func:`early_environment` of the ``--kv-transfer-config`` on a command
    line (empty when it has none, or none in a JSON form)."""
    text = _argv_transfer_config(argv)
    config = _as_dict(text) if text is not None else None
    return early_environment(config, is_cpu) if config is not None else {}


def apply_early_environment(
    argv: Sequence[str], environ: Any = os.environ, is_cpu: bool | None = None
) -> dict[str, str]:
    """Set in ``environ`` what :func:`environment_from_argv` asks for, keeping
    any value already there (the user's, as vLLM keeps it). Returns what was set."""
    if _argv_transfer_config(argv) is None:
        return {}
    wanted = environment_from_argv(argv, _compat.platform_is_cpu() if is_cpu is None else is_cpu)
    applied = {k: v for k, v in wanted.items() if k not in environ}
    environ.update(applied)
    return applied


def prepare_environment(kv_transfer_config: Mapping[str, Any]) -> dict[str, str]:
    """For a Python launcher (``LLM(...)``, a harness starting engines): set in
    ``os.environ`` what vLLM's platform would set for the connector inside the
    wrapper, keeping any value already there. Call it before vLLM builds the
    engine's config; it is what the plugin does for an API server's command
    line. Returns what was set."""
    wanted = early_environment(kv_transfer_config, _compat.platform_is_cpu())
    applied = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(applied)
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
    transfer_tp = max(
        int(parallel.tensor_parallel_size),
        int(getattr(parallel, "prefill_context_parallel_size", 1) or 1),
    )
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
    if not _compat.cp_interleave_auto_resolved(parallel):
        return  # set explicitly: vLLM keeps it for a plain NIXL too
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
        "kvtail_connector.name_keyed.prepare_environment(kv_transfer_config) before "
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
    if is_worker:
        _check_conv_state_layout(inner, has_mamba)
