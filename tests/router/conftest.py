"""Fixtures for the router tests: fake vLLM instances (small aiohttp servers
on loopback that record what they receive), routers served in-process on
free ports, and a clock the tests move by hand.

No vLLM anywhere: these tests prove what the router sends and relays.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from vllm_disagg.router.app import RouterState, build_registry, create_app, router_state, serve
from vllm_disagg.router.config import RouterConfig
from vllm_disagg.wire.discovery import DISCOVERY_VERSION, Register, Role

WAIT_S = 10.0  # every network wait in these tests is bounded by this
_kv_ports = itertools.count(21001)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Seen:
    """One request a fake instance received."""

    path: str
    headers: CIMultiDict[str]
    body: dict[str, Any]
    at: float = field(default_factory=time.monotonic)


Handler = Callable[["FakeInstance", web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


def sse(*payloads: Any) -> list[bytes]:
    """SSE events as vLLM writes them, with the closing [DONE]."""
    return [f"data: {json.dumps(p)}\n\n".encode() for p in payloads] + [b"data: [DONE]\n\n"]


class FakeInstance:
    """A stand-in for one ``vllm serve``.

    By default it answers a completion whose text is its name, or, when the
    body asks for ``stream``, the SSE ``chunks`` with ``chunk_delay_s``
    between them. Set ``status`` for an error answer, ``delay_s`` to wait
    before answering, ``hang`` to never answer, or ``handler`` for anything
    else. ``disconnected`` is set when a client closes a request it has not
    finished with.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.kv_addr = f"127.0.0.1:{next(_kv_ports)}"
        self.requests: list[Seen] = []
        self.status = 200
        self.delay_s = 0.0
        self.hang = False  # never answer anything, /health included
        self.health_status = 200
        self.models: list[dict] | None = None  # what /v1/models lists (None: 404)
        self.api_key: str | None = None  # /v1/models wants "Bearer <it>" (vllm --api-key)
        self.chunks = sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]})
        self.chunk_delay_s = 0.0
        self.handler: Handler | None = None
        self.disconnected = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def http_addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def answer(self) -> bytes:
        return json.dumps({"id": "cmpl-x", "object": "text_completion",
                           "choices": [{"index": 0, "text": self.name}]}).encode()  # fmt: skip

    async def start(self) -> FakeInstance:
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        for path in ("/tokenize", "/detokenize"):
            app.router.add_post(path, self._echo_path)
        app.router.add_get("/version", self._echo_path)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except (ValueError, RecursionError):
            body = None
        if not isinstance(body, dict):  # as vLLM's FastAPI validation answers
            self.requests.append(Seen(request.path, request.headers.copy(), body))
            return web.json_response({"error": {"message": f"{self.name}: not an object",
                                                "type": "Bad Request", "param": "body",
                                                "code": 400}}, status=400)  # fmt: skip
        self.requests.append(Seen(request.path, request.headers.copy(), body))
        try:
            if self.handler is not None:
                return await self.handler(self, request, body)
            if self.hang:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.delay_s)
            if self.status != 200:
                return web.json_response({"error": {"message": self.name}}, status=self.status)
            if body.get("stream"):
                return await self._stream(request)
            return web.Response(body=self.answer(), content_type="application/json")
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected.set()
            raise

    async def _models(self, request: web.Request) -> web.Response:
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        if self.models is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response({"object": "list", "data": self.models})

    async def _echo_path(self, request: web.Request) -> web.Response:
        return web.json_response({"path": request.path, "by": self.name})

    async def _health(self, request: web.Request) -> web.Response:
        if self.hang:
            await asyncio.sleep(3600)
        return web.Response(status=self.health_status)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for i, chunk in enumerate(self.chunks):
            if i:
                await asyncio.sleep(self.chunk_delay_s)
            await resp.write(chunk)
        await resp.write_eof()
        return resp


@pytest.fixture
async def fakes() -> AsyncIterator[Callable[[str], Awaitable[FakeInstance]]]:
    """Factory: ``await fakes("p1")`` -> a started FakeInstance."""
    started: list[FakeInstance] = []

    async def make(name: str) -> FakeInstance:
        fake = await FakeInstance(name).start()
        started.append(fake)
        return fake

    yield make
    for fake in started:
        await fake.stop()


def registration(fake: FakeInstance, role: Role, model: str = "m", **fields: Any) -> Register:
    return Register(
        version=DISCOVERY_VERSION, instance_id=f"{fake.name}-id", role=role,
        http_addr=fake.http_addr, kv_addr=fake.kv_addr, model=model, **fields,
    )  # fmt: skip


@dataclass
class RunningRouter:
    state: RouterState
    url: str
    client: aiohttp.ClientSession
    clock: FakeClock

    @property
    def registry(self):
        return self.state.registry

    def add(self, fake: FakeInstance, role: Role, **fields: Any) -> None:
        self.registry.register(registration(fake, role, **fields))

    async def post(
        self, path: str, body: Any, **kwargs: Any
    ) -> tuple[int, bytes, aiohttp.ClientResponse]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        kwargs["headers"] = {"Content-Type": "application/json", **kwargs.get("headers", {})}
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
    host="127.0.0.1", port=0, discovery_host="127.0.0.1", discovery_port=0,
    connect_timeout_s=2.0, prefill_timeout_s=5.0, first_token_timeout_s=5.0,
    chunk_timeout_s=5.0, request_timeout_s=8.0,
)  # fmt: skip


@pytest.fixture
async def start_router() -> AsyncIterator[Callable[..., Awaitable[RunningRouter]]]:
    """Factory: ``await start_router(handoff="concurrent", ...)`` -> a router
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
        return RunningRouter(state, f"http://127.0.0.1:{state.http_port}", client, clock)

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
