"""Bounds on what one client connection may cost the router.

uvicorn's httptools protocol has no limit on header size (a client that
never ends its header block grows the router by gigabytes), no deadline for
a request's headers or body (idle and slow connections are held forever, and
file descriptors run out), and no deadline for a client that stops reading
its answer. The router is a fleet's public entry point, so it adds them here,
in a subclass of that protocol (``http=`` of ``uvicorn.Config`` takes a
class):

* **connections**: past ``max_connections`` a new connection is answered
  503 and closed at once, so the file descriptors left serve the upstream
  legs of the requests in flight;
* **headers**: ``max_header_bytes`` of request line and headers (431), all
  of them within ``header_timeout_s`` of the connection opening or the
  request's first byte (idle keep-alive connections are closed by uvicorn's
  own keep-alive timeout);
* **body and answer**: a body that stops arriving, or an answer the client
  stops reading, for ``idle_timeout_s``, or a body not whole within
  ``body_timeout_s`` (a byte every few seconds defeats any idle timeout):
  the connection is dropped, which the app sees as a client disconnect (the
  upstream legs are cancelled);
* **pipelining**: at most MAX_PIPELINED requests queued behind the one being
  answered (uvicorn queues any number, each with its parsed head).

Every connection closed for a bound is counted by reason through
``on_closed`` (``vllm_disagg_router_client_connections_closed_total``), and
uvicorn's own warning per broken request is rate-limited (a stranger sending
junk would otherwise write one log line per connection).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from vllm_disagg.router.replies import error_json
from vllm_disagg.wire.logs import RateLimitedLog

logger = logging.getLogger(__name__)

# Reasons a connection is closed (label values of the metric).
TOO_MANY_CONNECTIONS = "too_many_connections"
HEADERS_TOO_LARGE = "headers_too_large"
HEADER_TIMEOUT = "header_timeout"
BODY_TIMEOUT = "body_timeout"
WRITE_TIMEOUT = "write_timeout"
INVALID_HTTP = "invalid_http"  # the parser refused the bytes (uvicorn answers 400)
TOO_MANY_PIPELINED = "too_many_pipelined"
REASONS = (
    TOO_MANY_CONNECTIONS,
    HEADERS_TOO_LARGE,
    HEADER_TIMEOUT,
    BODY_TIMEOUT,
    WRITE_TIMEOUT,
    INVALID_HTTP,
    TOO_MANY_PIPELINED,
)
MAX_PIPELINED = 16


@dataclass(frozen=True)
class ClientLimits:
    max_connections: int
    max_header_bytes: int
    header_timeout_s: float
    idle_timeout_s: float
    body_timeout_s: float
    on_closed: Callable[[str], None] = lambda reason: None


def _plain_response(status: HTTPStatus, message: str) -> bytes:
    """A whole HTTP/1.1 answer, written before any request was parsed."""
    body = error_json(status.value, message, error_type=status.phrase)
    return (
        f"HTTP/1.1 {status.value} {status.phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
        + body
    )


_TOO_MANY = _plain_response(HTTPStatus.SERVICE_UNAVAILABLE, "too many connections")
_TOO_LARGE = _plain_response(
    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request headers too large"
)


# What uvicorn logs once per broken request, at WARNING, on "uvicorn.error".
UVICORN_PER_REQUEST_WARNINGS = frozenset(
    {
        "Invalid HTTP request received.",
        "Unsupported upgrade request.",
    }
)


class _RateLimitUvicornWarnings(logging.Filter):
    """Holds back uvicorn's per-request warnings; at most one line per
    interval says how many there were (each is counted on /metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self._log = RateLimitedLog(logger)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message not in UVICORN_PER_REQUEST_WARNINGS:
            return True
        self._log.warning(
            message,
            "uvicorn: %s (every one is counted in client_connections_closed_total)",
            message,
        )
        return False


def rate_limit_uvicorn_warnings() -> None:
    """Install the filter on uvicorn's error logger, once per process."""
    uvicorn_logger = logging.getLogger("uvicorn.error")
    if not any(
        isinstance(f, _RateLimitUvicornWarnings) for f in uvicorn_logger.filters
    ):
        uvicorn_logger.addFilter(_RateLimitUvicornWarnings())


def limited_protocol(limits: ClientLimits) -> type[HttpToolsProtocol]:
    """Uvicorn's httptools protocol with ``limits`` applied."""
    rate_limit_uvicorn_warnings()

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            # From a request's first byte (or the connection's) to its last header.
            self._in_head = True
            self._in_body = False  # from its last header to its last body byte
            self._head_bytes = (
                0  # received since the last complete head, outside bodies
            )
            self._head_timer: asyncio.TimerHandle | None = None
            self._body_timer: asyncio.TimerHandle | None = None
            self._body_deadline: asyncio.TimerHandle | None = None
            self._write_timer: asyncio.TimerHandle | None = None

        # --- connection ---

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self._refuse(TOO_MANY_CONNECTIONS, _TOO_MANY)
                return
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timers()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return  # refused or dropped: nothing more is parsed
            # httptools buffers a header until it ends, so a head that does
            # not end is measured here: every byte outside a body since the
            # last head ended (the chunk that ends a head resets the count as
            # it is parsed); a head that ends is measured whole in
            # on_headers_complete.
            if not self._in_body:
                self._head_bytes += len(data)
            super().data_received(data)
            if not self._in_body and self._head_bytes > limits.max_header_bytes:
                self._refuse(HEADERS_TOO_LARGE, _TOO_LARGE)

        # --- parser callbacks ---

        def on_message_begin(self) -> None:
            self._in_head = True
            self._arm_head_timer()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes = False, 0
            self._cancel(self._head_timer)
            self._head_timer = None
            if self.transport.is_closing():
                return
            # A whole head can arrive in one read: measure what was parsed
            # (request target, names, values, separators).
            size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
            if size > limits.max_header_bytes:
                self._refuse(HEADERS_TOO_LARGE, _TOO_LARGE)
                return
            answering = self.cycle is not None and not self.cycle.response_complete
            if answering and len(self.pipeline) >= MAX_PIPELINED:
                self._drop(TOO_MANY_PIPELINED)
                return
            self._in_body = True
            self._arm_body_timer()
            self._cancel(self._body_deadline)
            self._body_deadline = self.loop.call_later(
                limits.body_timeout_s, self._expire, "body_deadline"
            )
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if self.transport.is_closing():
                return
            self._arm_body_timer()
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._in_body = False
            for timer in (self._body_timer, self._body_deadline):
                self._cancel(timer)
            self._body_timer = self._body_deadline = None
            if self.transport.is_closing():
                return
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            if self.transport.is_closing():
                return
            self._cancel_timers()
            limits.on_closed(INVALID_HTTP)
            super().send_400_response(msg)

        # --- flow control: a client that stops reading its answer ---

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(
                    limits.idle_timeout_s, self._expire, "write"
                )

        def resume_writing(self) -> None:
            self._cancel(self._write_timer)
            self._write_timer = None
            super().resume_writing()

        # --- timers ---

        def _arm_head_timer(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(
                    limits.header_timeout_s, self._expire, "head"
                )

        def _arm_body_timer(self) -> None:
            self._cancel(self._body_timer)
            self._body_timer = self.loop.call_later(
                limits.idle_timeout_s, self._expire, "body_idle"
            )

        def _expire(self, timer: str) -> None:
            """``timer`` ran out: "head", "body_idle", "body_deadline" or "write"."""
            if timer == "head":
                self._head_timer = None
                if self._in_head:
                    self._drop(HEADER_TIMEOUT)
            elif timer == "body_idle":
                self._body_timer = None
                if self._in_body and self.flow is not None and self.flow.read_paused:
                    self._arm_body_timer()  # the app is behind, not the client
                elif self._in_body:
                    self._drop(BODY_TIMEOUT)
            elif timer == "body_deadline":
                self._body_deadline = None
                if self._in_body:
                    self._drop(BODY_TIMEOUT)
            else:
                self._write_timer = None
                self._drop(WRITE_TIMEOUT)

        def _refuse(self, reason: str, response: bytes) -> None:
            if self.transport.is_closing():
                return
            self.transport.write(response)
            self.transport.close()
            self._cancel_timers()
            limits.on_closed(reason)

        def _drop(self, reason: str) -> None:
            if self.transport.is_closing():
                return
            # abort, not close: close would wait to flush to a client that
            # does not read.
            self.transport.abort()
            self._cancel_timers()
            limits.on_closed(reason)

        @staticmethod
        def _cancel(timer: asyncio.TimerHandle | None) -> None:
            if timer is not None:
                timer.cancel()

        def _cancel_timers(self) -> None:
            for timer in (
                self._head_timer,
                self._body_timer,
                self._body_deadline,
                self._write_timer,
            ):
                self._cancel(timer)
            self._head_timer = self._body_timer = self._body_deadline = (
                self._write_timer
            ) = None

    return LimitedHttpToolsProtocol
