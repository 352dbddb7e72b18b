"""The harness's port chooser: engines started together must never share a port."""

from __future__ import annotations

import socket

import pytest

from demo import procs


def _listening(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_ports_are_never_handed_out_twice_and_avoid_the_ephemeral_range() -> None:
    lo, hi = procs._ephemeral_range()
    seen: list[int] = []
    for _ in range(40):
        seen += procs.free_ports(3)
    assert len(set(seen)) == len(seen)
    assert all(not (lo <= p <= hi) for p in seen)


def test_a_port_in_use_is_skipped_and_an_exhausted_pool_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = procs._listen_ports()
    base = next(
        b
        for b in range(pool.start, pool.stop - 4, 4)
        if all(procs._bindable(p, "127.0.0.1") for p in range(b, b + 4))
    )
    monkeypatch.setattr(procs, "_listen_ports", lambda: range(base, base + 4))
    monkeypatch.setattr(procs, "_HANDED_OUT", set())
    with _listening(base + 1):
        assert sorted(procs.free_ports(3)) == [base, base + 2, base + 3]
        with pytest.raises(RuntimeError, match="no 1 free ports"):
            procs.free_ports(1)
