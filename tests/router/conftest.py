"""Fixtures for the router tests: fake vLLM instances (small aiohttp servers
on loopback that record what they receive: vllm_disagg.testing.fake_instance,
re-exported here), routers served in-process on free ports, and a clock the
tests move by hand.

No vLLM anywhere: these tests prove what the router sends and relays.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import msgspec
import pytest

from vllm_disagg.router.app import (
    RouterState,
    build_registry,
    create_app,
    router_state,
    serve,
)
from vllm_disagg.router.config import RouterConfig
from vllm_disagg.testing.fake_instance import FakeInstance, Handler, Seen, sse
from vllm_disagg.wire.discovery import DISCOVERY_VERSION, Register, Role

__all__ = ["WAIT_S", "FakeClock", "FakeInstance", "Handler", "Seen", "sse"]

WAIT_S = 10.0  # every network wait in these tests is bounded by this


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
async def fakes() -> AsyncIterator[Callable[[str], Awaitable[FakeInstance]]]:
    """Factory: awaited with a name (``"p1"``) -> a started FakeInstance."""
    started: list[FakeInstance] = []

    async def make(name: str) -> FakeInstance:
        fake = await FakeInstance(name).start()
        started.append(fake)
        return fake

    yield make
    for fake in started:
        await fake.stop()


def registration(
    fake: FakeInstance, role: Role, model: str = "m", **fields: Any
) -> Register:
    return Register(
        version=DISCOVERY_VERSION,
        instance_id=f"{fake.name}-id",
        role=role,
        http_addr=fake.http_addr,
        kv_addr=fake.kv_addr,
        model=model,
        **fields,
    )


@dataclass
class RunningRouter:
    state: RouterState
    url: str
    client: aiohttp.ClientSession
    clock: FakeClock
    # instance id -> the seq of its last add(): each heartbeat must be newer
    seqs: dict[str, int] = field(default_factory=dict)

    @property
    def registry(self):
        return self.state.registry

    def add(self, fake: FakeInstance, role: Role, **fields: Any) -> None:
        """Register ``fake``, or heartbeat it again: like a real instance,
        each call carries a newer ``seq`` unless one is given."""
        msg = registration(fake, role, **fields)
        if "seq" not in fields:
            msg = msgspec.structs.replace(
                msg, seq=self.seqs.get(msg.instance_id, -1) + 1
            )
        self.seqs[msg.instance_id] = msg.seq
        self.registry.register(msg)

    async def post(
        self, path: str, body: Any, **kwargs: Any
    ) -> tuple[int, bytes, aiohttp.ClientResponse]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        kwargs["headers"] = {
            "Content-Type": "application/json",
            **kwargs.get("headers", {}),
        }
        async with asyncio.timeout(WAIT_S):
            async with self.client.post(self.url + path, data=data, **kwargs) as resp:
                return resp.status, await resp.read(), resp

    async def get(self, path: str) -> tuple[int, bytes]:
        async with asyncio.timeout(WAIT_S):
            async with self.client.get(self.url + path) as resp:
                return resp.status, await resp.read()

    def metric(self, name: str, **labels: str) -> float:
        """A sample's value from the router's Prometheus registry (0 if absent)."""
        value = self.state.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


FAST = RouterConfig(
    host="127.0.0.1",
    port=0,
    discovery_host="127.0.0.1",
    discovery_port=0,
    connect_timeout_s=2.0,
    prefill_timeout_s=5.0,
    first_token_timeout_s=5.0,
    chunk_timeout_s=5.0,
    request_timeout_s=8.0,
    # No token unless a test gives one, never this user's local cookie.
    local_cookie=False,
)


@pytest.fixture
async def start_router() -> AsyncIterator[Callable[..., Awaitable[RunningRouter]]]:
    """Factory: awaited with config fields (``handoff="concurrent"``, ...) -> a router
    served on free loopback ports, config fields overriding :data:`FAST`."""
    running: list[tuple[asyncio.Event, asyncio.Task, aiohttp.ClientSession]] = []

    async def start(**overrides: Any) -> RunningRouter:
        config = replace(FAST, **overrides)
        clock = FakeClock()
        app = create_app(config, registry=build_registry(config, clock=clock))
        stop = asyncio.Event()
        task = asyncio.create_task(serve(app, shutdown_trigger=stop.wait))
        state = router_state(app)
        async with asyncio.timeout(WAIT_S):
            await state.ready.wait()
        client = aiohttp.ClientSession()
        running.append((stop, task, client))
        return RunningRouter(
            state, f"http://127.0.0.1:{state.http_port}", client, clock
        )

    yield start
    for stop, task, client in running:
        await client.close()
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            async with asyncio.timeout(WAIT_S):
                await task


@pytest.fixture
def pd(fakes, start_router):
    """A router with one prefill (p) and one decode (d) fake registered."""

    async def make(**overrides: Any):
        router = await start_router(**overrides)
        p, d = await fakes("p"), await fakes("d")
        router.add(p, Role.PREFILL)
        router.add(d, Role.DECODE)
        return router, p, d

    return make
