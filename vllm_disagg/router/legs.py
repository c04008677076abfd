"""The two legs of a request: the prefill request to P and the decode
request to D, each with its own timeout within the request deadline.

Each leg holds its instance through a lease and releases it with what the
instance did; the decode leg hands its lease, D's response and the
concurrent prefill task to the stream relay when D streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.exchange import Exchange, decode_body, prefill_body
from vllm_disagg.router.health import InstanceHealth, LegFailure
from vllm_disagg.router.metrics import Outcome, RouterMetrics
from vllm_disagg.router.registry import Instance, InstanceRegistry, Lease
from vllm_disagg.router.relay import RelayStream
from vllm_disagg.router.replies import (
    JSON,
    Reply,
    content_type,
    error_reply,
    relayed_headers,
)
from vllm_disagg.wire.logs import RateLimitedLog


@dataclass
class PrefillResult:
    """How a prefill leg ended. ``reason``: why it failed, as the failures
    listed to the client name it. ``reply``: answer the client with this
    instead of trying another P (P's 4xx, the deadline), counted as
    ``outcome``."""

    ok: bool
    elapsed_s: float
    reason: str = ""
    reply: Reply | None = None
    outcome: Outcome = Outcome.UPSTREAM_CLIENT_ERROR


@dataclass(eq=False)
class _PrefillInFlight:
    """A prefill request in flight, which ``end_prefill_legs`` can end."""

    timeout: asyncio.Timeout
    lost: LegFailure | None = None  # why its instance's legs were ended


class DecodeRefused(Exception):
    """A decode instance refused the connection: nothing reached the client."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class DecodeLost(Exception):
    """D failed after the request was sent and before the client got a byte
    (a restartable request: ``Exchange.restartable``): it may run again on
    another pair."""

    def __init__(self, instance: Instance, reason: str) -> None:
        super().__init__(reason)
        self.instance = instance
        self.reason = reason


class Legs:
    """Sends the legs of requests, one upstream session for all."""

    def __init__(
        self,
        config: RouterConfig,
        registry: InstanceRegistry,
        metrics: RouterMetrics,
        health: InstanceHealth,
        session: Callable[[], aiohttp.ClientSession],
        limited_log: RateLimitedLog,
    ) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.health = health
        self._session = session
        self.limited_log = limited_log
        # instance id -> the prefill legs in flight there (see end_prefill_legs)
        self._prefills: dict[str, set[_PrefillInFlight]] = {}
        # Continues a broken migratable stream elsewhere (Migrator.resume).
        self.resume: Callable[..., Awaitable] | None = None

    def post(self, ex: Exchange, instance: Instance, body: dict, request_id: str):
        headers = {**ex.headers, "Content-Type": JSON, "X-Request-Id": request_id}
        return self._session().post(
            f"http://{instance.http_addr}{ex.path}",
            data=ex.encode(body),
            headers=headers,
        )

    def deadline_reply(self) -> Reply:
        return error_reply(
            504, f"request deadline ({self.config.request_timeout_s:g}s) exceeded"
        )

    def end_prefill_legs(self, instance: Instance, why: LegFailure) -> None:
        """End the prefill legs in flight on ``instance`` now (each fails
        with ``why`` and no verdict on the instance: it is out of rotation
        already)."""
        for leg in self._prefills.pop(instance.instance_id, ()):
            leg.lost = why
            leg.timeout.reschedule(asyncio.get_running_loop().time())

    async def prefill(
        self, ex: Exchange, prefill: Instance, decode: Instance
    ) -> PrefillResult:
        request_id, peers = ex.name_peers(prefill, decode, self.config.token)
        started = time.monotonic()
        ok: bool | None = None
        leg: _PrefillInFlight | None = None
        lease = self.registry.reserve(prefill, ex.prompt_tokens)
        try:
            async with asyncio.timeout(
                min(self.config.prefill_timeout_s, ex.remaining())
            ) as t:
                leg = _PrefillInFlight(t)
                self._prefills.setdefault(prefill.instance_id, set()).add(leg)
                body = prefill_body(ex.body, peers, ex.path)
                async with self.post(ex, prefill, body, request_id) as resp:
                    data = await resp.read()
            ok = resp.status < 500
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            if leg is not None and leg.lost is not None:
                reason, ok = leg.lost, None  # already out of rotation
            else:
                reason, ok = self.health.judge(prefill, e)
            self.metrics.prefill_failures.labels(reason).inc()
            elapsed = time.monotonic() - started
            if reason is LegFailure.TIMEOUT and ex.remaining() <= 0:
                deadline = self.deadline_reply()
                return PrefillResult(False, elapsed, reason, deadline, Outcome.TIMEOUT)
            return PrefillResult(False, elapsed, reason)
        finally:
            lease.release(ok)
            legs = self._prefills.get(prefill.instance_id)
            if legs is not None:
                legs.discard(leg)  # type: ignore[arg-type]
                if not legs:
                    del self._prefills[prefill.instance_id]
        elapsed = time.monotonic() - started
        if resp.status >= 500:
            self.metrics.prefill_failures.labels(LegFailure.STATUS).inc()
            return PrefillResult(False, elapsed, f"status {resp.status}")
        if resp.status >= 400:  # the request itself is wrong: D would refuse it too
            reply = Reply(resp.status, content_type(resp), data)
            return PrefillResult(
                False,
                elapsed,
                f"status {resp.status}",
                reply,
                Outcome.UPSTREAM_CLIENT_ERROR,
            )
        return PrefillResult(True, elapsed)

    async def decode(
        self,
        ex: Exchange,
        lease: Lease,
        prefill: Instance | None,
        prefill_task: asyncio.Task | None = None,
    ) -> Reply:
        """Send D its request and relay the answer. Owns ``lease``, D's
        response and ``prefill_task`` (cancelled at the end: D no longer
        waits for its KV) until a stream relay takes them over. Raises
        DecodeRefused when D refused the connection (nothing was sent)."""
        decode = lease.instance
        if prefill is not None:
            request_id, peers = ex.name_peers(prefill, decode, self.config.token)
            body = decode_body(ex.body, peers)
        else:
            request_id, body = ex.request_id, decode_body(ex.body, None)
        # Streaming: D's headers come at once, its first chunk after the KV
        # wait and the first token. Otherwise the whole answer is the first
        # byte, bounded by the request deadline only.
        first_byte_s = ex.remaining()
        if ex.stream:
            first_byte_s = min(self.config.first_token_timeout_s, first_byte_s)
        started = time.monotonic()
        resp: aiohttp.ClientResponse | None = None
        ok: bool | None = None
        try:
            async with asyncio.timeout(first_byte_s):
                resp = await self.post(ex, decode, body, request_id)
                streamed = (
                    ex.stream
                    and resp.status == 200
                    and (resp.content_type == "text/event-stream")
                )
                data = await (resp.content.readany() if streamed else resp.read())
            ex.upstream_s += time.monotonic() - started
            ex.first_byte()
            if streamed:
                stream = RelayStream(
                    self.config,
                    self.health,
                    self.limited_log,
                    ex,
                    lease.transfer(),
                    resp,
                    data,
                    prefill_task,
                    self.resume,
                )
                reply = Reply(200, content_type(resp), stream, relayed_headers(resp))
                resp = prefill_task = None  # the stream's now
                return reply
            ok = resp.status < 500
            if resp.status < 400:
                ex.count(Outcome.OK)
            else:
                ex.count(
                    Outcome.UPSTREAM_CLIENT_ERROR if ok else Outcome.UPSTREAM_ERROR
                )
            return Reply(resp.status, content_type(resp), data, relayed_headers(resp))
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            reason, ok = self.health.judge(decode, e)
            self.limited_log.warning(
                "decode-" + reason,
                "decode instance %s: %s: %s",
                decode.http_addr,
                reason,
                e,
            )
            if reason is LegFailure.REFUSED:
                # Nothing was sent: another decode may take it.
                raise DecodeRefused(
                    "the decode instance refused the connection"
                ) from None
            if ex.restartable and reason in (LegFailure.CONNECTION, LegFailure.ERROR):
                raise DecodeLost(decode, reason) from None
            if reason is not LegFailure.TIMEOUT:
                return ex.error(
                    Outcome.UPSTREAM_ERROR,
                    502,
                    f"the decode instance failed ({reason})",
                )
            if ex.remaining() <= 0:
                ex.count(Outcome.TIMEOUT)
                return self.deadline_reply()
            return ex.error(
                Outcome.TIMEOUT,
                504,
                "the decode instance sent nothing within "
                f"{self.config.first_token_timeout_s:g}s",
            )
        finally:
            lease.release(ok)  # ok None: cancelled, says nothing; moved: no-op
            if resp is not None:
                resp.release()
            if prefill_task is not None:
                prefill_task.cancel()
