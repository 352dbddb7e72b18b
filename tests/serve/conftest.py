"""The servers of the serving tests, started once per session.

A single-engine reference server, a plain NIXL pair and a pair with
``KVTailConnector`` around NIXL whose prefill server (``vouch_tails: trust``,
so it vouches for its tails) feeds two decode servers (``vouch_tails: auto``,
so they check each claim and zero anyway), one per ``kv_load_failure_policy``
(recompute, fail). All start at once (their
imports overlap) and are stopped at the end of the session, or as soon as one
fails to start; the plain pair is stopped once its tests are done.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from demo.api_server import APIServer
from demo.serving import Fleet, ServePair
from demo.tiny_model import ensure_tiny_llama
from tests.e2e.support import require


@dataclass
class Servers:
    fleet: Fleet
    reference: APIServer
    plain: ServePair
    wrapped: ServePair


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    require("nixl._api")
    model = str(ensure_tiny_llama())
    fleet = Fleet(tmp_path_factory.mktemp("serve-logs"))
    reference = fleet.add_reference(model)
    plain = fleet.add_pair("plain", model, wrapped=False)
    # P vouches for its tails (trust); D checks each claim and zeroes anyway (auto).
    # verify_kv stays at its default ("sample"); the soak may ask P to digest
    # more (KVTAIL_SOAK_VERIFY_EVERY=1: every request), to look for false alarms.
    producer: dict[str, object] = {"vouch_tails": "trust"}
    every = os.environ.get("KVTAIL_SOAK_VERIFY_EVERY")
    if every:
        producer["verify_kv_every"] = int(every)
    # KVTAIL_SOAK_PREFIX_CACHING=1: the wrapped pair caches prefixes (off
    # elsewhere, so that the connector, not a local hit, answers).
    caching = os.environ.get("KVTAIL_SOAK_PREFIX_CACHING") == "1"
    wrapped = fleet.add_pair(
        "wrapped",
        model,
        wrapped=True,
        policies=("recompute", "fail"),
        producer_options=producer,
        spec={"args": ["--enable-prefix-caching"]} if caching else None,
    )
    with fleet.start():
        yield Servers(fleet, reference, plain, wrapped)
