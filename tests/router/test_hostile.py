"""Floods of hostile input on the router's two ports (vllm_disagg/testing/
hostile.py): nothing registers, nothing crashes, every rejection the router
can see is counted, and clients are served throughout."""

from __future__ import annotations

import asyncio
import random

import pytest

from vllm_disagg.router.client_limits import REASONS
from vllm_disagg.testing.hostile import (
    discovery_protocol,
    flood_tcp,
    flood_zmq,
    http_payloads,
)
from vllm_disagg.wire.discovery import Role

from .conftest import WAIT_S

pytestmark = pytest.mark.asyncio
BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}


def _rejected(router) -> float:
    kinds = ("malformed", "oversized", "unauthenticated", "stale", "version", "replayed")
    return sum(router.metric("vllm_disagg_router_discovery_rejected_total", kind=k)
               for k in kinds)  # fmt: skip


async def test_a_discovery_flood_registers_nothing_and_is_counted(pd, monkeypatch):
    monkeypatch.setenv("VLLM_DISAGG_ROUTER_TOKEN", "fleet-token")
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

    flood = asyncio.create_task(asyncio.to_thread(
        flood_zmq, endpoint, discovery_protocol(), count=3000, time_s=30.0, seed=7,
    ))  # fmt: skip
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
    assert router.metric("vllm_disagg_router_discovery_accepted_total", type="register") == 0


async def test_an_http_flood_of_broken_requests_leaves_clients_served(pd):
    router, p, d = await pd(max_header_bytes=65536, client_header_timeout_s=0.3,
                            client_idle_timeout_s=0.3)  # fmt: skip
    port = router.state.http_port
    sent = await asyncio.to_thread(flood_tcp, "127.0.0.1", port,
                                   http_payloads(random.Random(3)), count=40,
                                   time_s=40.0, read_s=0.5)  # fmt: skip
    assert sent.total == 40
    status, _, _ = await router.post("/v1/completions", BODY)
    assert status == 200
    # Nothing broken was prefilled (bodies that are not JSON objects are
    # refused by the decode, as vLLM refuses them); heads over the bound were cut.
    assert len(p.requests) == 1
    assert all("kv_transfer_params" not in (r.body or {}) for r in d.requests[:-1])
    assert router.metric("vllm_disagg_router_client_connections_closed_total",
                         reason="headers_too_large") == sent.by_kind.get("oversized", 0)
    # Every broken connection was refused one way, and counted once.
    refused = sum(router.metric("vllm_disagg_router_requests_total", endpoint=e,
                                outcome="bad_request")
                  for e in ("completions", "chat_completions"))  # fmt: skip
    refused += sum(router.metric("vllm_disagg_router_client_connections_closed_total",
                                 reason=r) for r in REASONS)  # fmt: skip
    assert refused == sent.total, sent
