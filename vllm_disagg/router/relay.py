"""D's streamed answer, relayed to the client chunk by chunk, byte for byte.

The stream owns what the decode leg handed it (D's response, D's lease,
the concurrent prefill task) and ends them once, however it ends: D's last
chunk, an error, or the client going away.
"""

from __future__ import annotations

import asyncio

import aiohttp

from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.exchange import Exchange
from vllm_disagg.router.health import InstanceHealth
from vllm_disagg.router.metrics import Outcome
from vllm_disagg.router.registry import Lease
from vllm_disagg.router.replies import error_json
from vllm_disagg.wire.logs import RateLimitedLog


class RelayStream:
    """An async iterator of D's chunks, for the HTTP layer.

    Quart iterates it and calls ``aclose()`` when the client goes away; a
    client that leaves between the headers and the first chunk never
    starts the iteration, hence ``__del__``. Either way D's connection is
    closed (vLLM aborts the request), its lease released and the outcome
    counted once.
    """

    def __init__(
        self,
        config: RouterConfig,
        health: InstanceHealth,
        limited_log: RateLimitedLog,
        ex: Exchange,
        lease: Lease,
        resp: aiohttp.ClientResponse,
        first: bytes,
        prefill_task: asyncio.Task | None,
    ) -> None:
        self._config = config
        self._health = health
        self._limited_log = limited_log
        self._ex = ex
        self._lease = lease
        self._decode = lease.instance
        self._resp = resp
        self._pending = first
        self._prefill_task = prefill_task
        self._at_event_boundary = True
        self._closed = False

    def __aiter__(self) -> RelayStream:
        return self

    async def __anext__(self) -> bytes:
        if self._pending:
            chunk, self._pending = self._pending, b""
            return self._relay(chunk)
        if self._closed:
            raise StopAsyncIteration
        config, ex = self._config, self._ex
        try:
            async with asyncio.timeout(min(config.chunk_timeout_s, ex.remaining())):
                chunk = await self._resp.content.readany()
        except TimeoutError:
            if ex.remaining() <= 0:
                return self._end(
                    Outcome.TIMEOUT,
                    None,
                    504,
                    f"request deadline ({config.request_timeout_s:g}s) exceeded",
                )
            self._health.suspect(self._decode)
            return self._end(
                Outcome.TIMEOUT,
                None,
                504,
                f"the decode instance sent nothing for {config.chunk_timeout_s:g}s",
            )
        except (aiohttp.ClientError, OSError) as e:
            self._limited_log.warning(
                "stream-broken",
                "decode instance %s broke the stream: %s",
                self._decode.http_addr,
                e,
            )
            return self._end(
                Outcome.UPSTREAM_ERROR,
                False,
                502,
                "the decode instance broke the stream",
            )
        if not chunk:
            self._close(Outcome.OK, True)
            raise StopAsyncIteration
        return self._relay(chunk)

    def _relay(self, chunk: bytes) -> bytes:
        self._at_event_boundary = chunk.endswith((b"\n\n", b"\r\n\r\n"))
        return chunk

    def _end(
        self, outcome: Outcome, instance_ok: bool | None, status: int, message: str
    ) -> bytes:
        """Stop the stream after an error: an SSE error event where one fits
        (vLLM's own format), then the end of the stream."""
        self._limited_log.warning(outcome, "%s", message)
        at_boundary = self._at_event_boundary
        self._close(outcome, instance_ok)
        if not at_boundary:
            raise StopAsyncIteration
        # As vLLM ends a stream that failed: the error event, then [DONE].
        return b"data: " + error_json(status, message) + b"\n\ndata: [DONE]\n\n"

    async def aclose(self) -> None:
        self._close(Outcome.CANCELLED, None)

    def __del__(self) -> None:
        self._close(Outcome.CANCELLED, None)

    def _close(self, outcome: Outcome, instance_ok: bool | None) -> None:
        if self._closed:
            return
        self._closed = True
        self._pending = b""
        self._resp.release()
        self._lease.release(instance_ok)
        self._ex.count(outcome)
        if self._prefill_task is not None:
            self._prefill_task.cancel()
