"""The vllm.general_plugins entry point registers KVTailConnector once, or refuses."""

from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402

from kvtail_connector import _compat, plugin  # noqa: E402
from kvtail_connector.connector import KVTailConnector  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.scheduler]


def test_entry_point_is_installed():
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvtail"]
    assert ep.value == "kvtail_connector.plugin:register"
    assert ep.load() is plugin.register


def test_register_is_idempotent_and_lazy():
    plugin.register()
    plugin.register()  # vLLM runs general plugins in every process
    assert KVConnectorFactory.get_connector_class_by_name("KVTailConnector") is KVTailConnector


def test_unsupported_vllm_is_refused_with_one_message(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(_compat.UnsupportedVLLMError, match=r"supports vLLM 0\.32\.x and 0\.33\.x"):
        plugin.register()
    monkeypatch.setattr(vllm, "__version__", "1.0.0")
    with pytest.raises(_compat.UnsupportedVLLMError, match="found vLLM 1.0.0"):
        _compat.check_vllm_version()


def test_import_works_without_vllm_internals():
    # The top-level package imports the connector lazily (vLLM resolves it
    # with getattr(module, "KVTailConnector")).
    import kvtail_connector

    assert kvtail_connector.KVTailConnector is KVTailConnector
    with pytest.raises(AttributeError):
        kvtail_connector.NoSuchThing  # noqa: B018
