"""Start and stop real ``vllm serve`` processes for tests, examples and benchmarks.

:class:`VllmServer` runs the ``vllm`` console script of the current
environment on a free loopback port, polls ``/health`` until the server is
ready (or its process dies, or a deadline passes), keeps its output in a log
file, and on exit stops exactly the process group it started.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import requests

from vllm_disagg import envs
from vllm_disagg.testing import openai_client
from vllm_disagg.testing.process import ManagedProcess, ProcessStartupError

DEFAULT_STARTUP_TIMEOUT_S = 300.0


# Ports tests choose for servers come from below the kernel's ephemeral range
# (net.ipv4.ip_local_port_range, 32768-60999 by default). A port the kernel
# handed out for bind(0) was free when asked, but until the server binds it any
# other process's bind(0) or outgoing connection may take it, and every vLLM
# server picks its internal ports that way: with a dozen servers starting at
# once that race was real. Below the range only explicit choices compete.
_PORT_LOW, _PORT_HIGH = 20000, 29000  # 29500+: torch.distributed defaults
_issued: set[int] = set()
_port_rng = random.Random()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def get_free_port(span: int = 1) -> int:
    """A port with ``span - 1`` more after it, all free now and never handed
    out before by this process, outside the kernel's ephemeral range."""
    for _ in range(1000):
        port = _port_rng.randrange(_PORT_LOW, _PORT_HIGH - span)
        ports = range(port, port + span)
        if not _issued.intersection(ports) and all(_bindable(p) for p in ports):
            _issued.update(ports)
            return port
    raise RuntimeError(f"no {span} free consecutive ports in {_PORT_LOW}..{_PORT_HIGH}")


def vllm_executable() -> str:
    """The ``vllm`` console script next to the running interpreter."""
    found = shutil.which("vllm", path=os.path.dirname(sys.executable))
    if found is None:
        raise RuntimeError(
            f"no `vllm` console script next to {sys.executable}; install the package"
        )
    return found


# The router token of test fleets when the environment sets none.
TEST_ROUTER_TOKEN = "vllm-disagg-test-fleet-token"


def fleet_router_token() -> bytes:
    """The token test servers and routers get (see :func:`cpu_test_env`)."""
    return envs.router_token() or TEST_ROUTER_TOKEN.encode()


def cpu_test_env(*, vllm_omp_defaults: bool = False, **extra: str) -> dict[str, str]:
    """Environment for small CPU servers: little KV memory, offline, quiet,
    and one unpinned OpenMP thread per worker.

    ``vllm_omp_defaults=True`` leaves OpenMP as users run it (vLLM's own
    ``VLLM_CPU_OMP_THREADS_BIND=auto``: a team pinned to every core in each
    worker): the tests that must see what users see start their servers so.

    By default vLLM's CPU workers pin an OpenMP team of one thread per core
    (``OMP_PROC_BIND``) and those threads spin in barriers. With several
    servers on 2 cores, every worker pins its team to the same cores, and a
    thread spinning for a teammate that cannot be scheduled stretched one
    forward pass past 10 s (seen as a DP group failing with "owes passes but
    ran none", the stuck rank inside ``torch.softmax``).
    """
    env = dict(os.environ)
    # Loopback test fleets share one router token: routers sign the peers
    # they name with it and P2P instances check the grants.
    env.setdefault(envs.VLLM_DISAGG_ROUTER_TOKEN, TEST_ROUTER_TOKEN)
    if vllm_omp_defaults:
        for name in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"):
            env.pop(name, None)
    else:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.update(extra)
    return env


class ServerStartupError(ProcessStartupError):
    pass


class VllmServer(ManagedProcess):
    """One ``vllm serve`` process tree, started in its own process group."""

    name = "vllm serve"
    startup_error = ServerStartupError
    poll_interval_s = 1.0

    def __init__(
        self,
        model: str | os.PathLike,
        args: list[str] | None = None,
        *,
        log_path: str | os.PathLike,
        env: dict[str, str] | None = None,
        port: int | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    ):
        self.model = str(model)
        self.port = port or get_free_port()
        self.args = list(args or [])
        self.log_path = Path(log_path)
        self.env = env if env is not None else cpu_test_env()
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        return [
            vllm_executable(),
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
        ]

    def start(self) -> VllmServer:
        """Launch and wait until ``/health`` answers (or :meth:`launch` alone,
        for servers that must meet, such as the DP ranks of an external load
        balancer, then :meth:`wait_ready`)."""
        self.launch()
        self.wait_ready()
        return self

    @property
    def ready_url(self) -> str:
        return f"{self.url}/health"

    def __enter__(self) -> VllmServer:
        """``with VllmServer(...)`` starts it; ``with server.start()`` keeps
        the one already started."""
        if self.proc is None:
            return self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    # --- client helpers ---------------------------------------------------

    def complete(self, prompt: str, timeout_s: float = 120.0, **params: Any) -> dict:
        """POST /v1/completions (see the ``openai_client`` test helpers)."""
        return openai_client.complete(self, prompt, timeout_s=timeout_s, **params)

    def metrics(self, prefix: str = "vllm_disagg:") -> dict[str, dict[str, float]]:
        """Scrape ``/metrics``: {metric name: {label string: value}} for
        metrics starting with ``prefix``."""
        text = requests.get(f"{self.url}/metrics", timeout=10).text
        found: dict[str, dict[str, float]] = {}
        for line in text.splitlines():
            if not line.startswith(prefix):
                continue
            name_labels, _, value = line.rpartition(" ")
            name, _, labels = name_labels.partition("{")
            found.setdefault(name, {})[labels.rstrip("}")] = float(value)
        return found
