"""The audit of vLLM's decisions keyed on the connector's NAME, per release.

Every ``has_connector(`` call and every comparison of ``kv_connector`` (or of a
variable holding it) with a name in vLLM 0.32.0, 0.33.0 and 0.34.0, as one
:class:`Rule` a decision, with the sites (path, line, text) of each release.
``tests/scheduler/test_name_keyed.py`` checks each site against the installed
release and that vLLM has no name-keyed site the table misses (the scanner is
``tests/helpers/name_keyed_scan.py``, which ``scripts/vllm-release-check``
shares). ``docs/name-keyed.md`` is the same table for readers, with why each
row is handled as it is; :mod:`kvtail_connector.facade.name_keyed` holds the checks.

Not rows: ``_post_init_kv_transfer_config`` (``--kv-offloading-size``
replaces ``kv_connector`` by a name, plain or wrapped alike),
``MultiConnector``'s ``type(connector).__name__`` (a message), usage stats
(report the name: ``KVTailConnector`` is what runs), and the ``is not None``
tests of ``kv_connector``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

RELEASES = ("0.32", "0.33", "0.34")


@dataclass(frozen=True)
class Site:
    """Where vLLM keys on the name: ``path`` under the ``vllm`` package, a line,
    and text that line or one within two lines of it holds."""

    path: str
    line: int
    text: str


@dataclass(frozen=True)
class Rule:
    """One decision vLLM makes by name, and what the wrapper does about it."""

    key: str
    sites: Mapping[str, tuple[Site, ...]]  # release ("0.32"...) -> its sites; () none
    vllm_does: str
    wrapper_does: str


def _per_release(
    v032: tuple[Site, ...], v033: tuple[Site, ...], v034: tuple[Site, ...]
) -> dict[str, tuple[Site, ...]]:
    return dict(zip(RELEASES, (v032, v033, v034), strict=True))


def _same(*sites: Site) -> dict[str, tuple[Site, ...]]:
    return _per_release(sites, sites, sites)


def _only_034(*sites: Site) -> dict[str, tuple[Site, ...]]:
    return _per_release((), (), sites)


def _moved(path: str, text: str, l032: int, l033: int, l034: int) -> dict[str, tuple[Site, ...]]:
    """One site of ``text`` in ``path``, at a line per release."""
    return _per_release(*((Site(path, line, text),) for line in (l032, l033, l034)))


_VLLM = "config/vllm.py"
_KVT = "config/kv_transfer.py"
_FACTORY = "distributed/kv_transfer/kv_connector/factory.py"
_HAS_NIXL = 'has_connector("NixlConnector")'
_MULTI = 'kv_connector == "MultiConnector"'
_STEP5_NVIDIA = (
    Site("models/step5/nvidia/model.py", 319, _MULTI),
    Site("models/step5/nvidia/model.py", 323, '"MooncakeStoreConnector"'),
    Site("models/step5/nvidia/model.py", 324, '"NixlConnector"'),
)
_KIMI = "models/kimi_k3/amd/specialized_decode/runtime/__init__.py"

RULES: tuple[Rule, ...] = (
    Rule(
        "conv_state_layout",
        _moved("platforms/cpu.py", "kv_transfer_config.has_connector(name)", 430, 447, 446),
        "CPU platform: VLLM_SSM_CONV_STATE_LAYOUT=DS for NIXL, else SD on avx512-bf16",
        "plugin sets DS from the command line; else the worker refuses naming the variable",
    ),
    Rule(
        "routed_experts",
        _moved(_VLLM, "has_connector(connector_name)", 1188, 1240, 1149),
        "refuses --enable-return-routed-experts with NIXL, MoRIIO, Mooncake",
        "the same refusal at start-up",
    ),
    Rule(
        "nixl_dcp_size",
        _moved(_VLLM, _HAS_NIXL, 1476, 1575, 1522),
        "asserts DCP in (1, transfer TP) and an MLA model for DCP > 1",
        "the same refusals at start-up",
    ),
    Rule(
        "nixl_dcp_interleave",
        _per_release(
            (Site(_VLLM, 3229, "has_connector("),),
            (Site(_VLLM, 3369, _HAS_NIXL),),
            (Site(_VLLM, 3501, _HAS_NIXL),),
        ),
        "sets cp_kv_cache_interleave_size to the block size for NIXL with DCP",
        "refuses where vLLM would change it, naming --cp-kv-cache-interleave-size",
    ),
    Rule(
        "nixl_dcp_interleave_check",
        _moved(_VLLM, _HAS_NIXL, 3266, 3402, 3534),
        "skips the interleave <= block size assert for NIXL",
        "vLLM's assert runs; what it passes meets nixl_dcp_interleave",
    ),
    Rule(
        "hisparse",
        _same(Site(_KVT, 21, _MULTI), Site(_KVT, 35, '"HiSparseConnector"')),
        "turns HiSparse on and finds its host pool for HiSparseConnector by name",
        "refuses HiSparseConnector inside the wrapper",
    ),
    Rule(
        "hisparse_enable",
        _moved(_VLLM, 'has_connector("HiSparseConnector")', 1803, 1879, 1808),
        "HiSparseConnector named: HiSparse on",
        "refuses HiSparseConnector inside the wrapper (rule hisparse)",
    ),
    Rule(
        "hisparse_warning",
        _per_release(
            (Site(_VLLM, 1837, "self.kv_transfer_config.kv_connector"),),
            (Site(_VLLM, 1913, "self.kv_transfer_config.kv_connector"),),
            (),  # 0.34: removed
        ),
        "0.32, 0.33: warns for HiSparse unless NIXL, MooncakeStore or MultiConnector",
        "nothing: HiSparse runs only with its connector where vLLM sees it",
    ),
    Rule(
        "simple_cpu_offload",
        _per_release(
            (),
            (Site("v1/engine/core.py", 376, 'has_connector("SimpleCPUOffloadConnector")'),),
            (Site("v1/engine/core.py", 424, 'has_connector("SimpleCPUOffloadConnector")'),),
        ),
        "with prefix caching, sizes SimpleCPUOffload's scheduler pool from its workers",
        "0.33, 0.34: refuses it inside the wrapper with prefix caching on",
    ),
    Rule(
        "multi_hma",
        _moved(_FACTORY, 'kv_connector != "MultiConnector"', 139, 139, 162),
        "a MultiConnector supports HMA if every child does",
        "mirrored by inner.hma_blocker",
    ),
    Rule(
        "nixl_transfer_mode",
        _only_034(Site(_FACTORY, 126, 'connector_name == "NixlConnector"')),
        "NixlConnector resolves to NixlPull/NixlPushConnector by its transfer_mode",
        "mirrored: the inner class is resolved by vLLM's factory from the inner config",
    ),
    Rule(
        "lmcache_mp_access",
        _only_034(Site(_FACTORY, 146, '"LMCacheMPConnector"')),
        "an LMCacheMPConnector without its own kv_cache_access: LEGACY_IPC",
        "mirrored: the wrapper's kv_cache_access asks vLLM's factory with the inner config",
    ),
    Rule(
        "multi_roles",
        _only_034(Site(_KVT, 164, 'child.get("kv_role")')),
        "a MultiConnector is a producer/consumer by its children's kv_role, not its own",
        "refuses a wrapper kv_role other than the one its children give, naming it",
    ),
    Rule(
        "custom_mem_pool",
        _only_034(Site(_KVT, 178, 'child.get("kv_connector_extra_config", {})')),
        "custom_mem_pool in a connector's (or child's) extra config: extensible KV cache off",
        "refuses the extensible KV cache with it inside, naming --no-enable-extensible-kv-cache",
    ),
    Rule(
        "connector_children",
        _only_034(Site(_KVT, 186, "def _connector_children")),
        "nothing: KVTransferConfig._connector_children has no caller in 0.34",
        "nothing",
    ),
    Rule(
        "step5_dsa",
        _per_release(
            (),
            _STEP5_NVIDIA,
            (
                *_STEP5_NVIDIA,
                Site("models/step5/amd/checks.py", 13, _MULTI),
                Site("models/step5/amd/checks.py", 17, '"MooncakeStoreConnector"'),
                Site("models/step5/amd/checks.py", 18, '"NixlConnector"'),
            ),
        ),
        "refuses connectors other than MooncakeStore or NIXL with CUDA buffers",
        "nothing: vLLM's own refusal, at model load",
    ),
    Rule(
        "kimi_k3_amd_decode",
        _per_release(
            (),
            (Site(_KIMI, 111, '"MoRIIOConnector"'),),
            (Site(_KIMI, 178, '("MoRIIOConnector", "MooncakeConnector")'),),
        ),
        "refuses connectors other than a MoRIIO (0.34: or Mooncake) consumer",
        "nothing: vLLM's own refusal names the fix",
    ),
    Rule(
        "has_connector",
        _per_release(
            *(
                (
                    Site(_KVT, first, "self.kv_connector == connector_name"),
                    Site(_KVT, first + 2, 'self.kv_connector == "MultiConnector"'),
                    Site(_KVT, first + 3, 'child.get("kv_connector") == connector_name'),
                )
                for first in (143, 143, 210)
            )
        ),
        "the name, or a MultiConnector child by that name",
        "every rule above is applied with it to the inner transfer config",
    ),
)


def rules_for(release: str) -> list[tuple[Rule, Site]]:
    """``(rule, site)`` for every site of ``release`` ("0.32", "0.33", "0.34")."""
    return [(rule, site) for rule in RULES for site in rule.sites.get(release, ())]
