"""Migration attacked: a careless client's options, and a decode that breaks
vLLM's stream format, ends twice or floods the router.

Each test sends a request through an in-process router whose first decode
misbehaves (or whose client body is odd) and a second decode that generates
deterministically; it checks what the client got, what the continuation
was asked and that every lease came back.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from vllm_disagg.router.migration import StreamLedger
from vllm_disagg.wire.discovery import Role

PROMPT_IDS = [5, 6, 7]
STREAM = {"model": "m", "prompt": "x", "max_tokens": 20, "stream": True}
CHAT_STREAM = {
    "model": "m",
    "messages": [{"role": "user", "content": "x"}],
    "stream": True,
}


def next_token(ids: list[int]) -> int:
    return (sum(ids) * 31 + len(ids)) % 997 + 3


def greedy(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(next_token([*prompt, *out]))
    return out


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def events_of(data: bytes) -> list:
    out = []
    for e in data.split(b"\n\n"):
        if e.startswith(b"data: "):
            payload = e[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def chunk(ids, *, prompt=None, finish=None, text="t", cid="cmpl-1") -> dict:
    return {
        "id": cid,
        "object": "text_completion",
        "created": 100,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "prompt_token_ids": prompt,
                "token_ids": ids,
            }
        ],
    }


def chat_chunk(ids, *, prompt=None, finish=None, text="t", cid="chat-1") -> dict:
    out = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": 100,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish,
                "token_ids": ids,
            }
        ],
    }
    if prompt is not None:
        out["prompt_token_ids"] = prompt
    return out


async def generating(fake, request, body):
    """An honest decode: greedy tokens from its prompt, one event each."""
    prompt = body.get("prompt")
    prompt = PROMPT_IDS if not isinstance(prompt, list) else list(prompt)
    limit = body.get("max_tokens") or 20
    chat = request.path.endswith("/chat/completions")
    make = chat_chunk if chat else chunk
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    ids: list[int] = []
    for i in range(limit):
        tok = next_token([*prompt, *ids])
        ids.append(tok)
        await resp.write(
            event(
                make(
                    [tok] if body.get("return_token_ids") else None,
                    prompt=prompt if i == 0 and body.get("return_token_ids") else None,
                    finish="length" if i == limit - 1 else None,
                    cid=f"cmpl-{fake.name}",
                )
            )
        )
    await resp.write(b"data: [DONE]\n\n")
    return resp


Script = Callable[[Any, web.Request, dict, web.StreamResponse], Awaitable[None]]


def first_then_honest(script: Script, calls: list):
    """The first request any decode gets runs ``script`` on an open SSE
    response (then the connection is cut); every later one is honest."""

    async def handler(fake, request, body):
        calls.append((fake.name, body))
        if len(calls) > 1:
            return await generating(fake, request, body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await script(fake, request, body, resp)
        request.transport.close()
        return resp

    return handler


async def fleet(fakes, start_router, script: Script, **config):
    router = await start_router(**config)
    p, d1, d2 = await fakes("p"), await fakes("d1"), await fakes("d2")
    router.add(p, Role.PREFILL)
    router.add(d1, Role.DECODE)
    router.add(d2, Role.DECODE)
    calls: list = []
    d1.handler = d2.handler = first_then_honest(script, calls)
    return router, calls


async def settled(router) -> None:
    """Every lease came back: no instance counts a request in flight."""
    async with asyncio.timeout(5):
        while any(
            router.registry.get(f"{n}-id").outstanding for n in ("p", "d1", "d2")
        ):
            await asyncio.sleep(0.01)


def tokens(n: int, *, chat: bool = False, finish_last: bool = False) -> list[bytes]:
    make = chat_chunk if chat else chunk
    ids = greedy(PROMPT_IDS, n)
    return [
        event(
            make(
                [tok],
                prompt=PROMPT_IDS if i == 0 else None,
                finish="length" if finish_last and i == n - 1 else None,
            )
        )
        for i, tok in enumerate(ids)
    ]


def resumed(router, why: str) -> float:
    return router.metric(
        "vllm_disagg_router_migrations_total", outcome="resumed", reason=why
    )


# --- a stream that ended for the client is never continued ------------------


@pytest.mark.parametrize("after_done", ["broken", "stalled"])
async def test_a_stream_that_sent_done_is_not_continued(
    fakes, start_router, after_done
):
    async def done_then_fails(fake, request, body, resp):
        for e in tokens(3, finish_last=True):
            await resp.write(e)
        await resp.write(b"data: [DONE]\n\n")
        if after_done == "stalled":
            await asyncio.sleep(3600)

    router, calls = await fleet(
        fakes, start_router, done_then_fails, chunk_timeout_s=0.3
    )
    status, raw, _ = await router.post("/v1/completions", STREAM)
    chunks = events_of(raw)
    assert status == 200 and chunks.count("[DONE]") == 1 and chunks[-1] == "[DONE]"
    assert len(chunks) == 4 and len(calls) == 1
    assert resumed(router, after_done) == 0
    await settled(router)


async def test_events_after_done_are_not_relayed(fakes, start_router):
    async def done_twice(fake, request, body, resp):
        for e in tokens(2, finish_last=True):
            await resp.write(e)
        await resp.write(b"data: [DONE]\n\n" + event(chunk([1])) + b"data: [DONE]\n\n")
        await resp.write_eof()

    router, calls = await fleet(fakes, start_router, done_twice)
    status, raw, _ = await router.post("/v1/completions", STREAM)
    chunks = events_of(raw)
    assert chunks.count("[DONE]") == 1 and chunks[-1] == "[DONE]" and len(chunks) == 3
    await settled(router)


# --- a careless client: limits written as strings or floats -----------------


def dies_after(n: int, *, chat: bool = False) -> Script:
    async def script(fake, request, body, resp):
        for e in tokens(n, chat=chat):
            await resp.write(e)
        await asyncio.sleep(0.02)

    return script


@pytest.mark.parametrize("limit", ["20", 20.0, " 20 "])
async def test_a_limit_vllm_reads_as_a_number_carries_over(fakes, start_router, limit):
    router, calls = await fleet(fakes, start_router, dies_after(6))
    body = {**STREAM, "max_tokens": limit, "min_tokens": str(10)}
    status, raw, _ = await router.post("/v1/completions", body)
    chunks = events_of(raw)
    assert status == 200 and chunks[-1] == "[DONE]"
    cont = calls[1][1]
    assert cont["max_tokens"] == 14 and cont["min_tokens"] == 4
    assert len(chunks) == 21  # 20 tokens, as asked, and [DONE]
    await settled(router)


@pytest.mark.parametrize("limit", ["9", 9.0])
async def test_a_chat_limit_written_as_text_carries_over(fakes, start_router, limit):
    router, calls = await fleet(fakes, start_router, dies_after(3, chat=True))
    body = {**CHAT_STREAM, "max_completion_tokens": limit}
    status, raw, _ = await router.post("/v1/chat/completions", body)
    chunks = events_of(raw)
    assert status == 200 and chunks[-1] == "[DONE]", chunks[-3:]
    assert calls[1][1]["max_tokens"] == 6
    assert len(chunks) == 10 and not any("error" in c for c in chunks[:-1])
    await settled(router)


@pytest.mark.parametrize(("include_usage", "usage"), [("false", False), ("t", True)])
async def test_usage_is_sent_on_close_only_when_vllm_would(
    fakes, start_router, include_usage, usage
):
    router, calls = await fleet(
        fakes, start_router, lambda f, r, b, resp: finished_then_dies(resp)
    )
    body = {**STREAM, "stream_options": {"include_usage": include_usage}}
    status, raw, _ = await router.post("/v1/completions", body)
    chunks = events_of(raw)
    assert chunks[-1] == "[DONE]" and len(calls) == 1
    assert any("usage" in c for c in chunks[:-1]) is usage
    await settled(router)


async def finished_then_dies(resp):
    for e in tokens(3, finish_last=True):
        await resp.write(e)
    await asyncio.sleep(0.02)


# --- a decode that does not speak vLLM's format -----------------------------


def first_chunk_with(**changes) -> dict:
    out = chunk(greedy(PROMPT_IDS, 1), prompt=PROMPT_IDS)
    out["choices"][0].update(changes)
    return out


MALFORMED = {
    "choices_not_a_list": {**chunk([9], prompt=PROMPT_IDS), "choices": 5},
    "choice_not_an_object": {**chunk([9], prompt=PROMPT_IDS), "choices": [5]},
    "text_not_a_string": first_chunk_with(text=5),
    "token_ids_not_ints": first_chunk_with(token_ids=["x"]),
    "token_ids_bools": first_chunk_with(token_ids=[True]),
    "prompt_ids_not_ints": first_chunk_with(prompt_token_ids=[1.5, None]),
    "delta_content_not_a_string": first_chunk_with(delta={"content": 5}),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
async def test_a_decode_that_breaks_the_format_ends_the_stream_closed(
    fakes, start_router, name
):
    async def malformed_then_dies(fake, request, body, resp):
        await resp.write(event(MALFORMED[name]))
        for e in tokens(3)[1:]:
            await resp.write(e)
        await asyncio.sleep(0.02)

    router, calls = await fleet(fakes, start_router, malformed_then_dies)
    status, raw, _ = await router.post("/v1/completions", STREAM)
    chunks = events_of(raw)
    assert status == 200 and chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    assert "error" in chunks[-2]
    # Nothing the broken decode said became another instance's prompt.
    assert len(calls) == 1
    await settled(router)


async def test_a_decode_past_the_requests_limit_is_not_continued(fakes, start_router):
    """A decode that sent more tokens than ``max_tokens`` and then died: the
    client gets what it sent and an error, never a continuation built on a
    ledger nothing honest produced (and the ledger stops growing)."""

    async def too_many_then_dies(fake, request, body, resp):
        for e in tokens(8):
            await resp.write(e)
        await asyncio.sleep(0.02)

    router, calls = await fleet(fakes, start_router, too_many_then_dies)
    status, raw, _ = await router.post("/v1/completions", {**STREAM, "max_tokens": 5})
    chunks = events_of(raw)
    assert status == 200 and chunks[-1] == "[DONE]" and "error" in chunks[-2]
    assert len(calls) == 1
    assert (
        router.metric(
            "vllm_disagg_router_migrations_total",
            outcome="not_migratable",
            reason="over_limit",
        )
        == 1
    )
    await settled(router)


def test_the_ledger_keeps_no_more_than_the_limit():
    ledger = StreamLedger({"prompt": "x", "max_tokens": 3}, "/v1/completions", False)
    for e in tokens(6):
        ledger.feed(e)
    assert len(ledger.generated) == 3
    assert ledger.why_not_resumable() == "over_limit"


@pytest.mark.parametrize("name", sorted(MALFORMED))
async def test_a_continuation_that_breaks_the_format_ends_the_stream(
    fakes, start_router, name
):
    router = await start_router()
    p, d1, d2 = await fakes("p"), await fakes("d1"), await fakes("d2")
    router.add(p, Role.PREFILL)
    router.add(d1, Role.DECODE)
    router.add(d2, Role.DECODE)
    calls = []

    async def handler(fake, request, body):
        calls.append(fake.name)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if len(calls) == 1:
            for e in tokens(3):
                await resp.write(e)
            await asyncio.sleep(0.02)
        else:
            await resp.write(event(MALFORMED[name]))
            await resp.write(b"data: [DONE]\n\n")
            await asyncio.sleep(0.02)
        request.transport.close()
        return resp

    d1.handler = d2.handler = handler
    status, raw, _ = await router.post("/v1/completions", STREAM)
    chunks = events_of(raw)
    assert status == 200 and chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    assert "error" in chunks[-2], chunks
    assert len(calls) == 2
    await settled(router)


# --- a decode that floods the router ---------------------------------------


def test_an_event_that_never_ends_is_buffered_in_linear_time_and_bounded():
    ledger = StreamLedger({"prompt": "x"}, "/v1/completions", False)
    piece = b"x" * 1024
    started = time.monotonic()
    out = ledger.feed(b"data: ")
    for _ in range(40 * 1024):  # 40 MiB without a blank line
        out += ledger.feed(piece)
        # Gathered anew at each piece, this took minutes.
        assert time.monotonic() - started < 5.0
        if out:
            break
    # The decode is not speaking SSE: the stream ends with an error.
    assert events_of(out)[-1] == "[DONE]" and "error" in events_of(out)[-2]
    assert ledger.done


# --- accounting: limits, leases, a client that leaves -----------------------


async def test_max_migrations_holds_when_every_decode_dies(fakes, start_router):
    router = await start_router(max_migrations=2)
    p = await fakes("p")
    router.add(p, Role.PREFILL)
    decodes = [await fakes(f"d{i}") for i in range(4)]
    calls = []

    async def always_dies(fake, request, body):
        calls.append(fake.name)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        prompt = body["prompt"] if isinstance(body["prompt"], list) else PROMPT_IDS
        ids = greedy(prompt, 2)
        for i, tok in enumerate(ids):
            await resp.write(event(chunk([tok], prompt=prompt if i == 0 else None)))
        await asyncio.sleep(0.02)
        request.transport.close()
        return resp

    for d in decodes:
        router.add(d, Role.DECODE)
        d.handler = always_dies
    status, raw, _ = await router.post("/v1/completions", STREAM)
    chunks = events_of(raw)
    assert chunks[-1] == "[DONE]" and "--max-migrations" in str(chunks[-2])
    assert len(calls) == 3 and len(set(calls)) == 3  # never a failed decode again
    assert len(chunks) == 2 + 2 + 2 + 2  # each sent 2 new tokens
    limit = router.metric(
        "vllm_disagg_router_migrations_total", outcome="limit", reason=""
    )
    assert limit == 1 and resumed(router, "broken") == 2
    for d in decodes:
        assert router.registry.get(f"{d.name}-id").outstanding == 0


async def test_a_client_that_leaves_while_the_continuation_opens(fakes, start_router):
    router = await start_router()
    p, d1, d2 = await fakes("p"), await fakes("d1"), await fakes("d2")
    router.add(p, Role.PREFILL)
    router.add(d1, Role.DECODE)
    router.add(d2, Role.DECODE)
    calls: list = []
    d1.handler = d2.handler = first_then_honest(dies_after(3), calls)
    continuing = asyncio.Event()

    async def continuation_prefill_hangs(fake, request, body):
        if isinstance(body.get("prompt"), list):  # the continuation's prefix
            continuing.set()
            await asyncio.sleep(3600)
        return web.json_response({"choices": [{"index": 0, "text": ""}]})

    p.handler = continuation_prefill_hangs
    async with asyncio.timeout(5):
        async with router.client.post(router.url + "/v1/completions", json=STREAM) as r:
            got = b""
            while got.count(b"\n\n") < 3:
                got += await r.content.readany()
            await continuing.wait()
        # The client is gone: the prefill leg is ended, every lease returned.
        await p.disconnected.wait()
    await settled(router)
    assert len(calls) == 1
    assert (
        router.metric(
            "vllm_disagg_router_requests_total",
            endpoint="completions",
            outcome="cancelled",
        )
        == 1
    )


CONTINUATION_ANSWERS = {
    "sse_without_a_byte": (200, "text/event-stream", b""),
    "json_200": (200, "application/json", b'{"choices": []}'),
    "status_500": (500, "application/json", b'{"error": {"code": 500}}'),
    "done_at_once": (200, "text/event-stream", b"data: [DONE]\n\n"),
}


@pytest.mark.parametrize("answer", sorted(CONTINUATION_ANSWERS))
async def test_a_continuation_that_answers_nothing_usable(fakes, start_router, answer):
    router = await start_router(max_migrations=3)
    p, d1, d2 = await fakes("p"), await fakes("d1"), await fakes("d2")
    router.add(p, Role.PREFILL)
    router.add(d1, Role.DECODE)
    router.add(d2, Role.DECODE)
    calls: list = []
    status, ctype, payload = CONTINUATION_ANSWERS[answer]

    async def handler(fake, request, body):
        calls.append(fake.name)
        if len(calls) == 1:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for e in tokens(3):
                await resp.write(e)
            await asyncio.sleep(0.02)
            request.transport.close()
            return resp
        return web.Response(status=status, body=payload, content_type=ctype)

    d1.handler = d2.handler = handler
    status, raw, _ = await router.post("/v1/completions", STREAM)
    chunks = events_of(raw)
    assert status == 200 and chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    assert len(calls) == 2 and calls[0] != calls[1]
    # Never a clean end short of the tokens owed.
    assert "error" in chunks[-2] and len(chunks) == 3 + 2
    await settled(router)


async def test_an_error_event_after_tokens_is_relayed_once_and_not_moved(
    fakes, start_router
):
    async def error_then_dies(fake, request, body, resp):
        for e in tokens(2):
            await resp.write(e)
        await resp.write(event({"error": {"code": 500, "message": "boom"}}))
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.02)

    router, calls = await fleet(fakes, start_router, error_then_dies)
    status, raw, _ = await router.post("/v1/completions", STREAM)
    chunks = events_of(raw)
    assert chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    assert chunks[-2]["error"]["message"] == "boom" and len(calls) == 1
    await settled(router)


async def test_events_split_at_every_byte_join_as_sent(fakes, start_router):
    async def byte_by_byte(fake, request, body, resp):
        for e in tokens(4):
            for i in range(len(e)):
                await resp.write(e[i : i + 1])
        await asyncio.sleep(0.02)

    router, calls = await fleet(fakes, start_router, byte_by_byte)
    status, raw, _ = await router.post("/v1/completions", STREAM)
    chunks = events_of(raw)
    assert chunks[-1] == "[DONE]" and len(chunks) == 21
    assert not any("error" in c for c in chunks[:-1])
    assert calls[1][1]["prompt"] == [*PROMPT_IDS, *greedy(PROMPT_IDS, 4)]
    await settled(router)


async def test_a_decode_that_drips_after_done_ends_nothing_more(fakes, start_router):
    async def done_then_drips(fake, request, body, resp):
        for e in tokens(3, finish_last=True):
            await resp.write(e)
        await resp.write(b"data: [DONE]\n\n")
        for _ in range(100):  # past the request deadline
            await asyncio.sleep(0.05)
            await resp.write(b":")

    router, calls = await fleet(
        fakes, start_router, done_then_drips, request_timeout_s=1.0
    )
    status, raw, _ = await router.post("/v1/completions", STREAM)
    chunks = events_of(raw)
    assert chunks.count("[DONE]") == 1 and chunks[-1] == "[DONE]", chunks[-3:]
    assert len(calls) == 1
    await settled(router)
