"""What each adapter says about producer claims (adapters are plain classes
chosen by class name; the NIXL one asks vLLM's platform)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtail_connector import _compat
from kvtail_connector.connectors import InnerAdapter, MultiConnectorAdapter
from kvtail_connector.connectors.mooncake_store import MooncakeStoreAdapter
from kvtail_connector.connectors.moriio import MoRIIOAdapter
from kvtail_connector.connectors.nixl import NixlAdapter


@pytest.mark.parametrize(
    ("adapter", "carries"),
    [
        (NixlAdapter({}), True),  # the consumer pulls whole blocks after it has the params
        (MoRIIOAdapter({"read_mode": "true"}), True),  # READ: the same
        (MoRIIOAdapter({"read_mode": "false"}), False),  # WRITE: written during P's forward
        (MooncakeStoreAdapter({}), False),  # a store: no per-request params, any producer
        (InnerAdapter({}), False),  # unknown connectors: no claim
        (MultiConnectorAdapter({}, [("0", NixlAdapter({}))]), False),  # not per child yet
    ],
    ids=["nixl", "moriio-read", "moriio-write", "mooncake-store", "default", "multi"],
)
def test_claims_are_made_and_trusted_only_over_transfers_that_carry_the_tail(adapter, carries):
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_buffer_device="cuda"))
    assert adapter.carries_producer_tail(config) is carries


@pytest.mark.parametrize(
    ("cpu_platform", "buffer", "carries"),
    [(False, "cuda", True), (False, "cpu", False), (True, "cpu", True)],
    ids=["gpu-kv", "gpu-host-buffer", "cpu-engine"],
)
def test_nixl_with_a_host_buffer_carries_no_claim(monkeypatch, cpu_platform, buffer, carries):
    # A host buffer copies each block to the host in the step it is allocated:
    # a chunked prompt's last block may leave before the step that zeroes it.
    # vLLM uses no host buffer on its CPU platform, whatever kv_buffer_device says.
    monkeypatch.setattr(_compat, "platform_is_cpu", lambda: cpu_platform)
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_buffer_device=buffer))
    assert NixlAdapter({}).carries_producer_tail(config) is carries
