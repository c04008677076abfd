"""``--workers N``: N router processes behind one HTTP port, one view of the fleet.

One router process is one event loop: one core. With ``--workers N`` the
process started (the *supervisor*) binds the HTTP and discovery ports and
starts N worker processes that each run the whole router app.

* **HTTP**: the workers inherit the one listening socket and accept from it;
  the kernel hands each connection to one of them.
* **The fleet**: the supervisor answers every discovery message itself
  (``Ack``, rejections and their counts, as a single router does) and
  forwards each accepted one, with the address it came from, to every
  worker, which applies it through the same checks (``DiscoveryServer.handle``)
  to its own registry. Each worker has a feed of its own
  (``fleet_feed.py``) that first carries the last accepted ``Register`` of
  every live instance: a worker started late, or restarted, accepts no
  connection before it knows the whole fleet.
* **What each worker keeps to itself**: leases (requests in flight per
  instance), the prefix index, circuit breakers and health suspicions. Each
  balances on the requests *it* routes, about 1/N of them: least-loaded
  picks see a partial load, and a prefix another worker sent to some decode
  is not known to this one (see docs/router.md, "Workers").
* **Metrics**: request counters and histograms are prometheus_client's
  multiprocess files in the private directory, summed over the workers by
  whichever worker answers ``/metrics``; fleet gauges come from that worker,
  discovery counts from the supervisor.
* **Lifetime**: a worker that exits is started again (at most once per
  second); SIGTERM / SIGINT to the supervisor drains every worker; a worker
  whose supervisor went away exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

from vllm_disagg.router.app import (
    SHUTDOWN_GRACE_S,
    build_registry,
    create_app,
    ensure_file_descriptors,
    listen,
    serve,
)
from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.fleet_feed import ForwardingDiscovery, feed_endpoint

logger = logging.getLogger(__name__)

COUNTS_INTERVAL_S = 1.0
RESTART_INTERVAL_S = 1.0
ORPHAN_CHECK_S = 1.0
STOP_GRACE_S = SHUTDOWN_GRACE_S + 5.0
METRICS_DIR = "metrics"


@dataclass
class WorkerSpec:
    """What a worker process needs (pickled to it by multiprocessing)."""

    config: RouterConfig
    sock: socket.socket
    directory: str
    index: int
    supervisor_pid: int


def worker_main(spec: WorkerSpec) -> None:
    """A worker process: the whole router app on the inherited socket."""
    logging.basicConfig(
        level=spec.config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[w{spec.index}]: %(message)s",
    )
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    runner(_run_worker(spec))


async def _run_worker(spec: WorkerSpec) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def orphaned() -> None:
        while os.getppid() == spec.supervisor_pid:
            await asyncio.sleep(ORPHAN_CHECK_S)
        logger.warning("router worker %d: the supervisor is gone: exiting", spec.index)
        shutil.rmtree(spec.directory, ignore_errors=True)  # it could not
        stop.set()
        await asyncio.sleep(STOP_GRACE_S)
        os._exit(1)  # still starting (waiting for a feed nobody writes)

    watch = asyncio.create_task(orphaned())
    app = create_app(
        spec.config,
        feed=feed_endpoint(spec.directory, spec.index),
        metrics_dir=os.path.join(spec.directory, METRICS_DIR),
    )
    try:
        await serve(app, shutdown_trigger=stop.wait, sock=spec.sock)
    finally:
        watch.cancel()


class Supervisor:
    """Binds the ports, runs discovery, starts and restarts the workers."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.directory = tempfile.mkdtemp(prefix="vllm-disagg-router-")  # 0700
        os.makedirs(os.path.join(self.directory, METRICS_DIR))
        self.registry = build_registry(config)
        self.discovery = ForwardingDiscovery(
            self.registry,
            host=config.discovery_host,
            port=config.discovery_port,
            token=config.token,
            allow_remote_unsigned=config.insecure_discovery,
            loopback_only=config.credentials.local,
        )
        self.sock: socket.socket | None = None
        self.http_port: int | None = None
        self.workers: dict[int, BaseProcess] = {}
        self.restarts = 0
        self._started_at: dict[int, float] = {}
        self._mp = multiprocessing.get_context("spawn")

    async def run(self, stop: asyncio.Event) -> None:
        config = self.config
        ensure_file_descriptors(config.max_connections)
        self.sock = listen(config.host, config.port)
        self.http_port = self.sock.getsockname()[1]
        try:
            await self.discovery.start()
            # Set before any worker imports prometheus_client: its values
            # then live in files every worker's /metrics sums.
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(
                self.directory, METRICS_DIR
            )
            for index in range(config.workers):
                self._start(index)
            logger.info(
                "router: %d workers on http port %d, discovery on %s",
                config.workers,
                self.http_port,
                self.discovery.endpoint,
            )
            last_counts = 0.0
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.2)
                self.registry.expire()
                now = time.monotonic()
                if now - last_counts >= COUNTS_INTERVAL_S:
                    self.discovery.send_counts()
                    last_counts = now
                self._restart_exited(now)
        finally:
            await self._stop_workers()
            await self.discovery.close()
            self.sock.close()
            shutil.rmtree(self.directory, ignore_errors=True)

    def _start(self, index: int) -> None:
        assert self.sock is not None
        self.discovery.open_feed(self.directory, index)
        spec = WorkerSpec(self.config, self.sock, self.directory, index, os.getpid())
        proc = self._mp.Process(
            target=worker_main, args=(spec,), name=f"router-worker-{index}"
        )
        proc.start()
        self.workers[index] = proc
        self._started_at[index] = time.monotonic()

    def _restart_exited(self, now: float) -> None:
        for index, proc in list(self.workers.items()):
            if proc.is_alive():
                continue
            if now - self._started_at[index] < RESTART_INTERVAL_S:
                continue
            logger.warning(
                "router worker %d (pid %s) exited with %s: starting it again",
                index,
                proc.pid,
                proc.exitcode,
            )
            self.restarts += 1
            self._start(index)

    async def _stop_workers(self) -> None:
        for proc in self.workers.values():
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.workers.values():
            while proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.is_alive():
                proc.kill()
            proc.join(1.0)
