"""KVTailConfig: parsed once, frozen, and every error names the field and the fix."""

import pytest

from kvtail_connector.config import KVTailConfig


def test_defaults_and_passthrough():
    extra = {"backend": "NixlConnector", "backend_extra_config": {"backends": ["UCX"]}}
    cfg = KVTailConfig.from_extra_config(extra)
    assert cfg.backend == "NixlConnector"
    assert cfg.backend_module_path is None
    assert cfg.backend_extra_config == {"backends": ["UCX"]}
    assert cfg.zero_tails == "auto" and cfg.probe_stale_tails is False


def test_frozen_and_user_dict_untouched():
    extra = {"backend": "NixlConnector", "zero_tails": "always"}
    snapshot = dict(extra)
    cfg = KVTailConfig.from_extra_config(extra)
    assert extra == snapshot
    with pytest.raises(Exception, match="frozen"):
        cfg.zero_tails = "off"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        ({}, ["kv_connector_extra_config.backend: required", "NixlConnector"]),
        (None, ["kv_connector_extra_config.backend: required"]),
        ({"backend": ""}, ["kv_connector_extra_config.backend"]),
        ({"backend": "  "}, ["kv_connector_extra_config.backend", "blank"]),
        ({"backend": "KVTailConnector"}, ["cannot wrap itself"]),
        (
            {"backend": "NixlConnector", "zero_tails": "yes"},
            ["kv_connector_extra_config.zero_tails", '"auto"', '"always"', '"off"'],
        ),
        (
            {"backend": "NixlConnector", "zero_tail": "auto"},
            ["kv_connector_extra_config.zero_tail: unknown field", "zero_tails"],
        ),
        (
            {"backend": "NixlConnector", "read_mode": "true"},
            ["kv_connector_extra_config.read_mode: unknown field", "backend_extra_config"],
        ),
        (
            {"backend": "NixlConnector", "probe_stale_tails": "maybe"},
            ["kv_connector_extra_config.probe_stale_tails", "true or false"],
        ),
        (
            {"backend": "NixlConnector", "backend_extra_config": [1]},
            ["kv_connector_extra_config.backend_extra_config", "JSON object"],
        ),
        ("oops", ["kv_connector_extra_config: expected a JSON object"]),
    ],
)
def test_errors_name_the_field_and_the_fix(extra, fragments):
    with pytest.raises(ValueError) as info:
        KVTailConfig.from_extra_config(extra)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_several_problems_reported_at_once():
    with pytest.raises(ValueError) as info:
        KVTailConfig.from_extra_config({"zero_tails": "x", "bogus": 1})
    text = str(info.value)
    assert "backend: required" in text and "zero_tails" in text and "bogus" in text
