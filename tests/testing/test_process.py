"""ManagedProcess with real child processes: readiness, death, stop by group."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from vllm_disagg.testing.process import ManagedProcess, ProcessStartupError
from vllm_disagg.testing.server import get_free_port


class _Child(ManagedProcess):
    name = "child"
    poll_interval_s = 30.0  # a death must not wait for the next poll

    def __init__(self, code: str, log_path: Path, port: int = 0):
        self.command = [sys.executable, "-c", code]
        self.log_path = log_path
        self.port = port

    @property
    def ready_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_child_that_dies_during_startup_is_noticed_at_once(tmp_path):
    child = _Child("import sys; print('bad flag'); sys.exit(3)", tmp_path / "c.log")
    child.launch()
    started = time.monotonic()
    with pytest.raises(ProcessStartupError, match="child exited with 3") as info:
        child.wait_ready(timeout_s=60)
    assert time.monotonic() - started < 10
    assert "bad flag" in str(info.value)  # the log's tail comes with it


def test_ready_once_the_url_answers_then_stop_ends_the_whole_group(tmp_path):
    port = get_free_port()
    pid_file = tmp_path / "grandchild.pid"
    # The child starts a grandchild that ignores SIGTERM, then serves HTTP.
    code = (
        "import http.server, subprocess, sys\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(g.pid))\n"
        f"http.server.test(http.server.SimpleHTTPRequestHandler, port={port}, "
        "bind='127.0.0.1')\n"
    )
    child = _Child(code, tmp_path / "c.log", port)
    child.poll_interval_s = 0.2
    child.launch()
    try:
        child.wait_ready(timeout_s=60)
        grandchild = int(pid_file.read_text())
        assert _alive(grandchild)
    finally:
        child.stop(timeout_s=10)
    assert child.proc is not None and child.proc.poll() is not None
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


def test_the_deadline_stops_a_child_that_never_gets_ready(tmp_path):
    child = _Child("import time; time.sleep(120)", tmp_path / "c.log", get_free_port())
    child.poll_interval_s = 0.2
    child.launch()
    with pytest.raises(ProcessStartupError, match="child not ready after 1s"):
        child.wait_ready(timeout_s=1)
    assert child.proc is not None and child.proc.poll() is not None


def test_a_second_launch_is_refused_while_running(tmp_path):
    child = _Child("import time; time.sleep(120)", tmp_path / "c.log")
    child.launch()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            child.launch()
    finally:
        assert child.stop(timeout_s=10) is not None
