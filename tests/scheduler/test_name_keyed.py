"""vLLM's name-keyed decisions, behind the wrapper as for the connector inside.

Every test builds vLLM's real config the way an engine does (``VllmConfig``
with the wrapper's ``kv_transfer_config``) and compares what vLLM does for the
plain connector with what happens for the wrapped one: the wrapper applies
vLLM's rule (the conv-state layout), or refuses at start-up with the setting
that makes it work. The audit table itself (``name_keyed.RULES``) is checked
against the installed release: each site holds what the table says, and no
name-keyed site of vLLM is missing from it.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs

from demo.tiny_model import ensure_tiny_hybrid
from kvtail_connector import _compat, plugin
from kvtail_connector.config import KVTailConfig
from kvtail_connector.facade import name_keyed, name_keyed_table
from kvtail_connector.facade.connector import KVTailConnector
from kvtail_connector.facade.inner import inner_transfer_config, wrap_kv_transfer_config
from tests.helpers import name_keyed_scan as scan
from tests.helpers.vllm_factories import (
    make_hybrid_mamba_kv_cache_config,
    make_kv_cache_config,
    make_scheduler,
    make_vllm_config,
)

LAYOUT = name_keyed.CONV_STATE_LAYOUT_ENV
RELEASE = "{}.{}".format(*_compat.check_vllm_version())
VLLM_DIR = Path(vllm.__file__).parent


# ------------------------------------------------------------------ the audit


def _table(release: str) -> list[scan.TableSite]:
    return [scan.TableSite(r.key, s.path, s.line, s.text) for r, s in name_keyed.rules_for(release)]


def test_every_site_of_the_table_holds_what_it_says() -> None:
    table = _table(RELEASE)
    assert table, RELEASE
    result = scan.compare(VLLM_DIR, table, found=[])
    assert result.moved == [] and result.removed == [], (result.moved, result.removed)
    assert len(result.held) == len(table)


def test_no_name_keyed_site_of_vllm_is_missing_from_the_table() -> None:
    missing = scan.missing_from(scan.scan(VLLM_DIR), _table(RELEASE))
    assert missing == [], "name-keyed sites the audit does not list:\n" + "\n".join(
        f"{f.path}:{f.line}: {f.text}" for f in missing
    )


def test_every_rule_says_what_each_release_has() -> None:
    for rule in name_keyed.RULES:
        assert set(rule.sites) == set(name_keyed_table.RELEASES), rule.key
    assert RELEASE in name_keyed_table.RELEASES


SCANNED = """
def by_variable(ktc, registry):
    connector_name = ktc.kv_connector
    if connector_name == "NixlConnector":
        pass
    if connector_name in ("A", "B"):
        pass
    if connector_name in registry or connector_name is None:
        pass

def direct(ktc, child, name):
    return (
        ktc.kv_connector != "MultiConnector"
        or child.get("kv_connector") == name
        or getattr(ktc, "kv_connector") in {"C"}
        or ktc.has_connector("D")
    )

def not_a_connector_name(ktc):
    connector_name = ktc.other
    return connector_name == "NixlConnector"

def nested(ktc):
    name = ktc.kv_connector
    def inner(name):
        return name == "E"  # a parameter, not the variable outside
    return inner
"""


def test_the_scanner_finds_comparisons_through_a_variable() -> None:
    found = [(f.line, f.text) for f in scan.scan_source(SCANNED, "m.py")]
    assert sorted(found) == [
        (4, "connector_name == 'NixlConnector'"),
        (6, "connector_name in ('A', 'B')"),
        (13, "ktc.kv_connector != 'MultiConnector'"),
        (14, "child.get('kv_connector') == name"),
        (15, "getattr(ktc, 'kv_connector') in {'C'}"),
        (16, "ktc.has_connector('D')"),
    ]


# ------------------------------------------------------ conv-state layout (CPU)


@pytest.fixture
def clean_environ() -> Iterator[None]:
    """No layout chosen yet; the environment as it was afterwards (CpuPlatform
    writes LD_PRELOAD, the layout... into os.environ)."""
    saved = dict(os.environ)
    os.environ.pop(LAYOUT, None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _nixl(role: str = "kv_consumer", name: str = "NixlConnector") -> dict[str, Any]:
    return {"kv_connector": name, "kv_role": role, "kv_buffer_device": "cpu"}


def _multi(*children: dict[str, Any], role: str = "kv_consumer") -> dict[str, Any]:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"connectors": list(children)},
    }


def _mooncake_store() -> dict[str, Any]:
    return {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}


def _wrapped(plain: dict[str, Any]) -> dict[str, Any]:
    return wrap_kv_transfer_config(plain)


def _build(kv_transfer_config: dict[str, Any]) -> VllmConfig:
    """The hybrid model's config as an API server builds it (EngineArgs)."""
    from vllm.config import KVTransferConfig

    args = EngineArgs(
        model=str(ensure_tiny_hybrid(kind="granite")),
        dtype="float32",
        block_size=32,
        max_model_len=256,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        kv_transfer_config=KVTransferConfig(**kv_transfer_config),
    )
    return args.create_engine_config()


def _layout_after_config(kv_transfer_config: dict[str, Any], argv: list[str]) -> str | None:
    """The layout variable once vLLM built its config in a fresh front end whose
    command line is ``argv`` (the plugin ran first, as vLLM runs it)."""
    os.environ.pop(LAYOUT, None)
    plugin.apply_command_line_environment(argv)
    _build(kv_transfer_config)
    return os.environ.get(LAYOUT)


def _argv(kv_transfer_config: dict[str, Any]) -> list[str]:
    return ["api_server", "--model", "m", "--kv-transfer-config", json.dumps(kv_transfer_config)]


pytestmark_cpu = pytest.mark.skipif(not _compat.platform_is_cpu(), reason="CPU platform rule")

NIXL_CASES = {
    "nixl": _nixl(),
    "nixl_pull": _nixl(name="NixlPullConnector"),
    # kv_both: what 0.34 takes from the children (a consumer and a kv_both).
    "multi_with_nixl_child": _multi(_nixl(), _mooncake_store(), role="kv_both"),
}


@pytestmark_cpu
@pytest.mark.parametrize("case", sorted(NIXL_CASES))
def test_wrapped_nixl_gets_the_layout_vllm_picks_for_plain_nixl(case, clean_environ) -> None:
    plain = NIXL_CASES[case]
    reference = _layout_after_config(plain, ["api_server"])
    assert reference == "DS"  # vLLM's rule, keyed on the name
    # Without the plugin's early step vLLM does not see NIXL behind the wrapper
    # (the start-up failure).
    assert _layout_after_config(_wrapped(plain), ["api_server"]) != "DS"
    # The plugin, from the command line, before vLLM picks: the same as plain.
    assert _layout_after_config(_wrapped(plain), _argv(_wrapped(plain))) == reference


@pytestmark_cpu
def test_wrapper_as_a_multiconnector_child_gets_the_nixl_layout(clean_environ) -> None:
    top = _multi(_wrapped(_nixl()), _mooncake_store())
    assert _layout_after_config(top, ["api_server"]) != "DS"
    assert _layout_after_config(top, _argv(top)) == "DS"


@pytestmark_cpu
def test_a_python_launcher_prepares_the_same_layout(clean_environ) -> None:
    wrapped = _wrapped(_nixl())
    assert name_keyed.prepare_environment(wrapped) == {LAYOUT: "DS"}
    _build(wrapped)
    assert os.environ[LAYOUT] == "DS"
    assert name_keyed.prepare_environment(wrapped) == {}  # set already: kept


@pytestmark_cpu
def test_wrapped_non_nixl_keeps_vllms_choice(clean_environ) -> None:
    plain = _mooncake_store()
    reference = _layout_after_config(plain, ["api_server"])
    assert plugin.apply_command_line_environment(_argv(_wrapped(plain)), {}, is_cpu=True) == {}
    assert _layout_after_config(_wrapped(plain), _argv(_wrapped(plain))) == reference


@pytestmark_cpu
def test_an_explicit_layout_is_kept(clean_environ) -> None:
    os.environ[LAYOUT] = "SD"
    assert plugin.apply_command_line_environment(_argv(_wrapped(_nixl()))) == {}
    _build(_wrapped(_nixl()))
    assert os.environ[LAYOUT] == "SD"  # as vLLM keeps it for a plain NIXL


def _command_line_environment(args: list[str], is_cpu: bool) -> dict[str, str]:
    """What the plugin sets for the command line ``x ARGS`` in an empty environment."""
    return plugin.apply_command_line_environment(["x", *args], {}, is_cpu)


def test_command_line_forms_and_platforms() -> None:
    wrapped = json.dumps(_wrapped(_nixl()))
    want = {LAYOUT: "DS"}
    assert _command_line_environment([f"--kv-transfer-config={wrapped}"], True) == want
    assert _command_line_environment(["--kv_transfer_config", wrapped], True) == want
    assert _command_line_environment(["--kv-transfer-config", wrapped], False) == {}
    assert _command_line_environment(["--kv-transfer-config", "{bad"], True) == {}
    assert _command_line_environment(["--kv-transfer-config"], True) == {}
    plain = json.dumps(_nixl())  # vLLM sees this one itself
    assert _command_line_environment(["--kv-transfer-config", plain], True) == {}
    # The backend as the wrapper's config reads it: surrounding spaces dropped.
    padded = _wrapped(_nixl())
    extra = padded["kv_connector_extra_config"]
    extra["backend"] = f"  {extra['backend']} "
    assert _command_line_environment(["--kv-transfer-config", json.dumps(padded)], True) == want


def test_plugin_applies_the_command_line_layout(monkeypatch, clean_environ) -> None:
    monkeypatch.setattr("sys.argv", _argv(_wrapped(_nixl())))
    plugin.register()
    assert os.environ.get(LAYOUT) == ("DS" if _compat.platform_is_cpu() else None)


@pytest.fixture
def layout(monkeypatch) -> Iterator[Any]:
    """Set this process's conv-state layout (vLLM caches it at first use)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    def use(value: str) -> None:
        monkeypatch.setenv(LAYOUT, value)
        get_conv_state_layout.cache_clear()

    yield use
    monkeypatch.undo()
    get_conv_state_layout.cache_clear()


def _wrapper_config(plain: dict[str, Any], **kw: Any) -> VllmConfig:
    wrapped = _wrapped(plain)
    return make_vllm_config(
        kv_connector=wrapped["kv_connector"],
        kv_connector_module_path=wrapped["kv_connector_module_path"],
        kv_role=wrapped["kv_role"],
        kv_connector_extra_config=wrapped["kv_connector_extra_config"],
        **kw,
    )


def _inner(vllm_config: VllmConfig) -> Any:
    outer = vllm_config.kv_transfer_config
    return inner_transfer_config(
        outer, KVTailConfig.from_extra_config(outer.kv_connector_extra_config)
    )


@pytest.mark.parametrize("case", sorted(NIXL_CASES))
def test_worker_refuses_a_layout_nixl_cannot_move(case, layout) -> None:
    """Where the layout could not be applied early (Python API, config file),
    the worker refuses before NIXL's assert, naming the variable."""
    layout("SD")
    vllm_config = _wrapper_config(NIXL_CASES[case], mamba_cache_mode="none")
    hybrid = make_hybrid_mamba_kv_cache_config(block_size=16, num_blocks=8)
    with pytest.raises(ValueError, match=f"Set {LAYOUT}=DS in the environment"):
        KVTailConnector(vllm_config, KVConnectorRole.WORKER, hybrid)
    layout("DS")
    name_keyed.check_start_up(
        vllm_config, _inner(vllm_config), "backend", has_mamba=True, is_worker=True
    )
    # Scheduler side and models without Mamba layers: no layout to check.
    layout("SD")
    name_keyed.check_start_up(
        vllm_config, _inner(vllm_config), "backend", has_mamba=True, is_worker=False
    )
    name_keyed.check_start_up(
        vllm_config, _inner(vllm_config), "backend", has_mamba=False, is_worker=True
    )


def test_off_cpu_the_refusal_does_not_blame_the_wrapper(layout, monkeypatch) -> None:
    """On GPUs vLLM never picks DS by name, so a plain NIXL pair of a hybrid
    stops at NIXL's assert too: the message says so, not that the wrapper
    failed to apply a rule."""
    layout("SD")
    vllm_config = _wrapper_config(NIXL_CASES["nixl"], mamba_cache_mode="none")
    check = name_keyed.check_start_up
    with pytest.raises(ValueError) as on_cpu:
        check(vllm_config, _inner(vllm_config), "backend", has_mamba=True, is_worker=True)
    monkeypatch.setattr(_compat, "platform_is_cpu", lambda: False)
    with pytest.raises(ValueError) as on_gpu:
        check(vllm_config, _inner(vllm_config), "backend", has_mamba=True, is_worker=True)
    assert "CPU platform picks DS only when" in str(on_cpu.value)
    assert "a plain NIXL pair needs it too" in str(on_gpu.value)
    assert f"Set {LAYOUT}=DS in the environment" in str(on_gpu.value)


# ------------------------------------------------------------- routed experts


def _vllm_refuses_routed_experts(plain_kv: dict[str, Any]) -> str | None:
    """vLLM's own check (VllmConfig._verify_aux_output_compatibility) on the
    plain connector; the fields it reads before the connector pass."""
    from vllm.config import KVTransferConfig

    fake = types.SimpleNamespace(
        aux_output_config=types.SimpleNamespace(enabled=True),
        use_v2_model_runner=True,
        model_config=types.SimpleNamespace(runner_type="generate", is_moe=True),
        cache_config=types.SimpleNamespace(enable_prefix_caching=True),
        speculative_config=None,
        parallel_config=types.SimpleNamespace(
            pipeline_parallel_size=1,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
        ),
        kv_transfer_config=KVTransferConfig(**plain_kv),
    )
    try:
        VllmConfig._verify_aux_output_compatibility(fake)  # type: ignore[arg-type]
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "plain",
    [_nixl(), _nixl(name="NixlPushConnector"), _mooncake_store(), _multi(_nixl())],
    ids=["nixl", "nixl_push", "mooncake_store", "multi_nixl"],
)
def test_routed_experts_refused_as_vllm_refuses_the_plain_connector(plain) -> None:
    reference = _vllm_refuses_routed_experts(plain)
    vllm_config = _wrapper_config(plain)
    vllm_config.aux_output_config.enable_return_routed_experts = True
    check = name_keyed.check_start_up
    if reference is None:
        check(vllm_config, _inner(vllm_config), "backend", has_mamba=False, is_worker=False)
        return
    with pytest.raises(ValueError) as info:
        check(vllm_config, _inner(vllm_config), "backend", has_mamba=False, is_worker=False)
    assert reference in str(info.value)
    assert "Remove --enable-return-routed-experts" in str(info.value)


# ----------------------------------------------------------------- NIXL + DCP


def test_nixl_dcp_refused_as_vllm_refuses_plain_nixl() -> None:
    words = "PD with decode_context_parallel_size > 1 is only supported for MLA models"
    # vLLM asserts for NixlConnector by name (the tiny Llama is not MLA; pydantic
    # reports the assert as a ValidationError, a ValueError)...
    with pytest.raises(ValueError, match=words):
        make_vllm_config(kv_connector="NixlConnector", dcp_size=8)
    # ...not for the wrapper, which refuses with the same words.
    vllm_config = _wrapper_config(_nixl(), dcp_size=8)
    with pytest.raises(ValueError, match=words):
        KVTailConnector(
            vllm_config,
            KVConnectorRole.SCHEDULER,
            make_kv_cache_config(block_size=16, num_blocks=8),
        )
    # vLLM's rule is keyed on "NixlConnector" alone: a pull connector by its
    # own name is not checked, plain or wrapped.
    make_vllm_config(kv_connector="NixlPullConnector", dcp_size=8)
    pull = _wrapper_config(_nixl(name="NixlPullConnector"), dcp_size=8)
    name_keyed.check_start_up(pull, _inner(pull), "backend", has_mamba=False, is_worker=False)


# ------------------------------------------------------------------- HiSparse


@pytest.mark.parametrize(
    "plain",
    [
        {"kv_connector": "HiSparseConnector", "kv_role": "kv_both"},
        _multi({"kv_connector": "HiSparseConnector", "kv_role": "kv_both"}, _nixl()),
    ],
    ids=["hisparse", "multi_with_hisparse"],
)
def test_hisparse_inside_the_wrapper_is_refused(plain) -> None:
    # vLLM turns HiSparse on for the name (and then refuses it off CUDA)...
    with pytest.raises(ValueError, match="HiSparse"):
        make_vllm_config(
            kv_connector=plain["kv_connector"],
            kv_role=plain["kv_role"],
            kv_connector_extra_config=plain.get("kv_connector_extra_config"),
        )
    # ...but not behind the wrapper: HiSparse would silently stay off.
    vllm_config = _wrapper_config(plain)
    assert vllm_config.attention_config.hisparse_config is None
    with pytest.raises(ValueError, match="HiSparseConnector cannot run behind KVTailConnector"):
        name_keyed.check_start_up(
            vllm_config, _inner(vllm_config), "backend", has_mamba=False, is_worker=False
        )


# ------------------------------------------------------- SimpleCPUOffload (0.33)


def test_simple_cpu_offload_with_prefix_caching_refused_where_vllm_sizes_it_by_name() -> None:
    plain = {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both"}
    vllm_config = _wrapper_config(plain, enable_prefix_caching=True)

    def check(config: VllmConfig) -> None:
        name_keyed.check_start_up(
            config, _inner(config), "backend", has_mamba=False, is_worker=False
        )

    sized_by_name = any(r.key == "simple_cpu_offload" for r, _ in name_keyed.rules_for(RELEASE))
    if sized_by_name:  # 0.33: v1/engine/core.py
        with pytest.raises(ValueError, match="--no-enable-prefix-caching"):
            check(vllm_config)
    else:
        check(vllm_config)
    check(_wrapper_config(plain, enable_prefix_caching=False))


def _applies(key: str) -> bool:
    """Whether the installed release has the rule ``key`` (its sites in the table)."""
    return any(r.key == key for r, _ in name_keyed.rules_for(RELEASE))


def _start_scheduler_side(vllm_config: VllmConfig) -> KVTailConnector:
    return KVTailConnector(
        vllm_config, KVConnectorRole.SCHEDULER, make_kv_cache_config(block_size=16, num_blocks=8)
    )


# ------------------------------------------------- NIXL transfer mode (0.34)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_the_nixl_class_follows_transfer_mode_as_for_plain_nixl(mode) -> None:
    """0.34's factory turns NixlConnector into NixlPull/NixlPushConnector by
    ``transfer_mode`` (a comparison through a variable). The wrapper resolves
    its inner class with vLLM's factory and the inner config, so the same."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    plain = {**_nixl(), "kv_connector_extra_config": {"transfer_mode": mode}}
    want = KVConnectorFactory.get_connector_class(KVTransferConfig(**plain))
    if _applies("nixl_transfer_mode"):
        assert want.__name__ == f"Nixl{mode.capitalize()}Connector"
    wrapper = _start_scheduler_side(_wrapper_config(plain))
    try:
        assert type(wrapper.inner) is want
    finally:
        wrapper.shutdown()


# ------------------------------------------------ LMCacheMP cache access (0.34)


def test_lmcache_mp_cache_access_is_vllms_for_the_plain_connector(monkeypatch) -> None:
    """0.34's factory answers LEGACY_IPC for an LMCacheMPConnector by name whose
    class does not say (an older lmcache). The wrapper's kv_cache_access asks
    the factory with the inner config, so its answer is that one too."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    if not hasattr(KVConnectorFactory, "kv_cache_access"):
        pytest.skip("vLLM 0.32, 0.33: no kv_cache_access")
    # lmcache is not installed here: a class that answers nothing of its own,
    # as the lmcache package's older connector.
    older = type("LMCacheMPConnector", (KVConnectorBase_V1,), {})
    monkeypatch.setitem(KVConnectorFactory._registry, "LMCacheMPConnector", lambda: older)
    plain = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"}
    want = KVConnectorFactory.kv_cache_access(KVTransferConfig(**plain))
    assert want.name == "LEGACY_IPC"
    assert KVConnectorFactory.kv_cache_access(KVTransferConfig(**_wrapped(plain))) == want


# --------------------------------------------------- MultiConnector roles (0.34)


def _recording(role: str, **extra: Any) -> dict[str, Any]:
    from tests.helpers import recording

    return {
        "kv_connector": "RecordingConnector",
        "kv_connector_module_path": recording.MODULE_PATH,
        "kv_role": role,
        "kv_connector_extra_config": dict(extra),
    }


def _plain_config(fields: dict[str, Any]) -> VllmConfig:
    return make_vllm_config(
        kv_connector=fields["kv_connector"],
        kv_connector_module_path=fields.get("kv_connector_module_path"),
        kv_role=fields["kv_role"],
        kv_connector_extra_config=fields.get("kv_connector_extra_config"),
    )


def _deferred_block_free(vllm_config: VllmConfig) -> bool:
    """Whether vLLM's real scheduler defers block frees with two batches in
    flight (async scheduling): it does for a KV consumer."""
    vllm_config.scheduler_config.async_scheduling = True
    scheduler = make_scheduler(vllm_config)
    try:
        return bool(scheduler.defer_block_free)
    finally:
        scheduler.shutdown()


def _roles(vllm_config: VllmConfig) -> tuple[bool, bool]:
    ktc = vllm_config.kv_transfer_config
    return bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer)


def test_multiconnector_roles_as_vllm_takes_them_for_the_plain_connector() -> None:
    """A MultiConnector whose own kv_role says producer, of one consumer child.
    0.34 takes its roles from the child (a consumer: block frees deferred);
    behind the wrapper vLLM reads KVTailConnector's kv_role instead. The
    wrapper refuses, naming the kv_role that gives what the plain one gets."""
    plain_fields = _multi(_recording("kv_consumer"), role="kv_producer")
    plain = _plain_config(plain_fields)
    wrapped = _wrapper_config(plain_fields)
    if _roles(plain) == _roles(wrapped):  # 0.32, 0.33: the MultiConnector's own role
        assert not _applies("multi_roles")
        _start_scheduler_side(wrapped).shutdown()
        return
    assert _applies("multi_roles")
    assert _roles(plain) == (False, True)
    with pytest.raises(ValueError, match="Set kv_role to 'kv_consumer': the role its connectors"):
        _start_scheduler_side(wrapped)
    fixed = _wrapper_config(_multi(_recording("kv_consumer"), role="kv_consumer"))
    assert _roles(fixed) == _roles(plain)
    assert _deferred_block_free(fixed) == _deferred_block_free(plain) is True


# ---------------------------------------------- custom_mem_pool, extensible cache (0.34)


def _resolve_extensible_cache(vllm_config: VllmConfig) -> bool:
    """What vLLM's config resolution settles enable_extensible_kv_cache to,
    left unset by the user, on a CUDA platform."""
    cache = vllm_config.cache_config
    cache.enable_extensible_kv_cache = None  # type: ignore[assignment]
    cache._extensible_kv_cache_resolved = False
    vllm_config._resolve_extensible_kv_cache()
    return bool(cache.enable_extensible_kv_cache)


def test_custom_mem_pool_inside_refused_where_vllm_turns_the_extensible_cache_off(
    monkeypatch,
) -> None:
    plain_fields = _recording("kv_both", custom_mem_pool="NVLINK")
    plain, wrapped = _plain_config(plain_fields), _wrapper_config(plain_fields)

    def check() -> None:
        name_keyed.check_start_up(
            wrapped, _inner(wrapped), "backend", has_mamba=False, is_worker=False
        )

    if not hasattr(VllmConfig, "_resolve_extensible_kv_cache"):  # 0.32, 0.33
        assert not _applies("custom_mem_pool")
        check()
        return
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    # vLLM turns it off for the plain connector's custom_mem_pool, and does not
    # see the one inside the wrapper.
    assert _resolve_extensible_cache(plain) is False
    assert _resolve_extensible_cache(wrapped) is True
    with pytest.raises(ValueError, match="Pass --no-enable-extensible-kv-cache"):
        check()
    wrapped.cache_config.enable_extensible_kv_cache = False
    check()
