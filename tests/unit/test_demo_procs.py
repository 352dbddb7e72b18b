"""Process groups of the harness: found, stopped, and a stubborn one killed."""

from __future__ import annotations

import signal
import subprocess

import pytest

psutil = pytest.importorskip("psutil")

from demo import procs  # noqa: E402


def _group(script: str) -> subprocess.Popen:
    proc = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    procs.wait_for(lambda: len(procs.group_processes(proc.pid)) == 3, 10, "3 processes up")
    return proc


@pytest.mark.parametrize(
    "script",
    ["sleep 60 & sleep 60 & wait", "trap '' TERM; sleep 60 & sleep 60 & wait"],
    ids=["stops-on-term", "ignores-term"],
)
def test_stop_group_leaves_no_process_of_the_group(script):
    proc = _group(script)
    members = procs.group_processes(proc.pid)
    assert proc.pid in {p.pid for p in members}
    procs.stop_group(proc, signal.SIGTERM, timeout=1.0)
    assert proc.poll() is not None
    assert procs.group_processes(proc.pid) == []
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in members)


def test_wait_for_names_what_it_waited_for():
    with pytest.raises(TimeoutError, match=r"the answer: not reached within 0.2 s \(last: 0\)"):
        procs.wait_for(lambda: 0, 0.2, "the answer", interval=0.05)
    with pytest.raises(RuntimeError, match="the answer: it died"):
        procs.wait_for(lambda: None, 10, "the answer", dead=lambda: "it died")
    assert procs.wait_for(iter([0, 0, 7]).__next__, 5, "x", interval=0.01) == 7
