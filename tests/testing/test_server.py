"""VllmServer bookkeeping that needs no real server: one process tree per
object, so stopping it ends everything it started."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_disagg.testing.server import VllmServer


def _running(server: VllmServer) -> VllmServer:
    # Stands in for `vllm serve`: a process group that stays up until stopped.
    server.proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    return server


def test_launch_refuses_a_second_process_tree(tmp_path):
    server = _running(VllmServer("model", log_path=tmp_path / "server.log"))
    try:
        first = server.proc
        with pytest.raises(RuntimeError, match="already running"):
            server.launch()
        assert server.proc is first
    finally:
        assert server.stop(timeout_s=10) is not None
    assert first.poll() is not None


def test_context_manager_keeps_the_started_server(tmp_path, monkeypatch):
    server = _running(VllmServer("model", log_path=tmp_path / "server.log"))
    first = server.proc
    monkeypatch.setattr(server, "wait_ready", lambda: None)
    with server as entered:
        assert entered is server and server.proc is first
    assert first.poll() is not None
