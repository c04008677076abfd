"""Floods of hostile input on the router's two ports (vllm_disagg/testing/
hostile.py): nothing registers, nothing crashes, every rejection the router
can see is counted, and clients are served throughout."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import random
import socket
import sys
import time

import aiohttp
import pytest

from vllm_disagg import envs
from vllm_disagg.router.client_limits import REASONS
from vllm_disagg.testing.hostile import (
    discovery_protocol,
    flood_tcp,
    flood_zmq,
    http_payloads,
)
from vllm_disagg.wire import frames

from .conftest import WAIT_S

pytestmark = pytest.mark.asyncio
BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}


def _rejected(router) -> float:
    kinds = (
        "malformed",
        "oversized",
        "unauthenticated",
        "stale",
        "version",
        "replayed",
    )
    return sum(
        router.metric("vllm_disagg_router_discovery_rejected_total", kind=k)
        for k in kinds
    )


async def test_a_discovery_flood_registers_nothing_and_is_counted(pd, monkeypatch):
    monkeypatch.setenv(envs.VLLM_DISAGG_ROUTER_TOKEN, "fleet-token")
    router, p, d = await pd()
    endpoint = router.state.discovery.endpoint.removeprefix("tcp://")
    before = len(router.registry)
    served = 0

    async def clients() -> None:
        nonlocal served
        while not flood.done():
            status, _, _ = await router.post("/v1/completions", BODY)
            assert status == 200
            served += 1
            await asyncio.sleep(0.05)

    flood = asyncio.create_task(
        asyncio.to_thread(
            flood_zmq,
            endpoint,
            discovery_protocol(),
            count=3000,
            time_s=30.0,
            seed=7,
        )
    )
    await clients()
    sent = await flood
    # Everything that reached the router is counted. libzmq drops a message
    # over the socket's size limit with its connection, before the router
    # sees it; one just over the protocol's bound reaches it (and is counted).
    at_least = sent.total - sent.by_kind["oversized"]
    async with asyncio.timeout(WAIT_S):
        while _rejected(router) < at_least:
            await asyncio.sleep(0.05)
    assert at_least <= _rejected(router) <= sent.total, sent
    assert len(router.registry) == before and served > 0
    assert (
        router.metric("vllm_disagg_router_discovery_accepted_total", type="register")
        == 0
    )


async def test_an_http_flood_of_broken_requests_leaves_clients_served(pd):
    router, p, d = await pd(
        max_header_bytes=65536, client_header_timeout_s=0.3, client_idle_timeout_s=0.3
    )
    port = router.state.http_port
    sent = await asyncio.to_thread(
        flood_tcp,
        "127.0.0.1",
        port,
        http_payloads(random.Random(3)),
        count=40,
        time_s=40.0,
        read_s=0.5,
    )
    assert sent.total == 40
    status, _, _ = await router.post("/v1/completions", BODY)
    assert status == 200
    # Nothing broken was prefilled (bodies that are not JSON objects are
    # refused by the decode, as vLLM refuses them); heads over the bound were cut.
    assert len(p.requests) == 1
    assert all("kv_transfer_params" not in (r.body or {}) for r in d.requests[:-1])
    assert router.metric(
        "vllm_disagg_router_client_connections_closed_total", reason="headers_too_large"
    ) == sent.by_kind.get("oversized", 0)
    # Every broken connection was refused one way, and counted once (JSON
    # only Python reads, NaN or lone surrogates, is vLLM's: a decode answers).
    refused = sum(
        router.metric("vllm_disagg_router_requests_total", endpoint=e, outcome=o)
        for e in ("completions", "chat_completions")
        for o in ("bad_request", "ok", "upstream_client_error")
    )
    refused -= 1  # the one served request above
    refused += sum(
        router.metric("vllm_disagg_router_client_connections_closed_total", reason=r)
        for r in REASONS
    )
    assert refused == sent.total, sent


# A stranger's flood, from a process of its own (as a stranger is): a thread
# of the test's process would compete with the router for the interpreter
# lock, and on a loaded host that, not the discovery loop, slowed requests.
_FLOOD = """
import sys, time, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.setsockopt(zmq.SNDHWM, 100000)
sock.connect(sys.argv[1])
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    for _ in range(1000):
        try:
            sock.send_multipart([b"junkjunk", b""], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
sock.close()
ctx.term()
"""


async def test_a_discovery_flood_does_not_hold_up_http_requests(pd):
    """PyZMQ hands back finished futures while frames are queued: the
    discovery loop never yielded, and a flood of junk stalled every request
    until it ended (8 s for an 8 s flood)."""
    router, p, d = await pd()
    endpoint = router.state.discovery.endpoint
    flood = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _FLOOD, endpoint, "20"
    )
    try:
        # The flood is under way once some frames were counted: it sends far
        # faster than the router reads, so frames stay queued from then on.
        # (20,000 counted took over 10 s at load 9 on 2 cores: the router's
        # share of a loaded host, not a stall, which the request below shows.)
        async with asyncio.timeout(WAIT_S):
            while (
                router.metric(
                    "vllm_disagg_router_discovery_rejected_total", kind="malformed"
                )
                < 2000
            ):
                await asyncio.sleep(0.05)
        started = time.monotonic()
        status, _, _ = await router.post("/v1/completions", BODY)
        elapsed = time.monotonic() - started
        assert flood.returncode is None, "the flood ended before the request"
    finally:
        if flood.returncode is None:
            flood.kill()
        await flood.wait()
    assert status == 200 and elapsed < 2.0, (
        elapsed
    )  # ~0.01 s unloaded; a bound for slow hosts


async def test_idle_connections_to_the_discovery_port_are_dropped(
    start_router, monkeypatch
):
    """The libzmq library accepts any number of TCP connections: idle ones, never
    finishing the handshake, used up the router's file descriptors."""
    monkeypatch.setattr(frames, "HANDSHAKE_TIMEOUT_MS", 300)
    router = await start_router()
    host, port = router.state.discovery.endpoint.removeprefix("tcp://").rsplit(":", 1)
    conns = [socket.create_connection((host, int(port))) for _ in range(20)]
    try:
        for conn in conns:
            conn.settimeout(WAIT_S)
            with contextlib.suppress(ConnectionResetError):
                while conn.recv(4096):  # libzmq's greeting, then the close
                    pass
    finally:
        for conn in conns:
            conn.close()


async def test_the_routers_own_descriptor_shortage_is_not_blamed_on_an_instance():
    from vllm_disagg.router.health import out_of_descriptors

    key = aiohttp.client_reqrep.ConnectionKey("h", 1, False, True, None, None, None)
    emfile = aiohttp.ClientConnectorError(
        key, OSError(errno.EMFILE, "Too many open files")
    )
    refused = aiohttp.ClientConnectorError(
        key, ConnectionRefusedError(errno.ECONNREFUSED, "x")
    )
    assert out_of_descriptors(emfile) and not out_of_descriptors(refused)
