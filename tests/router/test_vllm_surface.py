"""vLLM's routes beyond completions and chats, through the router (fakes):
which are disaggregated and with which prefill body, which one decode
answers as they came, and the smaller ways the router answers as
``vllm serve`` (body encodings, ``kv_transfer_params`` that is no object,
CORS headers)."""

from __future__ import annotations

import asyncio
import json

import pytest

from vllm_disagg.router.routes import DECODE_ALONE
from vllm_disagg.wire.discovery import Role

from .conftest import WAIT_S


def _paths(fake) -> list[str]:
    return [seen.path for seen in fake.requests]


async def _request(router, method: str, path: str, data=None, headers=None):
    async with asyncio.timeout(WAIT_S):
        async with router.client.request(
            method, router.url + path, data=data, headers=headers or {}
        ) as resp:
            return resp.status, await resp.read(), resp


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 9}),
        ("/v1/messages", {"model": "m", "messages": [], "max_tokens": 9}),
        ("/invocations", {"model": "m", "prompt": "hi", "max_tokens": 9}),
        (
            "/inference/v1/generate",
            {
                "model": "m",
                "token_ids": [1, 2],
                "sampling_params": {"max_tokens": 9, "min_tokens": 2, "seed": 3},
            },
        ),
    ],
)
async def test_generations_with_kv_transfer_params_are_disaggregated(pd, path, body):
    router, p, d = await pd()
    status, _, _ = await router.post(path, {**body, "stream": True})
    assert status == 200
    assert _paths(p) == _paths(d) == [path]
    prefill, decode = p.requests[0].body, d.requests[0].body
    assert prefill["stream"] is False and decode["stream"] is True
    assert (
        prefill["kv_transfer_params"]["p2p_request_key"]
        == (decode["kv_transfer_params"]["p2p_request_key"])
    )
    if path == "/v1/responses":
        assert prefill["max_output_tokens"] == 1 and "max_tokens" not in prefill
        assert prefill["store"] is False and prefill["background"] is False
        assert decode["max_output_tokens"] == 9 and "store" not in decode
    elif path == "/inference/v1/generate":
        assert prefill["sampling_params"] == {"max_tokens": 1, "seed": 3}
        assert decode["sampling_params"] == body["sampling_params"]
        assert "max_tokens" not in prefill
    else:
        assert prefill["max_tokens"] == 1 and decode["max_tokens"] == 9
    # vLLM's own P/D marker, which skips the Messages model's thinking budget
    # check, on the prefill leg of /v1/messages only.
    marked = prefill["kv_transfer_params"].get("do_remote_decode")
    assert marked is (True if path == "/v1/messages" else None)
    assert "do_remote_decode" not in decode["kv_transfer_params"]


@pytest.mark.parametrize(
    "path, body, reason",
    [
        (
            "/v1/responses",
            {"model": "m", "input": "hi", "previous_response_id": "resp_1"},
            "stored_response",
        ),
        (
            "/v1/responses",
            {"model": "m", "input": "x", "max_output_tokens": 0},
            "invalid",
        ),
        (
            "/inference/v1/generate",
            {"token_ids": [1], "sampling_params": {"prompt_logprobs": 1}},
            "prompt_logprobs",
        ),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": 3}, "invalid"),
        ("/v1/chat/completions/batch", {"model": "m", "messages": [[]]}, None),
    ],
)
async def test_what_the_prefill_cannot_serve_goes_to_the_decode_alone(
    pd, path, body, reason
):
    router, p, d = await pd()
    status, _, _ = await router.post(path, body)
    assert status == 200 and not p.requests and _paths(d) == [path]
    reason = reason or "no_kv_transfer_params"
    fallbacks = "vllm_disagg_router_decode_prefill_fallbacks_total"
    assert router.metric(fallbacks, reason=reason) == 1


@pytest.mark.parametrize("path", sorted(DECODE_ALONE))
async def test_decode_alone_posts_reach_one_decode_as_they_came(pd, path):
    """Content type, bytes and query as the client sent them: the decode
    answers with vLLM's own checks (media type, JSON errors, 403 where the
    feature is off)."""
    router, p, d = await pd()
    raw = b'{"model": "m", "prompt":'  # not even JSON
    status, body, _ = await _request(
        router, "POST", path + "?a=1", raw, {"Content-Type": "text/plain"}
    )
    assert status == 200 and not p.requests, body
    answer = json.loads(body)
    assert answer["path"] == path + "?a=1" and answer["raw"] == raw.decode()
    assert answer["content_type"] == "text/plain" and answer["by"] == "d"


async def test_decode_alone_posts_name_no_model_the_fleet_lacks(pd):
    router, p, d = await pd()
    status, body, _ = await router.post("/v1/messages/count_tokens", {"model": "z"})
    assert status == 404 and json.loads(body)["error"]["param"] == "model"
    assert not d.requests


async def test_get_routes_the_instances_share_come_from_a_decode(pd):
    router, p, d = await pd()
    for path in ("/openapi.json", "/docs", "/redoc"):
        status, body = await router.get(path)
        assert status == 200 and json.loads(body)["path"] == path
    assert not p.requests


async def test_a_stored_response_is_asked_of_each_decode_in_turn(start_router, fakes):
    router = await start_router()
    d1, d2 = await fakes("d1"), await fakes("d2")
    router.add(d1, Role.DECODE)
    router.add(d2, Role.DECODE)
    d2.stored.add("resp_2")
    status, body = await router.get("/v1/responses/resp_2?stream=false")
    assert status == 200 and json.loads(body)["by"] == "d2"
    assert json.loads(body)["path"] == "/v1/responses/resp_2?stream=false"
    status, body, _ = await router.post("/v1/responses/resp_2/cancel", {})
    assert status == 200 and json.loads(body)["by"] == "d2"
    status, _ = await router.get("/v1/responses/resp_9")
    assert status == 404
    d1.stored.add("a?b")  # an id is sent on as one, however it reads
    status, body = await router.get("/v1/responses/a%3Fb")
    assert status == 200 and json.loads(body)["path"] == "/v1/responses/a%3Fb"


async def test_aborts_reach_every_instance(pd):
    router, p, d = await pd()
    status, _, _ = await router.post(
        "/inference/v1/abort_requests", {"request_ids": []}
    )
    assert status == 200
    assert _paths(p) == _paths(d) == ["/inference/v1/abort_requests"]


async def test_load_sums_the_decodes_and_ping_is_readiness(start_router, fakes):
    router = await start_router()
    status, body = await router.get("/ping")
    assert (status, body) == (503, b"")
    d1, d2, p = await fakes("d1"), await fakes("d2"), await fakes("p")
    d1.load, d2.load = 2, 3
    router.add(d1, Role.DECODE)
    router.add(d2, Role.DECODE)
    router.add(p, Role.PREFILL)
    status, body = await router.get("/load")
    assert status == 200 and json.loads(body) == {"server_load": 5}
    for method in ("GET", "POST"):
        status, body, resp = await _request(router, method, "/ping")
        assert (status, body) == (200, b"") and "Content-Type" not in resp.headers


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-be", "utf-32"])
async def test_json_in_every_encoding_vllm_reads_is_read(pd, encoding):
    """Starlette's json.loads of the bytes: a UTF-8 byte-order mark, UTF-16
    and UTF-32 (with or without one) are JSON too."""
    router, p, d = await pd()
    text = json.dumps({"model": "m", "prompt": "é ☃", "max_tokens": 3})
    status, _, _ = await router.post("/v1/completions", text.encode(encoding))
    assert status == 200
    assert (
        d.requests[0].body["prompt"] == "é ☃" and p.requests[0].body["max_tokens"] == 1
    )


@pytest.mark.parametrize("params", [[], "x", 3, True])
async def test_kv_transfer_params_not_an_object_is_refused(pd, params):
    router, p, d = await pd()
    body = {"model": "m", "prompt": "hi", "kv_transfer_params": params}
    status, answer, _ = await router.post("/v1/completions", body)
    assert status == 400, answer
    assert json.loads(answer)["error"]["param"] == "kv_transfer_params"
    assert not p.requests  # the decode was only asked how vLLM words it


async def test_cors_as_vllms_default_middleware(pd):
    router, p, d = await pd()
    for headers in ({}, {"Origin": "https://example.com"}):
        status, _, resp = await router.post(
            "/v1/completions", {"model": "m", "prompt": "hi"}, headers=headers
        )
        assert status == 200 and resp.headers.getall("Vary") == ["Origin"]
        assert "Access-Control-Allow-Origin" not in resp.headers
    status, _, resp = await _request(router, "GET", "/no-such-path")
    assert status == 404 and resp.headers["Vary"] == "Origin"
    status, body, resp = await _request(
        router,
        "OPTIONS",
        "/v1/completions",
        headers={
            "Origin": "https://example.com",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "x-a",
        },
    )
    assert (status, body) == (400, b"Disallowed CORS origin")
    assert resp.headers["Access-Control-Allow-Headers"] == "x-a"
    assert resp.headers["Vary"].startswith("Origin, Access-Control-Request-Method")
    status, _, _ = await _request(router, "OPTIONS", "/v1/completions")
    assert status == 405  # no preflight: a method the route does not take


async def _raw(router, request: bytes) -> bytes:
    """The answer to ``request`` sent as it is (aiohttp would normalize it)."""
    port = router.state.http_port
    async with asyncio.timeout(WAIT_S):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        answer = await reader.read()
        writer.close()
    return answer


@pytest.mark.parametrize("path", [b"/v1/responses//x", b"/v1/responses/%2F%2Fx"])
async def test_a_double_slash_is_a_json_404_not_a_redirect(pd, path):
    """Werkzeug's merge_slashes answered a 308 to the client's Host."""
    router, p, d = await pd()
    answer = await _raw(
        router,
        b"GET " + path + b" HTTP/1.1\r\nHost: attacker.example\r\n"
        b"Connection: close\r\n\r\n",
    )
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404"), head
    assert b"location" not in head.lower()
    assert json.loads(body) == {"detail": "Not Found"}  # vLLM's (FastAPI's)
    await _request(router, "GET", "/v1/responses/x")
    assert _paths(d) == ["/v1/responses/x"]  # the route still matches


@pytest.mark.parametrize(
    ("request_line", "path"),
    [
        (b"GET /v1/responses/%2E%2E", "/v1/responses/%2E%2E"),
        (b"GET /v1/responses/.", "/v1/responses/%2E"),
        (b"POST /v1/responses/../cancel", "/v1/responses/%2E%2E/cancel"),
    ],
)
async def test_a_dot_segment_id_reaches_the_decode_as_that_id(pd, request_line, path):
    """The router's yarl dropped dot segments: %2E%2E reached D as /v1/."""
    router, p, d = await pd()
    await _raw(
        router,
        request_line + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
        b"Connection: close\r\n\r\n",
    )
    assert [s.path for s in d.requests] == [path]  # vLLM decodes it to the id


async def test_no_request_runs_code_in_a_thread(pd, monkeypatch):
    """Every hook and view is a coroutine: Quart runs a plain function in the
    loop's executor, which cost two thread hops per request and grew the
    router by six threads under load (the chaos suite's thread bound)."""
    router, p, d = await pd()
    handed: list[object] = []
    loop = asyncio.get_running_loop()
    original = loop.run_in_executor

    def spy(executor, func, *args):
        handed.append(func)
        return original(executor, func, *args)

    monkeypatch.setattr(loop, "run_in_executor", spy)
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    for stream in (False, True):
        status, _, _ = await router.post("/v1/completions", {**body, "stream": stream})
        assert status == 200
    for path in ("/metrics", "/health", "/v1/models", "/no-such-path"):
        await router.get(path)
    await _request(
        router,
        "OPTIONS",
        "/v1/completions",
        headers={"Origin": "https://e.com", "Access-Control-Request-Method": "POST"},
    )
    assert handed == []
