"""The one factory of wrapped ``kv_transfer_config`` dicts (tests, demo, users)."""

from __future__ import annotations

from kvtail_connector.config import KVTailConfig
from kvtail_connector.facade.inner import wrap_kv_transfer_config, wrapper_fields


def test_wrapping_moves_the_connector_into_the_extra_config_and_keeps_the_rest():
    plain = {
        "kv_connector": "MyConnector",
        "kv_connector_module_path": "my.connectors",
        "kv_connector_extra_config": {"port": 7},
        "kv_role": "kv_consumer",
        "kv_buffer_device": "cpu",
    }
    wrapped = wrap_kv_transfer_config(plain, zero_tails="always")
    assert wrapped == {
        "kv_role": "kv_consumer",
        "kv_buffer_device": "cpu",
        "kv_connector": "KVTailConnector",
        "kv_connector_module_path": "kvtail_connector",
        "kv_connector_extra_config": {
            "backend": "MyConnector",
            "backend_module_path": "my.connectors",
            "backend_extra_config": {"port": 7},
            "zero_tails": "always",
        },
    }
    assert plain["kv_connector"] == "MyConnector"  # the caller's dict is untouched
    cfg = KVTailConfig.from_extra_config(wrapped["kv_connector_extra_config"])
    assert (cfg.backend, cfg.backend_module_path) == ("MyConnector", "my.connectors")


def test_a_registered_connector_without_extra_config_gets_only_its_name():
    wrapped = wrap_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    assert wrapped["kv_connector_extra_config"] == {"backend": "NixlConnector"}


def test_wrapper_fields_copy_the_extra_config():
    extra = {"backend": "NixlConnector"}
    fields = wrapper_fields(extra)
    fields["kv_connector_extra_config"]["zero_tails"] = "off"
    assert extra == {"backend": "NixlConnector"}
