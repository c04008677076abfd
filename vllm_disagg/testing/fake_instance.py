"""A fake ``vllm serve``: a small aiohttp server on loopback that speaks the
OpenAI routes the router uses and records what it receives.

One fake for the router tests (in-process, one per test instance) and the router
benchmark (a process of its own per instance, ``python -m
vllm_disagg.testing.fake_instance``), so that both exercise the router
against the same stand-in. No vLLM and no torch: the router is what is under test.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

_kv_ports = itertools.count(21001)  # what a fake advertises; nothing listens there


@dataclass
class Seen:
    """One request a fake instance received."""

    path: str
    headers: CIMultiDict[str]
    body: dict[str, Any]
    at: float = field(default_factory=time.monotonic)


Handler = Callable[
    ["FakeInstance", web.Request, dict[str, Any]], Awaitable[web.StreamResponse]
]


def sse(*payloads: Any) -> list[bytes]:
    """SSE events as vLLM writes them, with the closing [DONE]."""
    return [f"data: {json.dumps(p)}\n\n".encode() for p in payloads] + [
        b"data: [DONE]\n\n"
    ]


class FakeInstance:
    """A stand-in for one ``vllm serve``.

    By default it answers a completion whose text is its name, or, when the
    body asks for ``stream``, the SSE ``chunks`` with ``chunk_delay_s``
    between them. Set ``status`` for an error answer, ``delay_s`` to wait
    before answering, ``hang`` to never answer, or ``handler`` for anything
    else (:func:`token_stream`: a completion of ``max_tokens`` tokens, as the
    benchmark wants). ``disconnected`` is set when a client closes a request
    it has not finished with. ``record=False`` keeps no :class:`Seen` (a
    benchmark sends hundreds of thousands of requests).
    """

    def __init__(self, name: str, *, port: int = 0, record: bool = True) -> None:
        self.name = name
        self.kv_addr = f"127.0.0.1:{next(_kv_ports)}"
        self.record = record
        self.requests: list[Seen] = []
        self.status = 200
        self.delay_s = 0.0
        self.hang = False  # never answer anything, /health included
        self.health_status = 200
        self.models: list[dict] | None = None  # what /v1/models lists (None: 404)
        self.api_key: str | None = (
            None  # /v1/models wants "Bearer <it>" (vllm --api-key)
        )
        self.chunks = sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]})
        self.chunk_delay_s = 0.0
        self.handler: Handler | None = None
        self.load = 0  # what /load answers
        self.stored: set[str] = set()  # response ids /v1/responses/{id} knows
        self.disconnected = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = port

    @property
    def http_addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.http_addr}"

    def answer(self) -> bytes:
        return json.dumps(
            {
                "id": "cmpl-x",
                "object": "text_completion",
                "choices": [{"index": 0, "text": self.name}],
            }
        ).encode()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        # vLLM's other generations whose request models carry kv_transfer_params
        for path in (
            "/v1/responses",
            "/v1/messages",
            "/invocations",
            "/inference/v1/generate",
        ):
            app.router.add_post(path, self._handle)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._echo_path)
        app.router.add_get("/load", self._load)
        app.router.add_route("*", "/{tail:.*}", self._echo_any)
        return app

    async def start(self) -> FakeInstance:
        self._runner = web.AppRunner(
            self.app(), handler_cancellation=True, access_log=None
        )
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
        if self.record:
            self.requests.append(Seen(request.path, request.headers.copy(), body))
        if not isinstance(body, dict):  # as vLLM's FastAPI validation answers
            return web.json_response(
                {
                    "error": {
                        "message": f"{self.name}: not an object",
                        "type": "Bad Request",
                        "param": "body",
                        "code": 400,
                    }
                },
                status=400,
            )
        try:
            if self.handler is not None:
                return await self.handler(self, request, body)
            if self.hang:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.delay_s)
            if self.status != 200:
                return web.json_response(
                    {"error": {"message": self.name}}, status=self.status
                )
            if body.get("stream"):
                return await self._stream(request)
            return web.Response(body=self.answer(), content_type="application/json")
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected.set()
            raise

    async def _models(self, request: web.Request) -> web.Response:
        if (
            self.api_key
            and request.headers.get("Authorization") != f"Bearer {self.api_key}"
        ):
            return web.json_response({"error": "Unauthorized"}, status=401)
        if self.models is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response({"object": "list", "data": self.models})

    async def _echo_path(self, request: web.Request) -> web.Response:
        return web.json_response({"path": request.path_qs, "by": self.name})

    async def _load(self, request: web.Request) -> web.Response:
        return web.json_response({"server_load": self.load})

    async def _echo_any(self, request: web.Request) -> web.Response:
        """Any other request, recorded and described: what was asked, of
        whom, with which body as it came. A stored response's routes answer
        404 for ids not in ``stored``, as vLLM does."""
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        if self.record:
            self.requests.append(Seen(request.path_qs, request.headers.copy(), body))
        parts = request.path.split("/")
        stored = parts[1:3] == ["v1", "responses"] and parts[3:] not in ([], ["render"])
        if stored and parts[3] not in self.stored:
            return web.json_response({"error": {"code": 404}}, status=404)
        return web.json_response(
            {
                "path": request.path_qs,
                "method": request.method,
                "by": self.name,
                "content_type": request.headers.get("Content-Type"),
                "raw": raw.decode("latin-1"),
            }
        )

    async def _health(self, request: web.Request) -> web.Response:
        if self.hang:
            await asyncio.sleep(3600)
        return web.Response(status=self.health_status)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8"}
        )
        await resp.prepare(request)
        for i, chunk in enumerate(self.chunks):
            if i:
                await asyncio.sleep(self.chunk_delay_s)
            await resp.write(chunk)
        await resp.write_eof()
        return resp


# --- token_stream: a completion of max_tokens tokens --------------------------

MAX_TOKENS = 256  # what token_stream answers at most
DELAY_KEY = "fake_chunk_delay_ms"  # a request body's pause between chunks


def _compact(payload: dict) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def _completion(model: str, choices: list[dict], **extra: Any) -> dict:
    return {
        "id": "cmpl-fake",
        "object": "text_completion",
        "created": 0,
        "model": model,
        "choices": choices,
        **extra,
    }


def _usage(n: int) -> dict:
    return {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}


@functools.cache
def token_chunk(model: str, i: int) -> bytes:
    """The SSE event of token ``i`` (`` t<i>``), as vLLM streams a completion."""
    choice = {
        "index": 0,
        "text": f" t{i}",
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
    }
    return b"data: " + _compact(_completion(model, [choice])) + b"\n\n"


@functools.cache
def usage_chunk(model: str, n: int) -> bytes:
    return b"data: " + _compact(_completion(model, [], usage=_usage(n))) + b"\n\n"


@functools.cache
def token_answer(model: str, n: int) -> bytes:
    """The JSON answer of ``n`` tokens, not streamed."""
    choice = {
        "index": 0,
        "text": "".join(f" t{i}" for i in range(n)),
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    return _compact(_completion(model, [choice], usage=_usage(n)))


async def token_stream(
    fake: FakeInstance, request: web.Request, body: dict[str, Any]
) -> web.StreamResponse:
    """A :data:`Handler`: ``max_tokens`` tokens at once, or streamed with the body's
    ``fake_chunk_delay_ms`` between chunks and the usage chunk when asked for."""
    model = (fake.models or [{"id": fake.name}])[0]["id"]
    n = max(1, min(int(body.get("max_tokens") or 1), MAX_TOKENS))
    if not body.get("stream"):
        return web.Response(
            body=token_answer(model, n), content_type="application/json"
        )
    delay = float(body.get(DELAY_KEY) or 0) / 1000
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8"}
    )
    await resp.prepare(request)
    for i in range(n):
        if i and delay:
            await asyncio.sleep(delay)
        await resp.write(token_chunk(model, i))
    if (body.get("stream_options") or {}).get("include_usage"):
        await resp.write(usage_chunk(model, n))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


# --- a process of its own -----------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Serve one fake on ``--port`` until killed (the router benchmark's backends)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake-model", help="what /v1/models lists")
    parser.add_argument(
        "--tokens",
        action="store_true",
        help="answer max_tokens tokens (token_stream), not the name",
    )
    args = parser.parse_args(argv)
    fake = FakeInstance(args.name, port=args.port, record=False)
    fake.models = [{"id": args.model}]
    if args.tokens:
        fake.handler = token_stream
    web.run_app(
        fake.app(), host="127.0.0.1", port=args.port, access_log=None, print=None
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
