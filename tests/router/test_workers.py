"""``--workers N``: a real router process with two workers behind one port,
over in-process fake instances that register through the real discovery
port (signed frames, Acks).

What must hold: every worker knows the whole fleet (a request on any
connection is served), metrics are the sum over the workers, a worker that
dies is started again and knows the fleet at once (without waiting for a
heartbeat), and the router stops with all its processes.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import aiohttp
import psutil
import pytest
import zmq
import zmq.asyncio

from vllm_disagg import envs
from vllm_disagg.testing.router import RouterProcess
from vllm_disagg.testing.server import cpu_test_env
from vllm_disagg.wire.discovery import (
    DISCOVERY_VERSION,
    Ack,
    Register,
    Role,
    open_frame,
    seal,
)

WORKERS = 2
REQUESTS = 24
WAIT_S = 30.0


async def register(port: int, token: bytes, fake, role: Role) -> None:
    """One signed Register through the discovery port, answered by an Ack."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    msg = Register(
        version=DISCOVERY_VERSION,
        instance_id=f"{fake.name}-id",
        role=role,
        http_addr=fake.http_addr,
        kv_addr=fake.kv_addr,
        model="m",
        seq=1,
        interval_s=60.0,
        sent_at=time.time(),
    )
    try:
        await sock.send_multipart(seal(token, msg))
        frames = await asyncio.wait_for(sock.recv_multipart(), WAIT_S)
        ack = open_frame(token, frames)
        assert isinstance(ack, Ack) and ack.accepted, ack
    finally:
        sock.close()
        ctx.term()


def workers_of(router: RouterProcess) -> list[psutil.Process]:
    assert router.proc is not None
    workers = []
    for child in psutil.Process(router.proc.pid).children():
        try:
            # (multiprocessing's resource tracker is a child too)
            if "--multiprocessing-fork" in child.cmdline():
                workers.append(child)
        except psutil.Error:  # a killed worker not reaped yet
            pass
    return workers


async def completion(client: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    async with client.post(f"{url}/v1/completions", json=body) as resp:
        return resp.status, await resp.read()


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and ",".join(sorted(m.group(1).split(","))) == want:
            total += float(m.group(2))
    return total


@pytest.fixture
def workers_router(tmp_path):
    router = RouterProcess(
        ["--workers", str(WORKERS), "--heartbeat-timeout-s", "300"],
        log_path=tmp_path / "router.log",
        env=cpu_test_env(),
    )
    yield router
    code = router.stop()
    if router.proc is not None:
        assert code == 0, router.log_tail()


async def test_workers_share_one_port_and_one_fleet(fakes, workers_router):
    router = workers_router
    token = router.env[envs.VLLM_DISAGG_ROUTER_TOKEN].encode()
    p, d = await fakes("p"), await fakes("d")
    await asyncio.to_thread(router.start)
    workers = workers_of(router)
    assert len(workers) == WORKERS, router.log_tail()
    await register(router.discovery_port, token, p, Role.PREFILL)
    await register(router.discovery_port, token, d, Role.DECODE)

    # A new connection per request: the kernel spreads them over the workers,
    # and each must know both instances (no heartbeat follows the first).
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as client:
        # The supervisor Acks, then each worker applies the message from its
        # feed (milliseconds later): wait until ten connections in a row
        # found both instances.
        in_a_row, deadline = 0, time.monotonic() + WAIT_S
        while in_a_row < 10:
            assert time.monotonic() < deadline, router.log_tail()
            async with client.get(f"{router.url}/health") as resp:
                in_a_row = in_a_row + 1 if resp.status == 200 else 0
        for _ in range(REQUESTS):
            status, body = await completion(client, router.url)
            assert status == 200, (body, router.log_tail())
        assert len(d.requests) == REQUESTS and len(p.requests) == REQUESTS
        # Every scrape, whichever worker answers it, sums all workers.
        for _ in range(2 * WORKERS):
            async with client.get(f"{router.url}/metrics") as resp:
                text = await resp.text()
            ok = metric(
                text,
                "vllm_disagg_router_requests_total",
                endpoint="completions",
                outcome="ok",
            )
            assert ok == REQUESTS, text
            accepted = metric(
                text, "vllm_disagg_router_discovery_accepted_total", type="register"
            )
            assert accepted == 2, text

        # A killed worker is started again; once the other old one is gone
        # too, the new one alone serves: it had the fleet from its feed.
        old = {w.pid for w in workers}
        os.kill(workers[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + WAIT_S
        while not ({w.pid for w in workers_of(router)} - old):
            assert time.monotonic() < deadline, router.log_tail()
            await asyncio.sleep(0.1)
        os.kill(workers[1].pid, signal.SIGKILL)
        served = 0
        deadline = time.monotonic() + WAIT_S
        while served < 4:
            assert time.monotonic() < deadline, router.log_tail()
            try:
                status, body = await completion(client, router.url)
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.1)  # a connection the killed worker held
                continue
            assert status == 200, (body, router.log_tail())
            served += 1
    assert "exited with -9: starting it again" in router.log_tail()


async def test_a_worker_without_its_supervisor_exits(fakes, workers_router):
    router = workers_router
    await asyncio.to_thread(router.start)
    workers = workers_of(router)
    assert router.proc is not None
    router.proc.kill()  # SIGKILL: nothing drains, the workers must notice
    router.proc.wait(WAIT_S)
    gone, alive = await asyncio.to_thread(psutil.wait_procs, workers, timeout=WAIT_S)
    assert not alive, [w.pid for w in alive]
    router.proc = None  # nothing left to stop


def test_workers_is_range_checked():
    from vllm_disagg.errors import ConfigError
    from vllm_disagg.router.config import RouterConfig

    with pytest.raises(ConfigError, match="workers"):
        RouterConfig(workers=0)
    assert RouterConfig(workers=4).workers == 4
