"""Start the xPyD router as a subprocess (tests, benchmarks, the demo), and
talk to it the way a client does.

The router runs as a ``ManagedProcess`` (the ``process`` helper): stopped by
its process group (SIGTERM, then SIGKILL); its log is a file so a failing test
can show it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

from vllm_disagg.testing.process import ManagedProcess
from vllm_disagg.testing.server import cpu_test_env, get_free_port

STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


class RouterStartupError(RuntimeError):
    pass


class RouterProcess(ManagedProcess):
    """``python -m vllm_disagg.router`` on loopback ports chosen here."""

    name = "router"
    startup_error = RouterStartupError
    startup_timeout_s = STARTUP_TIMEOUT_S
    stop_timeout_s = STOP_TIMEOUT_S
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

    @property
    def ready_url(self) -> str:
        return f"{self.url}/instances"

    def start(self) -> RouterProcess:
        self.launch()
        self.wait_ready()
        return self

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

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
