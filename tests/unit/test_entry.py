"""The ``kvtail`` entry of ``kv_transfer_params``: build, read, refuse what is not v1."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvtail_connector import entry


def _spec(block_size=16, dtype="torch.bfloat16", head_size=128, kind="FullAttentionSpec"):
    cls = type(kind, (), {})
    spec = cls()
    spec.block_size, spec.dtype, spec.head_size = block_size, dtype, head_size
    return spec


def _entry(**kw) -> entry.Entry:
    return entry.Entry(
        num_tokens=kw.get("n", 45),
        geometry=entry.geometry([_spec()], dcp=1, interleave=1),
        tail_zero=kw.get("tail", True),
    )


def test_round_trip_through_json_and_unknown_keys_are_ignored():
    e = _entry()
    wire = json.loads(json.dumps({"do_remote_prefill": True, entry.KEY: e.to_json()}))
    wire[entry.KEY]["future_key"] = {"anything": 1}  # added later within v1
    wire[entry.KEY]["geom"]["future"] = 3
    assert entry.read(wire) == (e, "ok")


def test_the_geometry_depends_on_what_names_the_same_slots():
    base = entry.geometry([_spec()], 1, 1)
    assert base == entry.geometry([_spec()], 1, 1)
    assert base != entry.geometry([_spec(block_size=32)], 1, 1)
    assert base != entry.geometry([_spec(dtype="torch.float8_e4m3fn")], 1, 1)
    assert base != entry.geometry([_spec(head_size=64)], 1, 1)
    assert base != entry.geometry([_spec(kind="MLAAttentionSpec")], 1, 1)
    assert base != entry.geometry([_spec()], 2, 1)
    assert base != entry.geometry([_spec()], 1, 16)
    assert base != entry.geometry([_spec(), _spec()], 1, 1)


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        (None, "absent"),
        ({}, "absent"),
        ({entry.KEY: "zero"}, "malformed"),
        ({entry.KEY: {"v": 2, "n": 1}}, "unknown version"),
        ({entry.KEY: {"v": "1", "n": 1}}, "unknown version"),
        ({entry.KEY: {"v": True, "n": 1}}, "unknown version"),
        ({entry.KEY: {"v": 1, "n": 45}}, "malformed"),
        (
            {entry.KEY: {"v": 1, "n": -1, "geom": {"bs": [16], "dcp": 1, "ilv": 1, "sig": ""}}},
            "malformed",
        ),
        (
            {entry.KEY: {"v": 1, "n": 4.5, "geom": {"bs": [16], "dcp": 1, "ilv": 1, "sig": ""}}},
            "malformed",
        ),
        (
            {entry.KEY: {"v": 1, "n": 4, "geom": {"bs": 16, "dcp": 1, "ilv": 1, "sig": ""}}},
            "malformed",
        ),
    ],
)
def test_anything_but_a_well_formed_v1_entry_reads_as_no_entry(params, reason):
    assert entry.read(params) == (None, reason)


def test_an_entry_without_the_tail_claim_claims_nothing():
    e = _entry(tail=False)
    assert "tail" not in e.to_json()
    parsed, _ = entry.read({entry.KEY: e.to_json()})
    assert parsed is not None and not parsed.tail_zero


def test_reading_never_raises_on_hostile_params():
    for raw in ([], 3, {"v": 1, "n": 1, "geom": None}, {"v": 1, "geom": {"bs": [None]}}):
        assert entry.read({entry.KEY: raw})[0] is None
    assert entry.read(SimpleNamespace())[0] is None  # type: ignore[arg-type]


def _digested(**dg) -> dict:
    sums = {0: {0: (1, 2**64 - 1), 3: (0, 5)}, 2: {1: (7, 8)}}
    e = entry.Entry(45, _entry().geometry, True, entry.Digest("mix64-1", 1024, "ab" * 8, sums))
    wire = json.loads(json.dumps(e.to_json()))
    wire["dg"].update(dg)
    return wire


def test_a_digest_round_trips_with_hex_sums_and_every_u64():
    wire = _digested()
    assert wire["dg"]["g"]["0"]["0"] == ["0000000000000001", "ffffffffffffffff"]
    found, why = entry.read({entry.KEY: wire})
    assert why == "ok" and found is not None and found.digest is not None
    assert found.digest.sums == {0: {0: (1, 2**64 - 1), 3: (0, 5)}, 2: {1: (7, 8)}}
    assert (found.digest.algorithm, found.digest.segment) == ("mix64-1", 1024)
    assert entry.read({entry.KEY: _entry().to_json()})[0].digest is None  # no dg


@pytest.mark.parametrize(
    "dg",
    [
        {"seg": 1000},  # not a power of two
        {"seg": 128},  # below 256
        {"seg": True},
        {"alg": 1},
        {"g": []},
        {"g": {"0": {"0": [1]}}},  # a number, not hex
        {"g": {"0": {"0": ["0x00000000000001"]}}},  # prefix
        {"g": {"0": {"0": ["+000000000000001"]}}},
        {"g": {"0": {"0": ["000000000000001"]}}},  # 15 digits
        {"g": {"x": {"0": ["0000000000000001"]}}},
        {"g": {"0": {"-1": ["0000000000000001"]}}},
        {"g": {"0": {"0": ["0000000000000001"] * 33}}},  # more than 32 segments
        {"g": {"0": "sums"}},
    ],
)
def test_a_malformed_digest_is_ignored_and_the_rest_of_the_entry_kept(dg):
    found, why = entry.read({entry.KEY: _digested(**dg)})
    assert why == "ok" and found is not None
    assert found.digest is None and found.tail_zero and found.num_tokens == 45
    wire = _digested()
    wire["dg"] = "digest"
    assert entry.read({entry.KEY: wire})[0].digest is None


@pytest.mark.parametrize(
    ("n", "segment"), [(1, 1024), (32 * 1024, 1024), (32 * 1024 + 1, 2048), (10**6, 32768)]
)
def test_segments_are_1024_tokens_or_fewer_than_33(n, segment):
    assert entry.segment_for(n) == segment
