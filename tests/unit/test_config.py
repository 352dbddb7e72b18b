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
        (
            {"backend": "NixlConnector", "zero_tails": "yes"},
            ["kv_connector_extra_config.zero_tails", '"auto"', '"always"', '"off"'],
        ),
        (
            {"backend": "NixlConnector", "vouch_tails": True},
            ["kv_connector_extra_config.vouch_tails", '"auto"', '"trust"', '"off"'],
        ),
        # The config names the variable; a secret pasted in its place is refused.
        (
            {"backend": "NixlConnector", "entry_key_env": "s3cr3t key!"},
            ["kv_connector_extra_config.entry_key_env", "not an environment variable name"],
        ),
        (
            {"backend": "NixlConnector", "entry_key_env": 7},
            ["kv_connector_extra_config.entry_key_env", "environment variable"],
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
        # Booleans are strict: a string or a number is a mistake, not a yes.
        (
            {"backend": "NixlConnector", "probe_stale_tails": "yes"},
            ['kv_connector_extra_config.probe_stale_tails: got "yes"; expected true or false'],
        ),
        (
            {"backend": "NixlConnector", "probe_stale_tails": "false"},
            ['kv_connector_extra_config.probe_stale_tails: got "false"'],
        ),
        (
            {"backend": "NixlConnector", "probe_stale_tails": 1},
            ["kv_connector_extra_config.probe_stale_tails: got 1"],
        ),
        ({"backend": 3}, ["kv_connector_extra_config.backend: got 3; expected the connector"]),
        (
            {"backend": "NixlConnector", "backend_module_path": " "},
            ["backend_module_path", "blank"],
        ),
        (
            {"backend": "NixlConnector", "backend_extra_config": [1]},
            ["kv_connector_extra_config.backend_extra_config", "JSON object"],
        ),
        (
            {"backend": "NixlConnector", "verify_kv": "sample", "verify_kv_every": 0},
            ["kv_connector_extra_config.verify_kv_every", "an integer from 1 to 1024"],
        ),
        (
            {"backend": "NixlConnector", "verify_kv_every": "32"},
            ['kv_connector_extra_config.verify_kv_every: got "32"', "an integer from 1 to 1024"],
        ),
        ("oops", ["kv_connector_extra_config: expected a JSON object"]),
    ],
)
def test_errors_name_the_field_and_the_fix(extra, fragments):
    with pytest.raises(ValueError) as info:
        KVTailConfig.from_extra_config(extra)
    for fragment in fragments:
        assert fragment in str(info.value)
    # Written for a person: none of pydantic's own phrasing leaks through.
    for leak in ("Value error,", "Input should be", "String should", "type=", "pydantic"):
        assert leak not in str(info.value)


def test_booleans_are_strict_json_booleans():
    for value in (True, False):
        extra = {"backend": "NixlConnector", "probe_stale_tails": value}
        assert KVTailConfig.from_extra_config(extra).probe_stale_tails is value


def test_stray_spaces_around_names_are_stripped():
    cfg = KVTailConfig.from_extra_config(
        {"backend": " NixlConnector\t", "backend_module_path": " my.connectors  "}
    )
    assert cfg.backend == "NixlConnector" and cfg.backend_module_path == "my.connectors"


def test_several_problems_reported_at_once():
    with pytest.raises(ValueError) as info:
        KVTailConfig.from_extra_config({"zero_tails": "x", "bogus": 1})
    text = str(info.value)
    assert "backend: required" in text and "zero_tails" in text and "bogus" in text
