"""Start the xPyD router as a subprocess (tests, benchmarks, the demo), and
talk to it the way a client does.

The router is stopped by its own PID (SIGTERM, then SIGKILL); its log is a
file so a failing test can show it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

from vllm_disagg.testing.server import LoggedProcess, cpu_test_env, get_free_port

STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


class RouterStartupError(RuntimeError):
    pass


class RouterProcess(LoggedProcess):
    """``python -m vllm_disagg.router`` on loopback ports chosen here."""

    DEFAULT_TAIL_LINES = 60

    def __init__(
        self,
        args: list[str] | None = None,
        *,
        log_path: str | os.PathLike,
        model: str = "",
        env: dict[str, str] | None = None,
        port: int | None = None,
        discovery_port: int | None = None,
    ):
        # Explicit ports restart a router where the fleet knows it (chaos tests).
        self.port = port or get_free_port()
        self.discovery_port = discovery_port or get_free_port()
        self.model = model  # what openai_client puts in request bodies
        self.log_path = Path(log_path)
        # Inherit the environment, with the test fleets' router token by default.
        self.env = env if env is not None else cpu_test_env()
        self.command = [
            sys.executable,
            "-m",
            "vllm_disagg.router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--discovery-host",
            "127.0.0.1",
            "--discovery-port",
            str(self.discovery_port),
            *(args or []),
        ]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RouterProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RouterStartupError(
                    f"router exited with {self.proc.returncode}\n{self.log_tail()}"
                )
            try:
                if requests.get(f"{self.url}/instances", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.stop()
        raise RouterStartupError(
            f"router not up after {STARTUP_TIMEOUT_S:.0f}s\n{self.log_tail()}"
        )

    def instances(self) -> list[dict[str, Any]]:
        body = requests.get(f"{self.url}/instances", timeout=5).json()
        return body["instances"] if isinstance(body, dict) else body

    def wait_for_instances(
        self, predicate, *, timeout_s: float, what: str = "instances"
    ) -> list[dict[str, Any]]:
        """Poll ``/instances`` until ``predicate(instances)`` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.instances()
            if predicate(found):
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"router never had {what}: {found}")
            time.sleep(0.3)

    def healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def stop(self) -> int | None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(timeout=STOP_TIMEOUT_S)

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
