"""D's streamed answer, relayed to the client chunk by chunk, byte for byte.

The stream owns what the decode leg handed it (D's response, D's lease,
the concurrent prefill task) and ends them once, however it ends: D's last
chunk, an error, or the client going away.

A migratable stream (``ex.ledger``, ``migration.py``) is relayed event by
event through its ledger; when D breaks it, stalls or ends it early, the
stream goes on with a continuation on another pair (``resume``:
``Migrator.resume``), or ends with vLLM's error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp

from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.exchange import Exchange
from vllm_disagg.router.health import InstanceHealth
from vllm_disagg.router.metrics import Outcome
from vllm_disagg.router.migration import Refused, error_events
from vllm_disagg.router.registry import Instance, Lease
from vllm_disagg.router.replies import error_json
from vllm_disagg.wire.logs import RateLimitedLog

# What the client's error event says happened, by migration's ``why``.
FAILURES = {
    "broken": "the decode instance broke the stream",
    "ended": "the decode instance ended the stream early",
    "stalled": "the decode instance sent nothing for {chunk_timeout_s:g}s",
}


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
        resume: Callable[[Exchange, Instance, str], Awaitable] | None = None,
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
        self._ledger = ex.ledger
        self._resume = resume if ex.ledger is not None else None

    def __aiter__(self) -> RelayStream:
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._pending:
                chunk, self._pending = self._pending, b""
                if out := self._relay(chunk):
                    return out
                continue
            if self._closed:
                raise StopAsyncIteration
            chunk, failure = await self._read()
            if failure is not None:
                if isinstance(failure, bytes):
                    return failure
                if (moved := await self._migrate(*failure)) is not None:
                    return moved
                continue
            if not chunk:
                ledger = self._ledger
                if (
                    ledger is not None
                    and ledger.ident
                    and not (ledger.done or ledger.failed)
                ):
                    # D went away without [DONE]: it died between two events.
                    failure = ("ended", False, Outcome.UPSTREAM_ERROR, 502)
                    if (moved := await self._migrate(*failure)) is not None:
                        return moved
                    continue
                self._close(Outcome.OK, True)
                raise StopAsyncIteration
            self._pending = chunk

    async def _read(self) -> tuple[bytes, bytes | tuple | None]:
        """D's next bytes; or, when D failed, the stream's last bytes (no
        migration) or why D failed and what that says of D (migration)."""
        config, ex = self._config, self._ex
        try:
            async with asyncio.timeout(min(config.chunk_timeout_s, ex.remaining())):
                return await self._resp.content.readany(), None
        except TimeoutError:
            if ex.remaining() <= 0:
                return b"", self._end(
                    Outcome.TIMEOUT,
                    None,
                    504,
                    f"request deadline ({config.request_timeout_s:g}s) exceeded",
                )
            self._health.suspect(self._decode)
            if self._resume is not None:
                return b"", ("stalled", None, Outcome.TIMEOUT, 504)
            self._not_migrated()
            return b"", self._end(
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
            if self._resume is not None:
                return b"", ("broken", False, Outcome.UPSTREAM_ERROR, 502)
            self._not_migrated()
            return b"", self._end(
                Outcome.UPSTREAM_ERROR,
                False,
                502,
                "the decode instance broke the stream",
            )

    def _not_migrated(self) -> None:
        """Count a failed stream migration would not continue (its options)."""
        if self._ex.not_migratable is not None:
            self._ex.metrics.migrations.labels(
                "not_migratable", self._ex.not_migratable
            ).inc()

    async def _migrate(
        self, why: str, instance_ok: bool | None, outcome: Outcome, status: int
    ) -> bytes | None:
        """Go on with a continuation on another pair (None: read on), or end
        the stream with the reason it cannot (its last bytes)."""
        assert self._resume is not None and self._ledger is not None
        self._ledger.reset_buffer()
        if (closing := self._ledger.closing_events()) is not None:
            # Every token was sent; only D's usage chunk and [DONE] were lost.
            self._close(Outcome.OK, instance_ok)
            return closing
        # D's request ends now (a stalled D aborts it), not after the move.
        self._resp.release()
        self._lease.release(instance_ok)
        if self._prefill_task is not None:
            self._prefill_task.cancel()
            self._prefill_task = None
        opened = await self._resume(self._ex, self._decode, why)
        if isinstance(opened, Refused):
            failure = FAILURES[why].format(chunk_timeout_s=self._config.chunk_timeout_s)
            message = f"{failure}, {opened.message}"
            self._limited_log.warning(opened.outcome, "%s", message)
            self._close(outcome, instance_ok)
            return error_events(status, message)
        self._resp, self._lease = opened.resp, opened.lease
        self._decode = opened.lease.instance
        self._pending = opened.first
        return None

    def _relay(self, chunk: bytes) -> bytes:
        ledger = self._ledger
        if ledger is not None:
            out = ledger.feed(chunk)
            if ledger.join_failed and not self._closed:
                # The continuation's error event ends the stream; D's request
                # is aborted with the connection.
                self._ex.metrics.migrations.labels(
                    "not_joined", ledger.join_failed.replace(" ", "_")
                ).inc()
                self._limited_log.warning(
                    "not_joined",
                    "request %s: the continuation on %s did not repeat the %s "
                    "the client had",
                    self._ex.request_id,
                    self._decode.http_addr,
                    ledger.join_failed,
                )
                self._close(Outcome.UPSTREAM_ERROR, None)
            elif ledger.malformed and not self._closed:
                # The decode broke vLLM's stream format: its error event
                # ends the stream, and it counts as a failure of the decode.
                self._limited_log.warning(
                    "malformed-stream",
                    "request %s: decode %s broke the stream's format (%s)",
                    self._ex.request_id,
                    self._decode.http_addr,
                    ledger.malformed,
                )
                self._close(Outcome.UPSTREAM_ERROR, False)
            elif ledger.done and not self._closed:
                # [DONE] ended the client's stream: whatever D does to its
                # connection afterwards (breaks, stalls, drips) ends nothing
                # more and is never continued.
                self._close(Outcome.OK, True)
            return out
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
