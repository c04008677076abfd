"""Clients cannot hold the router's connections or memory: headers, heads
that never end, bodies and answers that stall, and too many connections are
cut, counted, and cost nobody else anything (router/client_limits.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import pytest
from aiohttp import web

from tests.router.conftest import WAIT_S

pytestmark = pytest.mark.asyncio

LIMITS = dict(
    max_header_bytes=4096, client_header_timeout_s=0.5, client_idle_timeout_s=0.5
)


async def _connect(router) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    port = router.state.http_port
    return await asyncio.open_connection("127.0.0.1", port)


async def _closed_by_peer(
    reader: asyncio.StreamReader, within_s: float = WAIT_S
) -> bytes:
    """What the router sent before it closed the connection (EOF or reset)."""
    data = b""
    async with asyncio.timeout(within_s):
        try:
            while chunk := await reader.read(65536):
                data += chunk
        except ConnectionResetError:
            pass
    return data


def _closed(router, reason: str) -> float:
    return router.metric(
        "vllm_disagg_router_client_connections_closed_total", reason=reason
    )


async def _healthy_request_works(router) -> None:
    status, body, _ = await router.post(
        "/v1/completions", {"model": "m", "prompt": "x"}
    )
    assert status == 200, body


async def test_a_connection_that_sends_nothing_is_closed(pd):
    router, _, _ = await pd(**LIMITS)
    reader, writer = await _connect(router)
    await _closed_by_peer(reader, within_s=3.0)
    writer.close()
    assert _closed(router, "header_timeout") == 1
    await _healthy_request_works(router)


async def test_headers_sent_a_line_at_a_time_are_cut_at_the_deadline(pd):
    router, _, _ = await pd(**LIMITS)
    reader, writer = await _connect(router)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    sent = 0
    with contextlib.suppress(ConnectionError):
        for i in range(40):  # 4 s of dribbling against a 0.5 s deadline
            writer.write(f"X-Slow-{i}: y\r\n".encode())
            await writer.drain()
            sent += 1
            await asyncio.sleep(0.1)
            if reader.at_eof():
                break
    await _closed_by_peer(reader, within_s=3.0)
    writer.close()
    assert sent < 20, sent  # cut near the deadline, not after the client gave up
    assert _closed(router, "header_timeout") == 1


@pytest.mark.parametrize("shape", ["one_huge_header", "many_small_headers"])
async def test_headers_past_the_limit_get_431_and_memory_is_not_taken(pd, shape):
    router, _, d = await pd(**LIMITS)
    reader, writer = await _connect(router)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    with contextlib.suppress(ConnectionError):
        for _ in range(
            64
        ):  # 64 x 16 KiB, far past the 4 KiB limit; the head never ends
            if shape == "one_huge_header" and not _:
                writer.write(b"X-Big: ")
            line = b"a" * 16384 if shape == "one_huge_header" else b"X-A: b\r\n" * 2048
            writer.write(line)
            await writer.drain()
    answer = await _closed_by_peer(reader)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:80]
    assert _closed(router, "headers_too_large") == 1
    assert not d.requests
    await _healthy_request_works(router)


async def test_headers_under_the_limit_pass(pd):
    router, _, _ = await pd(**LIMITS)
    headers = {f"X-H{i}": "v" * 40 for i in range(40)}  # about 2 KiB
    status, body, _ = await router.post(
        "/v1/completions", {"model": "m", "prompt": "x"}, headers=headers
    )
    assert status == 200, body


async def test_a_body_that_stops_arriving_is_dropped_and_nothing_is_sent_upstream(pd):
    router, p, d = await pd(**LIMITS)
    reader, writer = await _connect(router)
    body = json.dumps({"model": "m", "prompt": "x" * 1000}).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b"application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:100]
    )
    await writer.drain()
    await _closed_by_peer(reader, within_s=3.0)
    writer.close()
    assert _closed(router, "body_timeout") == 1
    assert not p.requests and not d.requests
    await _healthy_request_works(router)


async def test_a_slow_but_moving_body_is_read_whole(pd):
    router, _, d = await pd(**LIMITS)
    reader, writer = await _connect(router)
    body = json.dumps({"model": "m", "prompt": "y" * 200}).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b"application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    for i in range(
        0, len(body), 40
    ):  # 1.2 s in all, 0.2 s between pieces (limit 0.5 s)
        writer.write(body[i : i + 40])
        await writer.drain()
        await asyncio.sleep(0.2)
    async with asyncio.timeout(WAIT_S):
        status_line = await reader.readline()
    writer.close()
    assert status_line.startswith(b"HTTP/1.1 200"), status_line
    assert d.requests and d.requests[0].body["prompt"] == "y" * 200
    assert _closed(router, "body_timeout") == 0


async def test_a_client_that_stops_reading_its_stream_is_dropped_and_decode_released(
    pd,
):
    router, _, d = await pd(**LIMITS)
    # An answer larger than any socket buffer (up to 256 MiB), which the client never
    # reads.
    chunk = (
        b"data: " + json.dumps({"choices": [{"text": "z" * 65536}]}).encode() + b"\n\n"
    )

    async def endless(fake, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for _ in range(4096):
                await resp.write(chunk)
        except (asyncio.CancelledError, ConnectionResetError):
            fake.disconnected.set()
            raise
        return resp

    d.handler = endless
    reader, writer = await _connect(router)
    body = json.dumps({"model": "m", "prompt": "x", "stream": True}).encode()
    writer.get_extra_info("socket").setsockopt(
        socket.SOL_SOCKET, socket.SO_RCVBUF, 4096
    )
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b"application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    await writer.drain()
    writer.transport.pause_reading()  # the client stops reading
    async with asyncio.timeout(3 * WAIT_S):  # an upper bound for a loaded host
        while _closed(router, "write_timeout") == 0:
            await asyncio.sleep(0.1)
        await (
            d.disconnected.wait()
        )  # the decode leg was closed: vLLM aborts the request
    writer.close()
    d.handler = None
    await _healthy_request_works(router)


async def test_connections_past_the_limit_are_answered_503_and_others_still_served(pd):
    router, _, _ = await pd(**LIMITS, max_connections=3)
    held = [await _connect(router) for _ in range(3)]
    reader, writer = await _connect(router)
    answer = await _closed_by_peer(reader)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 503 "), answer[:80]
    assert b'"code":503' in answer
    assert _closed(router, "too_many_connections") == 1
    for _, w in held:
        w.close()
    await asyncio.sleep(0.2)  # the router sees the closes
    await _healthy_request_works(router)


async def test_a_body_trickled_byte_by_byte_is_cut_at_the_body_deadline(pd):
    """A byte every few seconds defeats any idle timeout: slow bodies held
    --max-connections slots for as long as they liked."""
    router, p, d = await pd(**LIMITS, client_body_timeout_s=1.0)
    reader, writer = await _connect(router)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b"application/json\r\n"
        b"Content-Length: 1000\r\n\r\n"
    )
    started = asyncio.get_running_loop().time()
    with contextlib.suppress(ConnectionError):
        for _ in range(40):  # 0.2 s apart: never idle for 0.5 s, 8 s in all
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(0.2)
            if reader.at_eof():
                break
    await _closed_by_peer(reader, within_s=3.0)
    writer.close()
    assert asyncio.get_running_loop().time() - started < 4.0
    assert _closed(router, "body_timeout") == 1
    assert not p.requests and not d.requests


async def test_pipelined_requests_past_the_limit_drop_the_connection(pd):
    """Uvicorn queues any number of pipelined requests, each with its head:
    a client that sent them and read nothing grew the router without bound."""
    router, p, d = await pd(**LIMITS)
    d.delay_s = 2.0  # the first answer takes a while: the rest queue behind it
    reader, writer = await _connect(router)
    body = json.dumps({"model": "m", "prompt": "x"}).encode()
    one = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b"application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    with contextlib.suppress(ConnectionError):
        writer.write(one * 100)
        await writer.drain()
    await _closed_by_peer(reader)
    writer.close()
    assert _closed(router, "too_many_pipelined") == 1
    assert len(p.requests) <= 1


async def test_junk_connections_are_counted_each_but_logged_once_per_interval(
    pd, caplog
):
    """Uvicorn warns once per request its parser refuses: a stranger sending
    junk wrote one log line per connection."""
    router, _, _ = await pd(**LIMITS)
    with caplog.at_level("WARNING"):
        for _ in range(20):
            reader, writer = await _connect(router)
            writer.write(b"\x16\x03\x01 not http at all\r\n\r\n")
            await _closed_by_peer(reader)
            writer.close()
    assert _closed(router, "invalid_http") == 20
    lines = [
        r for r in caplog.records if "Invalid HTTP request received" in r.getMessage()
    ]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    await _healthy_request_works(router)
