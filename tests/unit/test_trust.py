"""What binds an entry to its transfer, the shared key and its MAC."""

from __future__ import annotations

import pytest

from kvtail_connector.extras import entry, entry_values, trust

NIXL = {
    "do_remote_prefill": True,
    "remote_block_ids": [[3, 4, 5]],
    "remote_engine_id": "p-engine",
    "remote_request_id": "cmpl-1",
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
}
MORIIO = {
    "remote_block_ids": [[3, 4, 5]],
    "remote_engine_id": "10.0.0.1:6301",
    "transfer_id": "xfer-1",
    "remote_host": "10.0.0.1",
}


@pytest.mark.parametrize("params", [NIXL, MORIIO], ids=["nixl", "moriio"])
def test_the_binding_covers_the_transfers_identity_and_nothing_else(params):
    bound = trust.binding(params, 100)
    assert bound is not None and len(bound) == 32
    # Tuples (P's own params) and lists (after JSON) bind alike.
    assert trust.binding({**params, "remote_block_ids": ((3, 4, 5),)}, 100) == bound
    # Routing details are not identity: a router may rewrite them.
    assert trust.binding({**params, "remote_host": "elsewhere", "x": 1}, 100) == bound
    for key, value in (
        ("remote_engine_id", "other"),
        ("remote_block_ids", [[3, 4, 6]]),
        ("remote_request_id" if "remote_request_id" in params else "transfer_id", "other"),
    ):
        assert trust.binding({**params, key: value}, 100) != bound


def test_no_binding_without_a_request_or_transfer_id_or_past_the_bound():
    assert trust.binding({"remote_block_ids": [[1]], "remote_engine_id": "e"}, 100) is None
    assert trust.binding({**NIXL, "remote_block_ids": [list(range(200))]}, 100) is None
    assert trust.binding({**NIXL, "remote_request_id": object()}, 100) is None


def test_the_mac_covers_every_key_but_itself():
    key = b"k" * 32
    wire = entry.Entry(
        45, entry_values.Geometry((16,), 1, 1, "ab" * 8), True, binding="c" * 32
    ).to_json()
    wire["mac"] = trust.sign(key, wire)
    assert trust.verifies(key, wire)
    assert not trust.verifies(b"other", wire)
    for field, value in (("n", 44), ("bind", "d" * 32), ("pv", "9.9.9"), ("later", 1)):
        assert not trust.verifies(key, {**wire, field: value})
    assert not trust.verifies(key, {k: v for k, v in wire.items() if k != "mac"})
    assert not trust.verifies(key, {**wire, "mac": 7})
    assert not trust.verifies(key, {**wire, "mac": "é" * 64})


def test_the_key_comes_from_the_named_variable_and_is_refused_when_unset(monkeypatch):
    assert trust.key_from_env(None) is None
    monkeypatch.setenv("KVTAIL_K", "secret")
    assert trust.key_from_env("KVTAIL_K") == b"secret"
    monkeypatch.setenv("KVTAIL_K", "")
    with pytest.raises(ValueError, match="entry_key_env: names the environment variable KVTAIL_K"):
        trust.key_from_env("KVTAIL_K")
    monkeypatch.delenv("KVTAIL_K")
    with pytest.raises(ValueError, match="not set"):
        trust.key_from_env("KVTAIL_K")
