"""The router's own endpoints and the requests it refuses itself."""

from __future__ import annotations

import asyncio
import json

from vllm_disagg.wire.discovery import Role

from .conftest import WAIT_S

BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}


async def test_no_instances_at_all_is_a_503_json_error(start_router):
    router = await start_router()
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, body, resp = await router.post(path, BODY)
        assert status == 503 and resp.headers["Content-Type"] == "application/json"
        assert json.loads(body)["error"] == {
            "message": "no healthy decode instance is registered",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    assert (
        router.metric(
            "vllm_disagg_router_requests_total",
            endpoint="completions",
            outcome="no_instance",
        )
        == 1
    )


BROKEN_BODIES = (
    b"{not json",
    b"[1, 2]",
    b"",
    b'"text"',
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
)  # was a 500 and a traceback


async def test_malformed_bodies_are_refused_by_a_decode_as_vllm_refuses_them(pd):
    """Upstream vLLM's FastAPI validation names the position of a JSON error; a
    decode says it exactly, before any compute, and nothing is prefilled."""
    router, p, d = await pd()
    for raw in BROKEN_BODIES:
        status, body, _ = await router.post("/v1/completions", raw)
        assert status == 400, raw
        assert json.loads(body)["error"]["message"] == "d: not an object", body
    assert not p.requests and len(d.requests) == len(BROKEN_BODIES)
    assert all("kv_transfer_params" not in (r.body or {}) for r in d.requests)
    assert router.metric(
        "vllm_disagg_router_requests_total",
        endpoint="completions",
        outcome="bad_request",
    ) == len(BROKEN_BODIES)


async def test_malformed_bodies_without_a_decode_get_the_routers_own_400(start_router):
    router = await start_router()
    for raw in BROKEN_BODIES:
        status, body, _ = await router.post("/v1/completions", raw)
        assert status == 400, raw
        error = json.loads(body)["error"]
        assert error["type"] == "Bad Request" and error["param"] == "body", (
            error
        )  # as vLLM
    assert router.metric(
        "vllm_disagg_router_requests_total",
        endpoint="completions",
        outcome="bad_request",
    ) == len(BROKEN_BODIES)


async def test_error_messages_name_no_local_path(start_router, fakes):
    """Upstream vLLM sanitizes its messages; a model's default name is its path."""
    router = await start_router()
    router.add(await fakes("d"), Role.DECODE, model="/tmp/models/tiny-llama")
    status, body, _ = await router.post("/v1/completions", {**BODY, "model": "x"})
    assert status == 404
    assert json.loads(body)["error"]["message"] == (
        "The model "
        "`x` does not exist. Valid aliases: <path>"  # vLLM's regexes eat the dot
    )


async def test_a_body_that_is_not_declared_json_gets_vllms_415_style_400(pd):
    router, p, d = await pd()
    for content_type in ("text/plain", "", "application/x-www-form-urlencoded"):
        status, body, _ = await router.post(
            "/v1/completions", BODY, headers={"Content-Type": content_type}
        )
        assert status == 400
        assert json.loads(body)["error"] == {
            "message": "1 validation error:\n  Unsupported Media Type: Only "
            "'application/json' is allowed",
            "type": "Bad Request",
            "param": None,
            "code": 400,
        }
    status, _, _ = await router.post(
        "/v1/completions",
        BODY,
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert status == 200 and len(p.requests) == 1


async def test_oversized_bodies_are_413_json(pd):
    router, p, d = await pd(max_body_bytes=2048)
    big = {**BODY, "prompt": "x" * 4096}
    status, body, _ = await router.post("/v1/completions", big)
    assert status == 413 and "2048" in json.loads(body)["error"]["message"]

    async def chunked():  # no Content-Length: the limit holds while reading
        for _ in range(8):
            yield b" " * 1024

    async with asyncio.timeout(WAIT_S):
        async with router.client.post(
            router.url + "/v1/completions",
            data=chunked(),
            headers={"Content-Type": "application/json"},
        ) as resp:
            assert resp.status == 413
    assert not p.requests and not d.requests
    status, _, _ = await router.post("/v1/completions", BODY)
    assert status == 200


async def test_health_follows_healthy_prefill_and_decode(start_router, fakes):
    router = await start_router(heartbeat_timeout_s=10.0)
    p, d = await fakes("p"), await fakes("d")

    async def health():
        status, body = await router.get("/health")
        return status, json.loads(body)

    assert await health() == (503, {"status": "unavailable", "prefill": 0, "decode": 0})
    router.add(p, Role.PREFILL)
    assert (await health())[0] == 503
    router.add(d, Role.DECODE)
    assert await health() == (200, {"status": "ready", "prefill": 1, "decode": 1})
    router.clock.advance(6.0)
    router.add(d, Role.DECODE)  # d heartbeats, p went silent
    router.clock.advance(6.0)
    assert await health() == (503, {"status": "unavailable", "prefill": 0, "decode": 1})


async def test_models_lists_what_decodes_serve_as_they_list_it(start_router, fakes):
    router = await start_router()
    status, body = await router.get("/v1/models")
    assert status == 200 and json.loads(body) == {"object": "list", "data": []}
    d = await fakes("d")
    d.models = [
        {
            "id": name,
            "object": "model",
            "created": 1,
            "owned_by": "vllm",
            "root": "/models/a",
            "parent": None,
            "max_model_len": 1024,
            "permission": [{"id": "modelperm-1"}],
        }
        for name in ("a", "a2")
    ]
    router.add(
        await fakes("p"), Role.PREFILL, model="b"
    )  # no decode serves b: not listed
    router.add(d, Role.DECODE, model="a", aliases=("a2",))
    router.add(await fakes("c"), Role.DECODE, model="c")  # lists nothing: minimal entry
    data = json.loads((await router.get("/v1/models"))[1])["data"]
    assert [m["id"] for m in data] == ["a", "a2", "c"]
    assert data[:2] == d.models  # vLLM's fields, as the decode lists them
    assert data[2]["object"] == "model" and data[2]["owned_by"] == "vllm"
    # An alias routes like the model's first name.
    status, body, _ = await router.post("/v1/completions", {**BODY, "model": "a2"})
    assert status == 503  # a's decode, but no prefill serves a: the alias was accepted


async def test_instances_lists_role_age_load_and_breaker(pd):
    router, p, d = await pd()
    router.clock.advance(2.5)
    status, body = await router.get("/instances")
    listing = {i["instance_id"]: i for i in json.loads(body)}
    assert status == 200 and set(listing) == {"p-id", "d-id"}
    assert listing["p-id"]["role"] == "prefill" and listing["d-id"]["role"] == "decode"
    assert listing["p-id"]["http_addr"] == p.http_addr
    assert listing["p-id"]["kv_addr"] == p.kv_addr
    assert (
        listing["p-id"]["age_s"] == 2.5 and listing["p-id"]["last_heartbeat_s"] == 2.5
    )
    assert (
        listing["p-id"]["outstanding"] == 0 and listing["p-id"]["breaker"] == "closed"
    )


async def test_static_instances_serve_without_registering(start_router, fakes):
    from vllm_disagg.router.config import StaticInstance

    p, d = await fakes("p"), await fakes("d")
    router = await start_router(
        static_prefill=(StaticInstance(p.http_addr, p.kv_addr),),
        static_decode=(StaticInstance(d.http_addr, d.kv_addr, "m"),),
    )
    router.clock.advance(3600.0)  # static instances never expire
    status, body, _ = await router.post("/v1/completions", BODY)
    assert status == 200 and body == d.answer()
    listing = json.loads((await router.get("/instances"))[1])
    assert all(i["static"] and i["last_heartbeat_s"] is None for i in listing)


async def test_metrics_exposition(pd):
    router, p, d = await pd()
    await router.post("/v1/completions", BODY)
    status, body = await router.get("/metrics")
    text = body.decode()
    assert status == 200
    for line in (
        'vllm_disagg_router_requests_total{endpoint="completions",outcome="ok"} 1.0',
        'vllm_disagg_router_instances{role="prefill"} 1.0',
        'vllm_disagg_router_instances{role="decode"} 1.0',
        'vllm_disagg_router_discovery_rejected_total{kind="unauthenticated"} 0.0',
        "vllm_disagg_router_added_latency_seconds_count 1.0",
        "vllm_disagg_router_breaker_opens_total 0.0",
    ):
        assert line in text, line


async def test_unknown_routes_answer_json(start_router):
    router = await start_router()
    status, body = await router.get("/v1/nothing")  # as vLLM's FastAPI app answers
    assert status == 404 and json.loads(body) == {"detail": "Not Found"}
    status, body = await router.get("/v1/completions")
    assert status == 405 and json.loads(body) == {"detail": "Method Not Allowed"}


async def test_tokenize_detokenize_and_version_are_answered_by_a_decode(pd):
    router, p, d = await pd()
    for path in ("/tokenize", "/detokenize"):
        status, body, _ = await router.post(path, {"model": "m", "prompt": "hi"})
        answer = json.loads(body)
        assert status == 200 and (answer["path"], answer["by"]) == (path, "d")
    status, body = await router.get("/version")
    assert status == 200 and json.loads(body) == {"path": "/version", "by": "d"}
    status, body, _ = await router.post("/tokenize", {"model": "zzz", "prompt": "hi"})
    assert status == 404 and json.loads(body)["error"]["param"] == "model"
    assert not p.requests


async def test_invalid_utf8_in_a_json_string_is_a_400_not_a_traceback(pd):
    router, p, d = await pd()
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, body, _ = await router.post(path, b'{"model":"m","prompt":"\xff\xfe"}')
        assert status == 400, (path, body)  # refused by the decode, as vLLM refuses it
    assert not p.requests
    assert (
        router.metric(
            "vllm_disagg_router_requests_total",
            endpoint="/tokenize",
            outcome="router_error",
        )
        == 0
    )


async def test_models_are_listed_only_to_clients_the_decodes_accept(
    start_router, fakes
):
    """A decode with --api-key refuses /v1/models without the key; the
    router listed every model to anyone."""
    router = await start_router()
    d = await fakes("d")
    d.api_key = "k1"
    d.models = [{"id": "a", "object": "model", "root": "/m"}]
    router.add(d, Role.DECODE, model="a")
    status, body = await router.get("/v1/models")
    assert status == 401
    async with router.client.get(
        router.url + "/v1/models", headers={"Authorization": "Bearer k1"}
    ) as resp:
        assert resp.status == 200 and (await resp.json())["data"] == d.models


async def test_instances_are_listed_to_the_routers_own_host_only(pd, monkeypatch):
    from vllm_disagg.router import app as app_module

    router, _, _ = await pd()
    monkeypatch.setattr(app_module, "is_loopback", lambda host: False)
    status, body = await router.get("/instances")
    assert status == 403 and json.loads(body) == {"detail": "Forbidden"}


async def test_model_names_in_router_errors_only_to_clients_the_decodes_accept(
    start_router, fakes
):
    """The router's own 404 (unknown model) and 400 (`model` missing among
    several) name the fleet's models; with --api-key decodes, a client
    without the key got those names, where vllm serve answers 401 first."""
    router = await start_router()
    decodes = {name: await fakes(f"d{name}") for name in ("a", "b")}
    for name, d in decodes.items():
        d.api_key = "k1"
        d.models = [{"id": name, "object": "model", "root": "/m"}]
        router.add(d, Role.DECODE, model=name)
    body = {"prompt": "x", "max_tokens": 2}
    for fields, known in (({"model": "zzz"}, 404), ({}, 400)):
        status, answer, _ = await router.post("/v1/completions", {**body, **fields})
        assert status == 401 and b"zzz" not in answer and b"a, b" not in answer
        status, answer, _ = await router.post(
            "/v1/completions",
            {**body, **fields},
            headers={"Authorization": "Bearer k1"},
        )
        assert status == known and b"a, b" in answer, answer
    # /tokenize and the other routes one decode answers alone: the same.
    status, answer, _ = await router.post("/tokenize", {"model": "zzz", "prompt": "x"})
    assert status == 401 and b"a, b" not in answer
