"""VllmServer bookkeeping that needs no real server: one process tree per
object, so stopping it ends everything it started."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_disagg.testing.server import VllmServer, get_free_port


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


def _ephemeral_range() -> range:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return range(int(low), int(high) + 1)


def test_free_ports_are_outside_the_ephemeral_range_free_and_never_reissued():
    ephemeral = _ephemeral_range()
    spans = [get_free_port(span=4) for _ in range(50)]
    handed_out = [p for start in spans for p in range(start, start + 4)]
    assert len(set(handed_out)) == len(handed_out), "a port was handed out twice"
    assert not [p for p in handed_out if p in ephemeral]
    for port in handed_out[:8]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_some_other_process_holds_is_skipped(monkeypatch):
    from vllm_disagg.testing import server as server_module

    with socket.socket() as held:
        for port in range(21000, 22000):  # an explicit choice, as another test runner's
            try:
                held.bind(("127.0.0.1", port + 1))
                break
            except OSError:
                continue
        held.listen()
        picks = iter([port, port + 2])  # [port, port + 1] overlaps the held one
        monkeypatch.setattr(
            server_module._port_rng, "randrange", lambda *_: next(picks)
        )
        monkeypatch.setattr(server_module, "_issued", set())
        assert get_free_port(span=2) == port + 2
