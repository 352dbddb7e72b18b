"""The ``kvtail`` entry of ``kv_transfer_params``: one strict, bounded model.

Hostile values by name, then property-based: whatever JSON-like value arrives,
:func:`entry.read` returns a reading and never raises, and the size walk that
runs before any parse visits at most ``Limits.max_nodes + 1`` values (counted
by containers that count what is taken out of them, not timed)."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtail_connector._version import __version__
from kvtail_connector.extras import entry, entry_values

LIMITS = entry_values.Limits(max_tokens=4096, num_groups=3, num_kv_heads=4)
BIND = "0123456789abcdef" * 2


def _spec(block_size=16, dtype="torch.bfloat16", head_size=128, kind="FullAttentionSpec"):
    cls = type(kind, (), {})
    spec = cls()
    spec.block_size, spec.dtype, spec.head_size = block_size, dtype, head_size
    return spec


def _entry(
    n: int = 45, tail: bool = True, digest: entry_values.Digest | None = None
) -> entry.Entry:
    return entry.Entry(
        num_tokens=n,
        geometry=entry_values.geometry([_spec()], dcp=1, interleave=1),
        tail_zero=tail,
        digest=digest,
        binding=BIND,
    )


def _wire(e: entry.Entry) -> dict[str, Any]:
    return json.loads(json.dumps(e.to_json()))


def _read(raw: Any, digest: bool = True) -> entry.Reading:
    return entry.read({entry.KEY: raw}, LIMITS, digest=digest)


def test_round_trip_through_json_and_unknown_keys_are_ignored():
    e = _entry()
    wire = _wire(e)
    assert wire["v"] == entry.VERSION == 2 and wire["pv"] == __version__ == "0.2.0"
    wire["future_key"] = {"anything": 1}  # added later within v2
    wire["geom"]["future"] = 3
    reading = _read(wire)
    assert (reading.entry, reading.why) == (e, "ok")
    assert reading.raw is wire


def test_the_geometry_depends_on_what_names_the_same_slots():
    base = entry_values.geometry([_spec()], 1, 1)
    assert base == entry_values.geometry([_spec()], 1, 1)
    assert base != entry_values.geometry([_spec(block_size=32)], 1, 1)
    assert base != entry_values.geometry([_spec(dtype="torch.float8_e4m3fn")], 1, 1)
    assert base != entry_values.geometry([_spec(head_size=64)], 1, 1)
    assert base != entry_values.geometry([_spec(kind="MLAAttentionSpec")], 1, 1)
    assert base != entry_values.geometry([_spec()], 2, 1)
    assert base != entry_values.geometry([_spec()], 1, 16)
    assert base != entry_values.geometry([_spec(), _spec()], 1, 1)


def _edited(path: tuple[Any, ...], value: Any, base: dict[str, Any] | None = None) -> Any:
    out = copy.deepcopy(base if base is not None else _wire(_entry()))
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


DEEP: Any = []
for _ in range(10_000):
    DEEP = [DEEP]


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("zero", "malformed"),
        ([], "malformed"),
        ({"v": 3, "n": 1}, "unknown version"),
        ({"v": "2", "n": 1}, "unknown version"),
        ({"v": True, "n": 1}, "unknown version"),  # a bool is not the integer 1
        ({"v": 2.0, "n": 1}, "unknown version"),
        ({"v": 2**63, "n": 1}, "unknown version"),
        ({"v": 1, "n": 45, "geom": {}, "tail": "zero"}, "known-wrong producer 0.1.0"),
        (_edited(("pv",), "0.1.0"), "known-wrong producer 0.1.0"),
        (_edited(("pv",), 2), "malformed"),
        (_edited(("pv",), "x" * 33), "malformed"),
        (_edited(("n",), -1), "malformed"),
        (_edited(("n",), 0), "malformed"),
        (_edited(("n",), 4.5), "malformed"),
        (_edited(("n",), 45.0), "malformed"),
        (_edited(("n",), True), "malformed"),
        (_edited(("n",), "45"), "malformed"),
        (_edited(("n",), 2**63), "malformed"),
        (_edited(("n",), 2**200), "too large"),  # past 64 bits: refused by the walk
        (_edited(("n",), LIMITS.max_tokens + 1), "malformed"),  # longer than D's max_model_len
        (_edited(("geom", "bs"), 16), "malformed"),
        (_edited(("geom", "bs"), [True]), "malformed"),
        (_edited(("geom", "bs"), [16] * 4), "malformed"),  # more groups than D has
        (_edited(("geom", "dcp"), 0), "malformed"),
        (_edited(("geom", "sig"), ""), "malformed"),
        (_edited(("geom", "sig"), 12), "malformed"),
        (_edited(("geom",), None), "malformed"),
        (_edited(("bind",), "xyz"), "malformed"),
        (_edited(("bind",), 7), "malformed"),
        (_edited(("mac",), "0" * 63), "malformed"),
        (_edited(("tail",), ["zero"]), "malformed"),
        (_edited(("extra",), "x" * (6 << 20)), "too large"),  # one 6 MiB string
        (_edited(("extra",), list(range(1 << 20))), "too large"),
        (_edited(("extra",), DEEP), "too large"),
        (_edited(("extra",), {str(i): i for i in range(1 << 16)}), "too large"),
        (_edited(("extra",), object()), "too large"),  # not JSON at all
    ],
)
def test_anything_outside_the_model_reads_as_no_entry_with_a_reason(raw, why):
    reading = _read(raw)
    assert (reading.entry, reading.why) == (None, why)


def test_absent_and_non_mapping_params():
    assert entry.read(None).why == "absent"
    assert entry.read({}).why == "absent"
    assert entry.read(SimpleNamespace()).why == "absent"  # type: ignore[arg-type]


def test_an_entry_without_the_tail_claim_claims_nothing():
    wire = _wire(_entry(tail=False))
    assert "tail" not in wire
    found = _read(wire).entry
    assert found is not None and not found.tail_zero
    assert _read(_edited(("tail",), "maybe")).entry.tail_zero is False  # type: ignore[union-attr]


def _digested(n: int = 45, **dg: Any) -> dict[str, Any]:
    rows = -(-n // entry_values.segment_for(n))
    sums = {0: {0: (1,) * (rows - 1) + (2**64 - 1,), 3: (5,) * rows}, 2: {1: (7,) * rows}}
    digest = entry_values.Digest("mix64-1", entry_values.segment_for(n), "ab" * 8, sums)
    wire = _wire(_entry(n, digest=digest))
    wire["dg"].update(dg)
    return wire


def test_a_digest_round_trips_with_hex_sums_and_every_u64():
    wire = _digested()
    assert wire["dg"]["g"]["0"]["0"] == ["ffffffffffffffff"]
    reading = _read(wire)
    assert reading.why == "ok" and reading.digest_why == "ok"
    assert reading.entry.digest.sums == {0: {0: (2**64 - 1,), 3: (5,)}, 2: {1: (7,)}}
    long = _read(_digested(n=3000))
    assert long.entry.digest.sums[0][0] == (1, 1, 2**64 - 1)
    assert _read(_wire(_entry())).digest_why == "absent"


def test_the_digest_is_read_only_when_asked_for():
    reading = _read(_digested(), digest=False)
    assert reading.why == "ok" and reading.digest_why == "not read"
    assert reading.entry.digest is None


@pytest.mark.parametrize(
    "dg",
    [
        {"seg": 2**63},  # the engine killer: a power of two, a valid u64
        {"seg": 2048},  # a power of two, but not the segment P must choose for n
        {"seg": 1000},
        {"seg": 128},
        {"seg": True},
        {"seg": 1024.0},
        {"alg": 1},
        {"alg": ""},
        {"sig": "AB" * 8},
        {"g": []},
        {"g": {"0": {"0": [1]}}},  # a number, not hex
        {"g": {"0": {"0": ["0x00000000000001"]}}},
        {"g": {"0": {"0": ["+000000000000001"]}}},
        {"g": {"0": {"0": ["000000000000001"]}}},  # 15 digits
        {"g": {"x": {"0": ["0000000000000001"]}}},
        {"g": {"0": {"-1": ["0000000000000001"]}}},
        {"g": {"3": {"0": ["0000000000000001"]}}},  # a group D does not have
        {"g": {"0": {"4": ["0000000000000001"]}}},  # a KV head D does not have
        {"g": {"0": {"0": ["0000000000000001"] * 2}}},  # not ceil(n / seg) segments
        {"g": {"0": {"0": []}}},
        {"g": {"0": "sums"}},
        {"g": {"0" * 10: {"0": ["0000000000000001"]}}},
    ],
)
def test_a_digest_outside_the_model_is_ignored_and_the_rest_of_the_entry_kept(dg):
    reading = _read(_digested(**dg))
    assert reading.why == "ok" and reading.digest_why == "malformed"
    found = reading.entry
    assert found is not None and found.digest is None
    assert found.tail_zero and found.num_tokens == 45 and found.binding == BIND
    wire = _digested()
    wire["dg"] = "digest"
    assert _read(wire).digest_why == "malformed"


@pytest.mark.parametrize(
    ("n", "segment"), [(1, 1024), (32 * 1024, 1024), (32 * 1024 + 1, 2048), (10**6, 32768)]
)
def test_segments_are_1024_tokens_or_fewer_than_33(n, segment):
    assert entry_values.segment_for(n) == segment


def test_the_largest_clean_entry_fits_the_walk_and_one_more_head_row_does_not_matter():
    # Every group and head of D, every segment of the longest prompt: a clean entry.
    n = LIMITS.max_tokens
    rows = -(-n // entry_values.segment_for(n))
    sums = {
        g: {h: (g + h,) * rows for h in range(LIMITS.num_kv_heads)}
        for g in range(LIMITS.num_groups)
    }
    digest = entry_values.Digest("mix64-1", entry_values.segment_for(n), "ab" * 8, sums)
    e = entry.Entry(
        n,
        entry_values.Geometry((16, 16, 16), 1, 1, "cd" * 8),
        True,
        digest,
        binding=BIND,
        mac="e" * 64,
    )
    wire = _wire(e)
    assert entry.measure(wire, LIMITS.max_nodes) is not None
    assert _read(wire).entry == e
    # Padding far past the slack is refused before any parse.
    wire["pad"] = [0] * LIMITS.max_nodes
    assert _read(wire).why == "too large"


# ------------------------------------------------------------ property-based

VISITS = [0]


class CountingDict(dict):
    def items(self):  # type: ignore[override]
        for pair in super().items():
            VISITS[0] += 1
            yield pair


class CountingList(list):
    def __iter__(self):  # type: ignore[override]
        for value in super().__iter__():
            VISITS[0] += 1
            yield value


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=300)
    | st.sampled_from(["zero", "mix64-1", "0.2.0", "0.1.0", BIND, "ab" * 8, "ffffffffffffffff"])
)
JSON = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=40).map(CountingList)
        | st.dictionaries(
            st.text(max_size=12) | st.sampled_from(list("0123")), children, max_size=12
        ).map(CountingDict)
    ),
    max_leaves=400,
)
PATHS = [
    ("v",),
    ("pv",),
    ("n",),
    ("geom",),
    ("geom", "bs"),
    ("geom", "dcp"),
    ("geom", "sig"),
    ("bind",),
    ("tail",),
    ("mac",),
    ("dg",),
    ("dg", "seg"),
    ("dg", "alg"),
    ("dg", "g"),
    ("dg", "g", "0"),
    ("dg", "g", "0", "0"),
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=JSON)
def test_any_value_reads_without_raising_and_the_walk_stays_bounded(raw):
    VISITS[0] = 0
    reading = _read(raw)
    assert isinstance(reading, entry.Reading)
    assert VISITS[0] <= LIMITS.max_nodes + 1
    assert reading.entry is None or reading.why == "ok"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), value=JSON, digest=st.booleans())
def test_any_field_of_a_valid_entry_replaced_reads_without_raising(path, value, digest):
    wire = _digested()
    wire = _edited(path, value, wire)
    VISITS[0] = 0
    reading = _read(wire, digest=digest)
    assert VISITS[0] <= LIMITS.max_nodes + 1
    if reading.entry is not None:
        found = reading.entry
        assert 1 <= found.num_tokens <= LIMITS.max_tokens
        assert len(found.geometry.block_sizes) <= LIMITS.num_groups
        if found.digest is not None:
            dg = found.digest
            assert dg.segment == entry_values.segment_for(found.num_tokens)
            for g, heads in dg.sums.items():
                assert 0 <= g < LIMITS.num_groups
                for h, row in heads.items():
                    assert 0 <= h < LIMITS.num_kv_heads
                    assert len(row) == -(-found.num_tokens // dg.segment)
                    assert all(0 <= v < 2**64 for v in row)


@settings(max_examples=60, deadline=None)
@given(size=st.integers(min_value=0, max_value=5_000), kind=st.sampled_from(["list", "dict"]))
def test_an_oversized_entry_is_refused_before_any_parse(size, kind, monkeypatch_parse):
    base = entry.measure(_digested(), 10**9)
    assert base is not None
    pad: Any = CountingList([0] * size)
    if kind == "dict":
        pad = CountingDict({str(i): 0 for i in range(size)})
    wire = _edited(("pad",), pad, _digested())
    VISITS[0] = 0
    monkeypatch_parse.clear()
    reading = _read(wire)
    assert VISITS[0] <= LIMITS.max_nodes + 1
    # The walk counts the pad itself and each of its values.
    if base + 1 + size > LIMITS.max_nodes:
        assert reading.why == "too large" and monkeypatch_parse == []  # never parsed
    else:
        assert reading.why == "ok" and monkeypatch_parse == [1]


@pytest.fixture(scope="module")
def monkeypatch_parse():
    """Records each strict parse of an entry (a spy around the real one)."""
    calls: list[int] = []
    original = entry.WireEntry.model_validate

    def spy(obj: Any, *args: Any, **kw: Any) -> Any:
        calls.append(1)
        return original(obj, *args, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(entry.WireEntry, "model_validate", spy)
    yield calls
    mp.undo()


def test_without_the_digest_its_dg_is_neither_walked_nor_parsed():
    # verify_kv off: a consumer reads the claim, not the digest; a dg too
    # large to walk (or malformed) does not cost a walk nor void the claim.
    wire = _wire(_entry())
    wire["dg"] = {"g": {"0": {str(h): ["0" * 16] for h in range(100_000)}}}
    params = {entry.KEY: wire}
    assert entry.read(params, LIMITS).why == "too large"
    reading = entry.read(params, LIMITS, digest=False)
    assert reading.why == "ok" and reading.entry == _entry()
    # A MAC covers the whole entry: with walk_digest the dg is bounded too.
    assert entry.read(params, LIMITS, digest=False, walk_digest=True).why == "too large"


def test_segments_inside_a_range_match_a_brute_force_count():
    from kvtail_connector.extras.kv_verification.load_checks import inside

    for segment in (256, 1024):
        for n in (1, 255, 256, 257, 3000, 4096):
            for start in (0, 1, 256, 300, 1024):
                for end in (start, start + 1, 1024, 2048, n, n + 5):
                    want = [
                        j
                        for j in range(-(-n // segment))
                        if j * segment >= start and min((j + 1) * segment, n) <= end
                    ]
                    assert list(inside(segment, n, start, end)) == want, (segment, n, start, end)
    assert len(inside(1024, 10**30, 0, 4096)) == 4  # closed form: no loop over n
