"""The vllm.general_plugins entry point registers KVTailConnector and never breaks vLLM.

vLLM runs general plugins without a try in every process (EngineArgs among
others), so an unsupported vLLM only gets a warning from the plugin; the
refusal comes from KVTailConnector itself, in an engine that asked for it.
"""

import logging
from importlib.metadata import entry_points

import pytest
import vllm
import vllm.plugins
from prometheus_client import CollectorRegistry
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs

from kvtail_connector import _compat, plugin
from kvtail_connector.facade.connector import KVTailConnector
from kvtail_connector.facade.inner import wrapper_fields
from kvtail_connector.log import PARENT
from tests.helpers.vllm_factories import (
    make_kv_cache_config,
    make_vllm_config,
    tiny_model_dir,
)
from tests.scheduler.test_observability import registry_metric_types

UNSUPPORTED = ["0.35.0", "0.31.2", "1.0.0", "0.1.dev5+g1a2b3c4", "dev"]


@pytest.fixture
def kvtail_warnings(caplog):
    """WARNING messages of the kvtail loggers, each record once (vLLM's ``vllm``
    logger may or may not propagate to the root, where caplog listens too)."""
    parent = logging.getLogger(PARENT)
    parent.addHandler(caplog.handler)

    def messages():
        records = {id(r): r for r in caplog.records if r.name.startswith(PARENT)}
        return [r.getMessage() for r in records.values() if r.levelno >= logging.WARNING]

    try:
        with caplog.at_level(logging.WARNING, logger=PARENT):
            yield messages
    finally:
        parent.removeHandler(caplog.handler)


@pytest.fixture
def fresh_plugin_state(monkeypatch):
    """A process where neither the plugin has warned nor vLLM has loaded plugins."""
    monkeypatch.setattr(plugin, "_warned", False)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    registry = {k: v for k, v in KVConnectorFactory._registry.items() if k != "KVTailConnector"}
    monkeypatch.setattr(KVConnectorFactory, "_registry", registry)


def test_entry_point_is_installed():
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvtail"]
    assert ep.value == "kvtail_connector.plugin:register"
    assert ep.load() is plugin.register


def test_register_is_idempotent_and_lazy():
    plugin.register()
    plugin.register()  # vLLM runs general plugins in every process
    assert KVConnectorFactory.get_connector_class_by_name("KVTailConnector") is KVTailConnector


@pytest.mark.parametrize("version", UNSUPPORTED)
def test_unsupported_vllm_registers_and_warns_once(
    version, monkeypatch, fresh_plugin_state, kvtail_warnings
):
    monkeypatch.setattr(vllm, "__version__", version)
    plugin.register()
    plugin.register()
    assert "KVTailConnector" in KVConnectorFactory._registry
    (warning,) = kvtail_warnings()
    assert "vLLM 0.32.x, 0.33.x and 0.34.x" in warning and f"installed vLLM is {version}" in warning


@pytest.mark.parametrize(
    "version", ["0.32.0", "0.33.1", "0.33.0rc1", "0.32.1.dev3+gabc", "0.34.0", "0.34.2"]
)
def test_supported_vllm_registers_silently(
    version, monkeypatch, fresh_plugin_state, kvtail_warnings
):
    monkeypatch.setattr(vllm, "__version__", version)
    plugin.register()
    assert "KVTailConnector" in KVConnectorFactory._registry
    assert kvtail_warnings() == []


def test_plain_engine_args_survive_an_unsupported_vllm(
    monkeypatch, fresh_plugin_state, kvtail_warnings
):
    # vLLM loads general plugins from EngineArgs.__post_init__, without a try.
    monkeypatch.setenv("VLLM_PLUGINS", "kvtail")
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    EngineArgs(model=tiny_model_dir(), skip_tokenizer_init=True)
    assert vllm.plugins.plugins_loaded
    assert "KVTailConnector" in KVConnectorFactory._registry  # the plugin did run
    assert any("installed vLLM is 0.35.0" in w for w in kvtail_warnings())


def test_the_connector_refuses_an_unsupported_vllm_with_one_message(monkeypatch):
    vllm_config = make_vllm_config(
        **wrapper_fields({"backend": "NixlConnector"}),
    )
    ktc = vllm_config.kv_transfer_config
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    expected = r"supports vLLM 0\.32\.x, 0\.33\.x and 0\.34\.x; the installed vLLM is 0\.35\.0"
    with pytest.raises(_compat.UnsupportedVLLMError, match=expected):
        KVTailConnector(
            vllm_config,
            KVConnectorRole.SCHEDULER,
            make_kv_cache_config(block_size=16, num_blocks=8),
        )
    # The classmethods vLLM asks before it builds the connector refuse the same way.
    for ask in (
        lambda: KVTailConnector.requires_piecewise_for_cudagraph(ktc.kv_connector_extra_config),
        lambda: KVTailConnector.get_required_kvcache_layout(vllm_config),
        lambda: KVTailConnector.supports_sleep_mode(ktc),
        lambda: KVTailConnector.build_prom_metrics(
            vllm_config, registry_metric_types(CollectorRegistry()), ["engine"], {0: ["0"]}
        ),
    ):
        with pytest.raises(_compat.UnsupportedVLLMError, match=expected):
            ask()


def test_import_works_without_vllm_internals():
    # The top-level package imports the connector lazily (vLLM resolves it
    # with getattr(module, "KVTailConnector")).
    import kvtail_connector

    assert kvtail_connector.KVTailConnector is KVTailConnector
    with pytest.raises(AttributeError):
        kvtail_connector.NoSuchThing  # noqa: B018
