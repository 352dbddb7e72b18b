"""What each adapter says about producer claims (no vLLM needed: adapters are
plain classes chosen by class name)."""

from __future__ import annotations

import pytest

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
    assert adapter.carries_producer_tail is carries
