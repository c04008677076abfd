"""Retries, circuit breakers, unreachable instances, every timeout, client
disconnects, and the fallback to decode-side prefill."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import time

from aiohttp import web

from vllm_disagg.router.registry import BreakerState
from vllm_disagg.wire.discovery import Role

from .conftest import WAIT_S, FakeInstance

BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}
STREAM = {**BODY, "stream": True}


def error_of(body: bytes) -> dict:
    return json.loads(body)["error"]


async def add_prefills(router, fakes, names):
    made = []
    for name in names:
        fake = await fakes(name)
        router.add(fake, Role.PREFILL)
        made.append(fake)
    return made


async def test_failed_prefill_is_retried_on_another_instance(pd, fakes):
    router, p, d = await pd()
    [p2] = await add_prefills(router, fakes, ["p2"])
    p.status = p2.status = 500
    status, body, _ = await router.post("/v1/completions", BODY)
    assert status == 502 and error_of(body)["type"] == "BadGatewayError"
    assert len(p.requests) == len(p2.requests) == 1 and not d.requests

    p.status = 200  # one bad, one good: whichever is tried first, the request succeeds
    for _ in range(2):
        status, body, _ = await router.post("/v1/completions", BODY)
        assert status == 200 and body == d.answer()
    assert router.metric("vllm_disagg_router_prefill_retries_total") >= 2
    assert (
        router.metric("vllm_disagg_router_prefill_failures_total", reason="status") >= 3
    )
    # Retries kept the request's key: P and D agree on it.
    assert (
        d.requests[-1].headers["X-Request-Id"] == p.requests[-1].headers["X-Request-Id"]
    )


async def test_retry_budget_bounds_attempts(pd, fakes):
    router, p, d = await pd(max_retries=1)
    extra = await add_prefills(router, fakes, ["p2", "p3"])
    for fake in (p, *extra):
        fake.status = 503
    status, _, _ = await router.post("/v1/completions", BODY)
    assert status == 502
    assert sum(len(f.requests) for f in (p, *extra)) == 2


async def test_refused_connection_drops_the_instance_at_once(pd, fakes):
    router, p, d = await pd()
    [gone] = await add_prefills(router, fakes, ["gone"])
    await gone.stop()
    for _ in range(3):
        status, _, _ = await router.post("/v1/completions", BODY)
        assert status == 200
    assert router.registry.get("gone-id") is None
    assert [i["instance_id"] for i in router.registry.snapshot()] == ["p-id", "d-id"]
    assert (
        router.metric(
            "vllm_disagg_router_instance_removals_total", reason="unreachable"
        )
        == 1
    )


async def test_a_refused_decode_is_retried_on_another_before_the_first_byte(pd, fakes):
    """A decode whose HTTP refuses while its heartbeat lives cost one 502 per
    heartbeat although another decode was healthy."""
    router, p, d = await pd()
    d2 = await fakes("d2")
    router.add(d2, Role.DECODE)
    await d.stop()
    for _ in range(4):
        status, body, _ = await router.post("/v1/completions", BODY)
        assert status == 200, body
    assert router.registry.get("d-id") is None
    assert router.metric("vllm_disagg_router_decode_retries_total") <= 1
    # The retried request was prefilled by its new decode itself (no peers):
    # the KV had gone to the decode that refused.
    assert any("kv_transfer_params" not in r.body for r in d2.requests)
    assert b"127.0.0.1" not in body


async def test_refused_decode_is_a_502_and_drops_it(pd):
    router, p, d = await pd()
    await d.stop()
    status, body, _ = await router.post("/v1/completions", BODY)
    assert status == 502 and "refused" in error_of(body)["message"]
    assert (
        d.http_addr.encode() not in body
    )  # internal addresses stay in the router's log
    status, body, _ = await router.post("/v1/completions", BODY)
    assert status == 503 and error_of(body)["type"] == "ServiceUnavailableError"


async def test_breaker_opens_then_half_open_lets_one_trial(pd, fakes):
    router, p, d = await pd(breaker_failures=2, breaker_cooldown_s=30.0, max_retries=0)
    p.status = 500
    for _ in range(2):
        status, _, _ = await router.post("/v1/completions", BODY)
        assert status == 502
    instance = router.registry.get("p-id")
    assert router.registry.breaker_state(instance) is BreakerState.OPEN
    status, body, _ = await router.post("/v1/completions", BODY)
    assert status == 503 and len(p.requests) == 2  # kept out while open
    assert router.metric("vllm_disagg_router_breaker_opens_total") == 1

    router.clock.advance(30.0)
    router.add(p, Role.PREFILL)  # heartbeats kept coming meanwhile
    router.add(d, Role.DECODE)
    assert router.registry.breaker_state(instance) is BreakerState.HALF_OPEN
    # One trial at a time: while it is in flight nobody else is sent there.
    p.status, p.delay_s = 200, 2.0  # in flight until the second request was refused
    trial = asyncio.create_task(router.post("/v1/completions", BODY))
    async with asyncio.timeout(WAIT_S):
        while len(p.requests) < 3:
            await asyncio.sleep(0.01)
    status, _, _ = await router.post("/v1/completions", BODY)
    assert status == 503
    status, _, _ = await trial
    assert status == 200
    assert router.registry.breaker_state(instance) is BreakerState.CLOSED


async def test_prefill_timeout_retries_elsewhere(pd, fakes):
    router, p, d = await pd(prefill_timeout_s=0.3)
    [p2] = await add_prefills(router, fakes, ["p2"])
    p.hang = p2.hang = True
    status, body, _ = await router.post("/v1/completions", BODY)
    assert status == 502 and "timeout" in error_of(body)["message"]
    # The router closed both hung prefill requests.
    async with asyncio.timeout(WAIT_S):
        await p.disconnected.wait()
        await p2.disconnected.wait()
    assert (
        router.metric("vllm_disagg_router_prefill_failures_total", reason="timeout")
        == 2
    )


async def test_prefill_legs_on_an_instance_whose_heartbeats_stop_are_retried_at_once(
    pd, fakes
):
    """A stopped prefill holds its legs until --prefill-timeout-s (300 s by
    default) unless its removal ends them: once its heartbeats are overdue
    (checked every second, traffic or not), its legs go to another prefill."""
    router, p, d = await pd(prefill_timeout_s=30.0, request_timeout_s=40.0)
    p.hang = True
    request = asyncio.create_task(router.post("/v1/completions", BODY))
    async with asyncio.timeout(WAIT_S):
        while not p.requests:
            await asyncio.sleep(0.01)
    p2 = await fakes("p2")
    router.clock.advance(router.registry.heartbeat_timeout_s + 1)
    router.add(p2, Role.PREFILL)  # p2 and d heartbeat, p is silent
    router.add(d, Role.DECODE)
    started = time.monotonic()
    status, body, _ = await request
    assert status == 200 and body == d.answer()
    assert time.monotonic() - started < 5.0  # one sweep (1 s); a bound for slow hosts
    assert len(p2.requests) == 1
    assert (
        router.metric(
            "vllm_disagg_router_prefill_failures_total", reason="instance_removed"
        )
        == 1
    )
    assert (
        router.metric("vllm_disagg_router_instance_removals_total", reason="expired")
        == 1
    )
    async with asyncio.timeout(WAIT_S):
        await p.disconnected.wait()  # the router closed the stopped prefill's leg


async def test_a_prefill_whose_engine_stopped_stepping_is_out_of_rotation(pd, fakes):
    """A hung engine behind a live API server keeps heartbeating: its
    heartbeats' stalled_s takes it out of rotation and ends its prefill legs
    (each retried on another prefill) instead of --prefill-timeout-s; once it
    steps again it is routed to again."""
    router, p, d = await pd(prefill_timeout_s=30.0, request_timeout_s=40.0)
    timeout = router.registry.stall_timeout_s
    p.hang = True
    request = asyncio.create_task(router.post("/v1/completions", BODY))
    async with asyncio.timeout(WAIT_S):
        while not p.requests:
            await asyncio.sleep(0.01)
    p2 = await fakes("p2")
    router.add(p2, Role.PREFILL)
    started = time.monotonic()
    router.add(p, Role.PREFILL, seq=1, stalled_s=timeout + 1)
    status, body, _ = await request
    assert status == 200 and body == d.answer()
    assert time.monotonic() - started < 5.0  # at once; a bound for slow hosts
    assert len(p2.requests) == 1
    assert (
        router.metric(
            "vllm_disagg_router_prefill_failures_total", reason="instance_stalled"
        )
        == 1
    )
    assert router.metric("vllm_disagg_router_instances_stalled", role="prefill") == 1
    listing = json.loads((await router.get("/instances"))[1])
    [listed] = [i for i in listing if i["instance_id"] == "p-id"]
    assert listed["state"] == "stalled" and listed["stalled_s"] == timeout + 1
    # Out of rotation: the next requests all go to p2.
    p.hang = False
    for _ in range(3):
        status, _, _ = await router.post("/v1/completions", BODY)
        assert status == 200
    assert len(p.requests) == 1 and len(p2.requests) == 4
    # It steps again: back in rotation.
    router.add(p, Role.PREFILL, seq=2, stalled_s=0.0)
    for _ in range(2):
        status, _, _ = await router.post("/v1/completions", BODY)
        assert status == 200
    assert len(p.requests) == 2
    assert router.metric("vllm_disagg_router_instances_stalled", role="prefill") == 0
    assert router.metric("vllm_disagg_router_instance_stalls_total") == 1


async def test_a_deregistered_prefill_finishes_its_legs(pd):
    """An instance that says goodbye (a graceful shutdown) still answers
    what it holds: its legs are not ended."""
    router, p, d = await pd()
    p.delay_s = 0.5
    request = asyncio.create_task(router.post("/v1/completions", BODY))
    async with asyncio.timeout(WAIT_S):
        while not p.requests:
            await asyncio.sleep(0.01)
    assert router.registry.deregister(f"{p.name}-id")
    status, body, _ = await request
    assert status == 200 and body == d.answer()
    assert len(p.requests) == 1 and not p.disconnected.is_set()


async def test_first_token_timeout_is_a_504_before_anything_was_sent(pd):
    router, p, d = await pd(first_token_timeout_s=0.3)
    d.hang = True
    status, body, _ = await router.post("/v1/completions", STREAM)
    assert status == 504 and error_of(body)["type"] == "GatewayTimeoutError"
    async with asyncio.timeout(WAIT_S):
        await d.disconnected.wait()
    assert router.registry.get("d-id").outstanding == 0


async def test_chunk_timeout_ends_the_stream_with_an_error_event(pd):
    router, p, d = await pd(chunk_timeout_s=0.3)
    d.chunks = [b"data: 1\n\n", b"data: 2\n\n"]
    d.chunk_delay_s = 3.0
    status, body, _ = await router.post("/v1/completions", STREAM)
    assert status == 200
    first, error_event = body.split(b"\n\n", 1)
    assert first == b"data: 1"
    assert error_event.startswith(b"data: ") and b"sent nothing for 0.3s" in error_event
    # Ended as vLLM ends a failed stream: [DONE] after the error event.
    assert error_event.endswith(b"\n\ndata: [DONE]\n\n")
    async with asyncio.timeout(WAIT_S):
        await d.disconnected.wait()
    assert (
        router.metric(
            "vllm_disagg_router_requests_total",
            endpoint="completions",
            outcome="timeout",
        )
        == 1
    )


async def test_request_deadline_bounds_everything(pd):
    router, p, d = await pd(request_timeout_s=0.4)
    p.hang = True
    status, body, _ = await router.post("/v1/completions", BODY)
    assert status == 504 and "deadline" in error_of(body)["message"]

    # Mid-stream: the deadline ends a stream that is still flowing (a 30 s
    # stream; the deadline leaves room for the headers on a loaded host).
    router, p, d = await pd(request_timeout_s=2.0)
    d.chunks = [b"data: %d\n\n" % i for i in range(600)]
    d.chunk_delay_s = 0.05
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, body, _ = await router.post("/v1/completions", STREAM)
    assert status == 200 and loop.time() - started < 10.0
    *_, error_event, done, rest = body.split(b"\n\n")
    assert b"deadline" in error_event and done == b"data: [DONE]" and rest == b""


async def test_connect_timeout(pd):
    """A listener whose accept queue is full never completes a handshake."""
    router, p, d = await pd(connect_timeout_s=0.3, max_retries=0)
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    fillers = []
    try:
        for _ in range(4):  # fill the accept queue; later SYNs are dropped
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(listener.getsockname())
            fillers.append(filler)
        await asyncio.sleep(0.05)
        stuck = FakeInstance("stuck")
        stuck.port = listener.getsockname()[1]
        router.registry.deregister("p-id")
        router.add(stuck, Role.PREFILL)
        loop = asyncio.get_running_loop()
        started = loop.time()
        status, body, _ = await router.post("/v1/completions", BODY)
        assert status == 502 and "connect_timeout" in error_of(body)["message"]
        assert loop.time() - started < 2.0
    finally:
        for s in (listener, *fillers):
            s.close()


async def test_client_disconnect_mid_stream_cancels_decode(pd):
    router, p, d = await pd()
    d.chunks = [b"data: %d\n\n" % i for i in range(50)]
    d.chunk_delay_s = 0.1
    async with asyncio.timeout(WAIT_S):
        resp = await router.client.post(router.url + "/v1/completions", json=STREAM)
        assert await resp.content.readany()
        resp.close()
        await d.disconnected.wait()
        while router.registry.get("d-id").outstanding:
            await asyncio.sleep(0.01)
    assert (
        router.metric(
            "vllm_disagg_router_requests_total",
            endpoint="completions",
            outcome="cancelled",
        )
        == 1
    )


async def test_a_stream_the_client_never_started_reading_still_releases_decode(pd):
    """A client that leaves between D's headers and the first chunk: the HTTP
    server drops the reply's body without iterating it, which only
    ``_RelayStream.__del__`` notices. Driven here through the proxy itself,
    since over HTTP the window is too short to hit on purpose."""
    router, p, d = await pd()
    d.chunks = [b"data: %d\n\n" % i for i in range(50)]
    d.chunk_delay_s = 0.1
    async with asyncio.timeout(WAIT_S):
        reply = await router.state.proxy.handle(
            "completions", "/v1/completions", dict(STREAM), {}
        )
        assert reply.status == 200 and not isinstance(reply.body, bytes)
        assert router.registry.get("d-id").outstanding == 1
        del reply
        gc.collect()
        await d.disconnected.wait()
    assert router.registry.get("d-id").outstanding == 0
    assert (
        router.metric(
            "vllm_disagg_router_requests_total",
            endpoint="completions",
            outcome="cancelled",
        )
        == 1
    )


async def test_client_disconnect_during_prefill_cancels_it(pd):
    router, p, d = await pd()
    p.hang = True
    async with asyncio.timeout(WAIT_S):
        request = asyncio.create_task(router.post("/v1/completions", BODY))
        while not p.requests:
            await asyncio.sleep(0.01)
        request.cancel()
        await p.disconnected.wait()
        while router.registry.get("p-id").outstanding:
            await asyncio.sleep(0.01)
    assert not d.requests


async def test_concurrent_handoff_sends_both_at_once(pd):
    router, p, d = await pd(handoff="concurrent")
    p.delay_s = 2.0
    status, body, _ = await router.post("/v1/completions", BODY)
    assert status == 200 and body == d.answer()
    [prefill], [decode] = p.requests, d.requests
    assert decode.at - prefill.at < p.delay_s  # D was sent it before P answered
    assert prefill.headers["X-Request-Id"] == decode.headers["X-Request-Id"]
    assert prefill.body["max_tokens"] == 1 and decode.body["max_tokens"] == 4


async def test_concurrent_handoff_failed_prefill_lets_decode_finish(pd):
    router, p, d = await pd(handoff="concurrent")
    p.status = 500
    d.delay_s = 0.2  # decode answers after prefill failed (it recomputed)
    status, body, _ = await router.post("/v1/completions", BODY)
    assert status == 200 and body == d.answer()
    assert router.metric("vllm_disagg_router_concurrent_prefill_failures_total") == 1
    assert len(p.requests) == 1  # never retried: D waits for that P


async def test_fallback_to_decode_prefill_is_off_by_default(start_router, fakes):
    router = await start_router()
    d = await fakes("d")
    router.add(d, Role.DECODE)
    status, body, _ = await router.post("/v1/completions", BODY)
    assert status == 503 and "prefill" in error_of(body)["message"]
    assert not d.requests


async def test_fallback_to_decode_prefill_is_counted(start_router, fakes):
    router = await start_router(fallback_to_decode_prefill=True)
    d = await fakes("d")
    router.add(d, Role.DECODE)
    body = {**BODY, "kv_transfer_params": {"p2p_prefill_addr": "10.0.0.1:1"}}
    status, answer, _ = await router.post("/v1/completions", body)
    assert status == 200 and answer == d.answer()
    assert "kv_transfer_params" not in d.requests[0].body  # D prefills, names no peers
    assert not d.requests[0].headers["X-Request-Id"].startswith("___prefill_addr_")
    assert (
        router.metric(
            "vllm_disagg_router_decode_prefill_fallbacks_total", reason="no_prefill"
        )
        == 1
    )

    p = await fakes("p")
    p.status = 500
    router.add(p, Role.PREFILL)
    status, _, _ = await router.post("/v1/completions", BODY)
    assert status == 200 and len(p.requests) == 1
    assert (
        router.metric(
            "vllm_disagg_router_decode_prefill_fallbacks_total", reason="prefill_failed"
        )
        == 1
    )


async def test_client_disconnect_in_concurrent_handoff_cancels_both(pd):
    router, p, d = await pd(handoff="concurrent")
    p.hang = d.hang = True
    async with asyncio.timeout(WAIT_S):
        request = asyncio.create_task(router.post("/v1/completions", BODY))
        while not (p.requests and d.requests):
            await asyncio.sleep(0.01)
        request.cancel()
        await p.disconnected.wait()
        await d.disconnected.wait()
        while (
            router.registry.get("p-id").outstanding
            or router.registry.get("d-id").outstanding
        ):
            await asyncio.sleep(0.01)


async def test_decode_is_loaded_from_selection_and_released_on_every_path(pd):
    router, p, d = await pd(max_retries=0)
    decode = router.registry.get("d-id")
    p.delay_s = 0.3
    request = asyncio.create_task(router.post("/v1/completions", BODY))
    async with asyncio.timeout(WAIT_S):
        while not p.requests:
            await asyncio.sleep(0.01)
    assert decode.outstanding == 1  # while P prefills, D already counts it
    assert (await request)[0] == 200
    p.delay_s = 0.0
    for p.status in (500, 404):  # P failed; P refused the request
        await router.post("/v1/completions", BODY)
        assert decode.outstanding == 0
    assert len(d.requests) == 1


async def test_decode_breaking_its_stream_ends_the_clients(pd):
    router, p, d = await pd()

    async def break_after_one_event(fake, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await asyncio.sleep(0.05)
        request.transport.close()  # dies mid-stream: no final chunk
        return resp

    d.handler = break_after_one_event
    status, body, _ = await router.post("/v1/completions", STREAM)
    assert status == 200
    first, error_event = body.split(b"\n\n", 1)
    assert first == b"data: 1" and b"broke the stream" in error_event
    assert (
        router.metric(
            "vllm_disagg_router_requests_total",
            endpoint="completions",
            outcome="upstream_error",
        )
        == 1
    )
    assert router.registry.get("d-id").consecutive_failures == 1


async def test_timeouts_a_client_causes_never_open_a_healthy_instances_breaker(pd):
    """Stalls a request can cause (a long prefill, a slow first token, a
    long pause mid-stream) on an instance whose /health answers: no breaker
    opens, and the next client is served."""
    # connect_timeout_s bounds the health probe: generous, a loaded host must
    # not fail a probe of a healthy instance.
    router, p, d = await pd(
        breaker_failures=2,
        prefill_timeout_s=0.3,
        first_token_timeout_s=0.3,
        chunk_timeout_s=0.3,
        max_retries=0,
        connect_timeout_s=8.0,
    )
    d_stalls = [b"data: 1\n\n", b"data: 2\n\n"]
    for _ in range(3):
        p.delay_s = 1.0  # prefill times out
        status, _, _ = await router.post("/v1/completions", BODY)
        assert status == 502
        p.delay_s, d.delay_s = 0.0, 1.0  # first token times out
        status, _, _ = await router.post("/v1/completions", STREAM)
        assert status == 504
        d.delay_s, d.chunks, d.chunk_delay_s = 0.0, d_stalls, 1.0  # a pause mid-stream
        status, body, _ = await router.post("/v1/completions", STREAM)
        assert status == 200 and b"sent nothing" in body
        d.chunk_delay_s = 0.0
    async with asyncio.timeout(WAIT_S):
        while router.metric("vllm_disagg_router_health_probes_total", result="ok") < 2:
            await asyncio.sleep(0.02)
        while router.state.proxy.health.probes_in_flight:  # every verdict is in
            await asyncio.sleep(0.02)
    for name in ("p-id", "d-id"):
        assert (
            router.registry.breaker_state(router.registry.get(name))
            is BreakerState.CLOSED
        )
    assert router.metric("vllm_disagg_router_breaker_opens_total") == 0
    assert router.metric("vllm_disagg_router_health_probes_total", result="failed") == 0
    status, _, _ = await router.post("/v1/completions", BODY)
    assert status == 200


async def test_timeouts_on_an_instance_that_cannot_answer_health_open_its_breaker(pd):
    router, p, d = await pd(
        breaker_failures=2, first_token_timeout_s=0.3, connect_timeout_s=0.3
    )
    d.hang = True  # requests and /health alike
    for _ in range(2):
        status, _, _ = await router.post("/v1/completions", STREAM)
        assert status == 504
        async with asyncio.timeout(WAIT_S):  # one probe at a time: let it end
            while router.state.proxy.health.probes_in_flight:
                await asyncio.sleep(0.02)
    assert router.metric("vllm_disagg_router_health_probes_total", result="failed") == 2
    assert (
        router.registry.breaker_state(router.registry.get("d-id")) is BreakerState.OPEN
    )
    status, _, _ = await router.post("/v1/completions", BODY)
    assert status == 503


async def test_prefill_and_decode_pair_only_within_one_model_fingerprint(
    start_router, fakes
):
    """Other weights under one model name (a rolling upgrade half-way): the
    router never pairs a prefill with a decode of another fingerprint; with
    no compatible pair it answers 503 and /instances says why."""
    router = await start_router()
    old_p, new_d = await fakes("old-p"), await fakes("new-d")
    router.add(old_p, Role.PREFILL, fingerprint="aa" * 16)
    router.add(new_d, Role.DECODE, fingerprint="bb" * 16)
    status, body, _ = await router.post("/v1/completions", BODY)
    assert status == 503, body
    assert "fingerprints differ" in error_of(body)["message"]
    assert not old_p.requests and not new_d.requests
    assert router.metric("vllm_disagg_router_instances_unpaired", role="prefill") == 1
    listing = json.loads((await router.get("/instances"))[1])
    assert {i["instance_id"]: i["paired"] for i in listing} == {
        "old-p-id": False,
        "new-d-id": False,
    }
    new_p = await fakes("new-p")
    router.add(new_p, Role.PREFILL, fingerprint="bb" * 16)
    for _ in range(4):  # round-robin over both prefills: only new-p is chosen
        status, body, _ = await router.post("/v1/completions", BODY)
        assert status == 200 and body == new_d.answer()
    assert len(new_p.requests) == 4 and not old_p.requests
