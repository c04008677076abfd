"""What the router sends to prefill and decode, and what it relays back."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from vllm_disagg.wire.discovery import Role
from vllm_disagg.wire.grants import GRANT_KEY, GrantError, check_grant
from vllm_disagg.wire.peers import (
    DECODE_ADDR_KEY,
    PREFILL_ADDR_KEY,
    REQUEST_KEY_KEY,
    parse_peer_info,
)

from .conftest import WAIT_S

COMPLETION = {
    "model": "m",
    "prompt": "San Francisco is a",
    "max_tokens": 10,
    "temperature": 0,
    "stop": ["\n"],
    "stop_token_ids": [7],
    "min_tokens": 3,
    "n": 2,
    "logprobs": 2,
}


async def test_completion_names_both_peers_and_relays_decode_bytes(pd):
    router, p, d = await pd()
    status, body, resp = await router.post("/v1/completions", COMPLETION)

    assert status == 200 and body == d.answer()
    assert resp.headers["Content-Type"] == "application/json"
    [prefill], [decode] = p.requests, d.requests
    request_id = prefill.headers["X-Request-Id"]
    assert decode.headers["X-Request-Id"] == request_id
    # The id, which vLLM puts in the response's "id", names no peer and not
    # the key: those travel in kv_transfer_params only.
    assert parse_peer_info(request_id, None) is None
    peers = parse_peer_info(request_id, prefill.body["kv_transfer_params"])
    assert (peers.prefill_addr, peers.decode_addr) == (p.kv_addr, d.kv_addr)
    assert len(peers.key) == 32 and peers.key not in request_id
    params = {
        PREFILL_ADDR_KEY: p.kv_addr,
        DECODE_ADDR_KEY: d.kv_addr,
        REQUEST_KEY_KEY: peers.key,
    }
    assert prefill.body["kv_transfer_params"] == params
    assert decode.body == {**COMPLETION, "kv_transfer_params": params}
    # The prefill-only pass: one token, whole answer, no min_tokens; stop
    # options, n and logprobs stay, so P refuses what D would refuse (one
    # transfer per key: n's siblings send nothing); the prompt untouched.
    assert prefill.body == {
        "model": "m",
        "prompt": "San Francisco is a",
        "max_tokens": 1,
        "temperature": 0,
        "stop": ["\n"],
        "stop_token_ids": [7],
        "n": 2,
        "logprobs": 2,
        "stream": False,
        "kv_transfer_params": params,
    }
    assert (
        router.metric(
            "vllm_disagg_router_requests_total", endpoint="completions", outcome="ok"
        )
        == 1
    )


async def test_chat_prefill_caps_max_completion_tokens_and_drops_stream_options(pd):
    router, p, d = await pd()
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 50,
        "logprobs": True,
        "top_logprobs": 2,
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    status, _, _ = await router.post("/v1/chat/completions", chat)

    assert status == 200
    [prefill], [decode] = p.requests, d.requests
    assert prefill.path == decode.path == "/v1/chat/completions"
    assert prefill.body["max_completion_tokens"] == prefill.body["max_tokens"] == 1
    assert prefill.body["stream"] is False
    assert "stream_options" not in prefill.body
    assert prefill.body["logprobs"] is True and prefill.body["top_logprobs"] == 2
    assert (
        prefill.body["messages"] == chat["messages"]
        and prefill.body["tools"] == chat["tools"]
    )
    assert {k: v for k, v in decode.body.items() if k != "kv_transfer_params"} == chat


async def test_streaming_is_relayed_byte_for_byte(pd):
    router, p, d = await pd()
    d.chunks = [b'data: {"a": 1}\n\n', b'data: {"b"', b": 2}\n\n", b"data: [DONE]\n\n"]
    d.chunk_delay_s = 0.2  # apart enough that a busy host does not merge reads
    received = []
    async with asyncio.timeout(WAIT_S):
        async with router.client.post(
            router.url + "/v1/completions", json={**COMPLETION, "stream": True}
        ) as resp:
            assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            async for chunk in resp.content.iter_any():
                received.append(chunk)

    assert b"".join(received) == b"".join(d.chunks)
    assert len(received) >= 3  # relayed as it came, not buffered to the end
    assert p.requests[0].body["stream"] is False
    assert router.registry.get("d-id").outstanding == 0


async def test_client_kv_transfer_params_are_kept_but_cannot_name_peers(pd):
    router, p, d = await pd()
    client_params = {
        "custom": 1,
        PREFILL_ADDR_KEY: "10.9.9.9:1",
        DECODE_ADDR_KEY: "10.9.9.9:2",
        REQUEST_KEY_KEY: "evil",
    }
    await router.post(
        "/v1/completions", {**COMPLETION, "kv_transfer_params": client_params}
    )

    for seen in (p.requests[0], d.requests[0]):
        params = seen.body["kv_transfer_params"]
        assert params["custom"] == 1
        assert (params[PREFILL_ADDR_KEY], params[DECODE_ADDR_KEY]) == (
            p.kv_addr,
            d.kv_addr,
        )
        assert params[REQUEST_KEY_KEY] != "evil"


async def test_router_with_a_token_signs_the_peers_it_names(pd):
    """Instances act only on peers a grant vouches for: with its token, the
    router signs (prefill, decode, key); a client's own grant is dropped."""
    token = "fleet-token"
    router, p, d = await pd(registration_token=token)
    body = {
        **COMPLETION,
        "kv_transfer_params": {GRANT_KEY: "v1.9999999999." + "0" * 32},
    }
    status, _, _ = await router.post("/v1/completions", body)

    assert status == 200
    for seen in (p.requests[0], d.requests[0]):
        params = seen.body["kv_transfer_params"]
        peer = parse_peer_info(seen.headers["X-Request-Id"], params)
        check_grant(token.encode(), params[GRANT_KEY], peer)  # raises unless signed
        with pytest.raises(GrantError, match="forged"):
            check_grant(b"another token", params[GRANT_KEY], peer)


async def test_client_headers_and_request_id_are_forwarded_as_vllm_would_use_them(pd):
    """Upstream vLLM builds the response's id from the client's X-Request-Id: both
    legs carry it (peers travel in kv_transfer_params, never in the id), and
    D's X-Request-Id response header (--enable-request-id-headers) reaches
    the client."""
    router, p, d = await pd()

    async def echo_id(fake, request, body):
        return web.json_response(
            {"id": "cmpl-" + request.headers["X-Request-Id"]},
            headers={"X-Request-Id": request.headers["X-Request-Id"]},
        )

    d.handler = echo_id
    headers = {
        "Authorization": "Bearer k",
        "X-Request-Id": "mine-1_a",
        "traceparent": "00-ab-cd-01",
    }
    status, body, resp = await router.post(
        "/v1/completions", COMPLETION, headers=headers
    )
    assert status == 200 and json.loads(body)["id"] == "cmpl-mine-1_a"
    assert resp.headers["X-Request-Id"] == "mine-1_a"
    for seen in (p.requests[0], d.requests[0]):
        assert seen.headers["Authorization"] == "Bearer k"
        assert seen.headers["traceparent"] == "00-ab-cd-01"
        assert seen.headers["X-Request-Id"] == "mine-1_a"
        assert "Remote-Addr" not in seen.headers
    # An id the connector would read as peers, or one too long or odd, is
    # replaced by the router's own (which names nothing).
    for odd in (
        "x___prefill_addr_1.2.3.4:5___decode_addr_1.2.3.4:6_k",
        "a" * 129,
        "a b",
        "é",
    ):
        await router.post("/v1/completions", COMPLETION, headers={"X-Request-Id": odd})
        sent = d.requests[-1].headers["X-Request-Id"]
        assert sent != odd and parse_peer_info(sent, None) is None


async def test_upstream_error_status_and_body_are_relayed(pd):
    router, p, d = await pd()
    d.status = 400
    status, body, resp = await router.post("/v1/completions", COMPLETION)
    assert status == 400 and json.loads(body) == {"error": {"message": "d"}}

    # A prefill instance that refuses the request: the client gets that
    # answer and decode is never asked.
    d.status, p.status = 200, 422
    status, body, _ = await router.post("/v1/completions", COMPLETION)
    assert status == 422 and json.loads(body) == {"error": {"message": "p"}}
    assert len(d.requests) == 1
    assert (
        router.metric(
            "vllm_disagg_router_requests_total",
            endpoint="completions",
            outcome="upstream_client_error",
        )
        == 2
    )


async def test_model_filter_and_unknown_model(fakes, start_router):
    router = await start_router()
    p_a, d_a, p_b, d_b = [await fakes(n) for n in ("pa", "da", "pb", "db")]
    router.add(p_a, Role.PREFILL, model="a")
    router.add(d_a, Role.DECODE, model="a")
    router.add(p_b, Role.PREFILL, model="b")
    router.add(d_b, Role.DECODE, model="b")
    for _ in range(3):
        status, body, _ = await router.post(
            "/v1/completions", {**COMPLETION, "model": "b"}
        )
        assert status == 200 and body == d_b.answer()
    assert not p_a.requests and not d_a.requests

    status, body, _ = await router.post(
        "/v1/completions", {**COMPLETION, "model": "zzz"}
    )
    assert status == 404
    error = json.loads(body)["error"]  # vLLM's error, all names listed
    assert error["message"] == "The model `zzz` does not exist. Valid aliases: a, b."
    assert error["type"] == "NotFoundError" and error["param"] == "model"


async def test_a_request_without_model_in_a_fleet_of_two_models_is_a_400(
    start_router, fakes
):
    """Before: a request without `model` went to any decode and any prefill,
    and a prefill of the other model computed its KV (a wrong answer, 200)."""
    router = await start_router()
    pa, pb, da = await fakes("pa"), await fakes("pb"), await fakes("da")
    router.add(pa, Role.PREFILL, model="a")
    router.add(pb, Role.PREFILL, model="b")
    router.add(da, Role.DECODE, model="a")
    body = {k: v for k, v in COMPLETION.items() if k != "model"}
    status, data, _ = await router.post("/v1/completions", body)
    assert status == 400 and b"`model` is required" in data
    assert not pa.requests and not pb.requests and not da.requests
    # With the model named, only that model's prefill is ever used.
    for _ in range(4):
        status, _, _ = await router.post("/v1/completions", {**body, "model": "a"})
        assert status == 200
    assert len(pa.requests) == 4 and not pb.requests


async def test_stream_given_as_a_truthy_string_streams_like_vllm(pd):
    """Upstream vLLM takes "stream": "true" (or 1) as true; the router buffered the
    whole answer, with no chunk timeout."""
    router, p, d = await pd()
    for value in ("true", 1, "True"):
        status, body, resp = await router.post(
            "/v1/completions", {**COMPLETION, "stream": value}
        )
        assert status == 200 and resp.headers["Content-Type"].startswith(
            "text/event-stream"
        )
    # The prefill leg never streams, whatever the spelling.
    assert all(r.body["stream"] is False for r in p.requests)


async def test_requests_vllm_would_refuse_go_to_the_decode_alone(pd):
    """P used to prefill them (and push their KV into D's buffer) and only D
    refused them. What the one-token prefill leg cannot show sends the
    request to D alone, which refuses it in validation with vLLM's own error
    (relayed as is); the rest (logprobs, n with greedy sampling) P refuses
    itself, as D would."""
    router, p, d = await pd()
    d.status = 400  # the fake refuses everything, as vLLM would these
    for fields in (
        {"max_tokens": 0},
        {"max_completion_tokens": -1},
        {"max_tokens": 3, "min_tokens": 5},
        {"min_tokens": -1},
        {"stream_options": {"include_usage": True}},
        {"stream_options": {"include_usage": True}, "stream": False},
        {"stream_options": {"include_usage": "maybe"}, "stream": True},
        {"stream_options": {"continuous_usage_stats": 2}, "stream": True},
        {"stream_options": ["include_usage"], "stream": True},
    ):
        status, body, _ = await router.post("/v1/completions", {**COMPLETION, **fields})
        assert status == 400 and json.loads(body) == {"error": {"message": "d"}}, fields
    assert not p.requests and len(d.requests) == 9
    assert all("kv_transfer_params" not in r.body for r in d.requests)
    assert (
        router.metric(
            "vllm_disagg_router_decode_prefill_fallbacks_total", reason="invalid"
        )
        == 9
    )
    # vLLM reads stream_options' rule from the raw values: "stream": "false"
    # is a non-empty string, so it passes there and is prefilled here.
    d.status = 200
    status, _, _ = await router.post(
        "/v1/completions",
        {**COMPLETION, "stream_options": {"include_usage": True}, "stream": "yes"},
    )
    assert status == 200 and len(p.requests) == 1


async def test_prompt_logprobs_go_to_the_decode_alone(pd):
    """Upstream vLLM computes a prompt_logprobs request's whole prompt where it answers:
    a prefill elsewhere would be work and decode buffer for nothing."""
    router, p, d = await pd()
    for fields in ({"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}):
        status, _, _ = await router.post("/v1/completions", {**COMPLETION, **fields})
        assert status == 200
    assert not p.requests and len(d.requests) == 2
    assert all("kv_transfer_params" not in r.body for r in d.requests)
    assert (
        router.metric(
            "vllm_disagg_router_decode_prefill_fallbacks_total",
            reason="prompt_logprobs",
        )
        == 2
    )


BAD_STOP_OPTIONS = (
    {"stop": ""},
    {"stop": ["ok", ""]},
    {"stop": 5},
    {"stop_token_ids": [99999]},  # out of the vocabulary: only P can tell
    {"stop_token_ids": [1, "x"]},
    {"include_stop_str_in_output": "maybe"},
)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stop_options_vllm_refuses_are_refused_by_the_prefill(pd, path):
    """The prefill leg carries the client's stop options, so P refuses in
    validation, before computing anything, what D would refuse (an empty
    stop string, a token id outside P's vocabulary, ...): its 400 is relayed
    and D is never asked. They used to be dropped from the prefill leg: P
    prefilled, sent the KV, and only then did D refuse."""
    router, p, d = await pd()
    p.status = 400  # the fake refuses everything, as vLLM would these
    base = (
        COMPLETION
        if path == "/v1/completions"
        else {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    for fields in BAD_STOP_OPTIONS:
        body = {**base, **fields, "stream": True}
        status, answer, _ = await router.post(path, body)
        assert status == 400 and json.loads(answer) == {"error": {"message": "p"}}
        seen = p.requests[-1].body
        assert {k: seen[k] for k in fields} == fields, fields
        assert seen["max_tokens"] == 1 and seen["stream"] is False
    assert len(p.requests) == len(BAD_STOP_OPTIONS) and not d.requests
    assert router.metric(
        "vllm_disagg_router_requests_total",
        endpoint="completions" if path == "/v1/completions" else "chat_completions",
        outcome="upstream_client_error",
    ) == len(BAD_STOP_OPTIONS)


async def test_stop_and_stream_options_reach_the_legs_that_take_them(pd):
    """Stop options reach both legs as the client sent them (P's one token
    is computed and its KV sent however the request ends); stream_options
    only D, which streams; a valid one never keeps a request from P."""
    router, p, d = await pd()
    body = {
        **COMPLETION,
        "stop": ["ok", "\n"],
        "stop_token_ids": ["7", 8],
        "include_stop_str_in_output": "true",
        "stream": True,
        "stream_options": {"include_usage": "yes", "continuous_usage_stats": None},
    }
    status, _, _ = await router.post("/v1/completions", body)

    assert status == 200
    [prefill], [decode] = p.requests, d.requests
    for name in ("stop", "stop_token_ids", "include_stop_str_in_output"):
        assert prefill.body[name] == decode.body[name] == body[name]
    assert "stream_options" not in prefill.body and "min_tokens" not in prefill.body
    assert {k: v for k, v in decode.body.items() if k != "kv_transfer_params"} == body
    assert prefill.body["kv_transfer_params"] == decode.body["kv_transfer_params"]


@pytest.mark.parametrize(
    "path, base",
    [
        ("/v1/completions", {"model": "m", "prompt": "San Francisco is a"}),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        ),
    ],
)
async def test_beam_search_goes_to_the_decode_alone(pd, path, base):
    """Beam search runs in vLLM as one-token requests of its own, which carry
    no kv_transfer_params: a prefill's KV would never be read. The decode
    gets the client's body as it is (it used to be refused by the prefill
    leg, which kept n and dropped use_beam_search: "n must be 1 when using
    greedy sampling")."""
    router, p, d = await pd()
    for fields in (
        {"use_beam_search": True, "n": 2, "temperature": 0},
        {"use_beam_search": "yes", "n": 3, "max_tokens": 4, "stream": True},
    ):
        body = {**base, **fields}
        status, answer, _ = await router.post(path, body)
        assert status == 200
        assert d.requests[-1].body == body and d.requests[-1].path == path
    assert not p.requests and len(d.requests) == 2
    assert (
        router.metric(
            "vllm_disagg_router_decode_prefill_fallbacks_total", reason="beam_search"
        )
        == 2
    )


@pytest.mark.parametrize(
    "path, base, limit",
    [
        ("/v1/completions", {"model": "m", "prompt": "a"}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            "max_tokens",
        ),
        ("/v1/responses", {"model": "m", "input": "hi"}, "max_output_tokens"),
    ],
)
async def test_an_output_limit_over_max_model_len_costs_no_prefill(
    pd, path, base, limit
):
    """An output limit larger than --max-model-len is refused by vLLM, but the
    prefill leg asks for one token: only the decode would refuse, after the
    prefill. The decode registered its max_model_len, so the router sends
    such a request to it alone and relays its own 400."""
    router, p, d = await pd()
    router.add(d, Role.DECODE, max_model_len=64)
    d.status = 400
    status, _, _ = await router.post(path, {**base, limit: 65})
    assert status == 400
    assert not p.requests and d.requests[-1].body == {**base, limit: 65}
    assert (
        router.metric(
            "vllm_disagg_router_decode_prefill_fallbacks_total", reason="invalid"
        )
        == 1
    )
    d.status = 200
    status, _, _ = await router.post(path, {**base, limit: 64})
    assert status == 200 and len(p.requests) == 1  # at the limit: disaggregated


async def test_concurrent_hand_off_bad_stop_options_are_refused_by_both_legs(pd):
    """With --handoff concurrent D is asked at once too: both refuse in
    validation, before computing anything, and the client gets D's 400."""
    router, p, d = await pd(handoff="concurrent")
    p.status = d.status = 400
    for fields in BAD_STOP_OPTIONS:
        status, answer, _ = await router.post(
            "/v1/completions", {**COMPLETION, **fields}
        )
        assert status == 400 and json.loads(answer) == {"error": {"message": "d"}}
    assert len(d.requests) == len(BAD_STOP_OPTIONS)
    for seen in d.requests:
        assert "kv_transfer_params" in seen.body
    # P's legs may or may not have been sent: D's answer ends them.
    assert len(p.requests) <= len(BAD_STOP_OPTIONS)


@pytest.mark.parametrize("value", [b"NaN", b"-Infinity", b'"\\ud800"'])
async def test_json_only_python_reads_goes_to_a_decode_with_the_legs_headers(pd, value):
    """Starlette's json.loads (vLLM's) takes NaN, Infinity and lone surrogate
    escapes; msgspec does not. Such a body was sent raw to the decode,
    without the client's Authorization and with its peer keys, and the
    decode's answer was replaced by a 400 "not JSON"."""
    router, p, d = await pd()
    raw = (
        b'{"model":"m","prompt":"hi","max_tokens":4,"x":' + value + b","
        b'"kv_transfer_params":{"custom":1,"'
        + PREFILL_ADDR_KEY.encode()
        + b'":"6.6.6.6:1","'
        + DECODE_ADDR_KEY.encode()
        + b'":"6.6.6.7:1"}}'
    )
    status, body, _ = await router.post(
        "/v1/completions", raw, headers={"Authorization": "Bearer right-key"}
    )
    assert status == 200, body
    assert json.loads(body) == json.loads(d.answer())
    assert p.requests == []
    seen = d.requests[0]
    assert seen.headers["Authorization"] == "Bearer right-key"
    assert seen.body["kv_transfer_params"] == {"custom": 1}
    assert repr(seen.body["x"]) == repr(json.loads(value))
    assert (
        router.metric(
            "vllm_disagg_router_decode_prefill_fallbacks_total", reason="stdlib_json"
        )
        == 1
    )


async def test_a_body_that_is_not_an_object_is_refused_with_the_legs_headers(pd):
    router, p, d = await pd()
    status, _, _ = await router.post(
        "/v1/completions", b"[NaN]", headers={"Authorization": "Bearer k"}
    )
    assert status == 400
    assert p.requests == []
    assert d.requests[0].headers["Authorization"] == "Bearer k"


@pytest.mark.parametrize("path", [b"/v1/completions", b"/tokenize"])
async def test_hop_by_hop_and_forwarding_headers_are_the_routers_own(pd, path):
    """Headers named in Connection, Proxy-Connection and HTTP2-Settings
    reached the instances, and so did the client's own X-Forwarded-For and
    Forwarded (a vLLM trusting its proxy logs them as the peer)."""
    router, p, d = await pd()
    body = json.dumps(COMPLETION).encode()
    request = (
        b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\nConnection: X-Hop, close\r\nX-Hop: 1\r\n"
        b"Proxy-Connection: keep-alive\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n"
        b"X-Forwarded-For: 6.6.6.6\r\nForwarded: for=6.6.6.6\r\n"
        b"X-Real-IP: 6.6.6.6\r\nX-Kept: 1\r\n\r\n" % len(body)
    ) + body
    async with asyncio.timeout(WAIT_S):
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", router.state.http_port
        )
        writer.write(request)
        assert (await reader.read()).startswith(b"HTTP/1.1 200")
        writer.close()
    for seen in [*p.requests, *d.requests]:
        h = seen.headers
        assert h["X-Kept"] == "1"
        for name in ("X-Hop", "Proxy-Connection", "HTTP2-Settings", "Forwarded"):
            assert name not in h, name
        assert "X-Real-IP" not in h
        assert h["X-Forwarded-For"] == "6.6.6.6, 127.0.0.1"
    assert d.requests
