"""Child processes a benchmark starts, stops and watches, and the machine's load.

Every child runs in a session of its own with its output in a log file, so that
stopping it (SIGTERM, then SIGKILL to its whole group) leaves nothing behind
(:class:`~vllm_disagg.testing.process.ManagedProcess`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from vllm_disagg.testing.process import ManagedProcess

STOP_TIMEOUT_S = 15.0


def http(
    url: str, body: dict | None = None, timeout_s: float = 10.0
) -> tuple[int, bytes]:
    """GET (or POST a JSON ``body``): (status, body). Raises OSError when
    unreachable."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def scrape(url: str, prefix: str) -> dict[str, float]:
    """Every Prometheus sample of ``url`` starting with ``prefix``: name{labels} ->
    value."""
    out = {}
    for line in http(url)[1].decode().splitlines():
        if line.startswith(prefix) and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def label(sample: str, name: str) -> str:
    """The value of label ``name`` in a Prometheus sample name."""
    return sample.split(f'{name}="', 1)[1].split('"', 1)[0]


def run_logged(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str]) -> int:
    """Run ``cmd`` to its end, its output appended to ``log``; its process group
    killed after ``timeout_s`` (then -9)."""
    with open(log, "ab") as f:
        f.write(f"\n$ {' '.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=STOP_TIMEOUT_S)
            return -9


class Child(ManagedProcess):
    """A server this benchmark starts on loopback ``port``: up once ``health_path``
    answers 200."""

    stop_timeout_s = STOP_TIMEOUT_S

    def __init__(
        self,
        name: str,
        command: list[str],
        log_path: Path,
        port: int,
        health_path: str = "/health",
    ):
        self.name = name
        self.command = command
        self.log_path = log_path
        self.port = port
        self.health_path = health_path
        self.proc: subprocess.Popen | None = None

    @property
    def http_addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.http_addr}"

    @property
    def ready_url(self) -> str:
        return self.url + self.health_path

    def start(self, timeout_s: float = 60.0) -> Child:
        self.launch()
        self.wait_ready(timeout_s)
        return self


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (NaN once it is gone)."""
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return float("nan")


def load_snapshot(mine: set[int] = frozenset()) -> dict[str, Any]:
    """Load average, and the vLLM processes on the machine that are not ours
    (``mine``: the process groups this benchmark started)."""
    import psutil

    others = 0
    for proc in psutil.process_iter(["pid", "cmdline", "name"]):
        try:
            if proc.pid == os.getpid() or os.getpgid(proc.pid) in mine:
                continue
            text = (
                " ".join(proc.info["cmdline"] or []) + " " + (proc.info["name"] or "")
            )
            if "vllm serve" in text or "EngineCore" in text or "vllm bench" in text:
                others += 1
        except (psutil.Error, ProcessLookupError, OSError):
            continue
    return {
        "at": time.strftime("%H:%M:%S"),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "other_vllm_processes": others,
    }


def uptime() -> str:
    """``uptime``'s line (load averages included), or "" where it cannot run."""
    try:
        return subprocess.run(
            ["uptime"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
