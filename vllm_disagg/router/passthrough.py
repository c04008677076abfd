"""Requests no prefill takes part in and whose body the router does not read:
relayed to decode instances as they came (method, path, query, body, the
client's headers), answered as the decode answers.

* ``one``: any healthy decode answers (``/version``, the API docs);
* ``in_turn``: decodes are asked one after the other until one answers
  other than 404 (a stored response lives on the decode that made it);
* ``every``: every healthy instance is told, prefills included (an abort:
  the request may run on any of them); a decode's answer is relayed;
* ``load``: the decodes' ``/load`` summed (vLLM counts a request where its
  handler runs, and each request's answer runs on one decode).

Nothing a client sends chooses an instance: each comes from the registry.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
import msgspec
from yarl import URL

from vllm_disagg.router.exchange import forwarded_headers
from vllm_disagg.router.health import InstanceHealth
from vllm_disagg.router.metrics import Outcome, RouterMetrics
from vllm_disagg.router.registry import Instance, InstanceRegistry
from vllm_disagg.router.replies import (
    JSON,
    Reply,
    content_type,
    error_reply,
    relayed_headers,
)
from vllm_disagg.wire.discovery import Role

# A relayed request that generates nothing answers within this, past the
# connection's own timeout.
ANSWER_S = 30.0


@dataclass(frozen=True)
class Asked:
    """A client's request as it is relayed."""

    endpoint: str  # metrics label
    method: str
    target: str  # path and query
    raw: bytes | None
    headers: Mapping[str, str]  # the client's (passed on as the legs' are)
    client: str | None = None  # the client's address (X-Forwarded-For)


class Passthrough:
    def __init__(
        self,
        registry: InstanceRegistry,
        metrics: RouterMetrics,
        health: InstanceHealth,
        connect_timeout_s: float,
        session: Callable[[], aiohttp.ClientSession],
        select: Callable[[list[Instance], dict], Instance],
    ) -> None:
        self.select = select  # the decode policy's choice
        self.registry = registry
        self.metrics = metrics
        self.health = health
        self.timeout_s = connect_timeout_s + ANSWER_S
        self._session = session

    def _count(self, endpoint: str, outcome: Outcome) -> None:
        self.metrics.requests.labels(endpoint, outcome).inc()

    def _none(self, endpoint: str) -> Reply:
        self._count(endpoint, Outcome.NO_INSTANCE)
        return error_reply(503, "no healthy decode instance is registered")

    async def _send(self, instance: Instance, asked: Asked) -> Reply | None:
        """The instance's answer, or None when it gave none (judged)."""
        method, target, raw, headers = (
            asked.method,
            asked.target,
            asked.raw,
            asked.headers,
        )
        sent = forwarded_headers(headers, asked.client)
        if raw is not None and "Content-Type" in headers:
            sent["Content-Type"] = headers["Content-Type"]
        try:
            async with asyncio.timeout(self.timeout_s):
                # As encoded: yarl would decode %2E and drop dot segments.
                url = URL(f"http://{instance.http_addr}{target}", encoded=True)
                async with self._session().request(
                    method, url, data=raw, headers=sent
                ) as resp:
                    payload = await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            self.health.judge(instance, e)
            return None
        return Reply(resp.status, content_type(resp), payload, relayed_headers(resp))

    def _relayed(self, endpoint: str, reply: Reply | None) -> Reply:
        if reply is None:
            self._count(endpoint, Outcome.UPSTREAM_ERROR)
            return error_reply(502, "the decode instance failed")
        ok = reply.status < 400
        self._count(endpoint, Outcome.OK if ok else Outcome.UPSTREAM_CLIENT_ERROR)
        return reply

    async def one(self, asked: Asked, model: str | None = None) -> Reply:
        """A healthy decode's answer, one of ``model``'s where some decode
        serves it (else any: it refuses an unknown model itself), picked by
        the decode policy and held by a lease while it answers; another
        decode is asked when the first gives no answer."""
        endpoint = asked.endpoint
        if model is None or not self.registry.serves_model(model):
            model = None
        decodes = self.registry.healthy(Role.DECODE, model)
        if not decodes:
            return self._none(endpoint)
        reply = None
        for _ in range(2):
            decode = self.select(decodes, {} if model is None else {"model": model})
            lease = self.registry.reserve(decode)
            try:
                reply = await self._send(decode, asked)
            finally:
                lease.release(None if reply is None else reply.status < 500)
            decodes = [d for d in decodes if d is not decode]
            if reply is not None or not decodes:
                break
        return self._relayed(endpoint, reply)

    async def in_turn(self, asked: Asked) -> Reply:
        """The first healthy decode's answer that is not 404 (else a 404)."""
        endpoint = asked.endpoint
        decodes = self.registry.healthy(Role.DECODE)
        if not decodes:
            return self._none(endpoint)
        last = None
        for decode in decodes:
            reply = await self._send(decode, asked)
            if reply is not None and reply.status != 404:
                return self._relayed(endpoint, reply)
            last = reply if reply is not None else last
        return self._relayed(endpoint, last)

    async def every(self, asked: Asked) -> Reply:
        """Sent to every healthy instance at once; a decode's answer."""
        endpoint = asked.endpoint
        decodes = self.registry.healthy(Role.DECODE)
        if not decodes:
            return self._none(endpoint)
        instances = [*decodes, *self.registry.healthy(Role.PREFILL)]
        replies = await asyncio.gather(*(self._send(i, asked) for i in instances))
        answered = [r for r in replies[: len(decodes)] if r is not None]
        return self._relayed(endpoint, answered[0] if answered else None)

    async def load(self, asked: Asked) -> Reply:
        """``{"server_load": n}``: the healthy decodes' loads summed (a
        decode's refusal, such as a 401, is relayed)."""
        endpoint = asked.endpoint
        decodes = self.registry.healthy(Role.DECODE)
        replies = await asyncio.gather(*(self._send(d, asked) for d in decodes))
        total = 0
        for reply in replies:
            if reply is None:
                continue
            if reply.status != 200:
                return self._relayed(endpoint, reply)
            try:
                load = msgspec.json.decode(reply.body).get("server_load")  # type: ignore[arg-type]
            except (msgspec.DecodeError, AttributeError):
                continue
            if isinstance(load, int) and not isinstance(load, bool):
                total += load
        self._count(endpoint, Outcome.OK)
        return Reply(200, JSON, msgspec.json.encode({"server_load": total}))
