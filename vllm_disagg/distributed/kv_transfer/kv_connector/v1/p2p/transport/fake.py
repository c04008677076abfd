"""In-process transport for tests: both ends of a channel live in one process.

It keeps the real transports' contract (set-up exchange, deadlines, byte
counts, a failure breaks the link for both ends, ``close`` wakes blocked
calls) so engine tests exercise the same paths, and it lets a test inject
failures: :meth:`FakeTransport.break_all`, or ``fail_next_send`` /
``fail_next_recv`` on one channel.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
import weakref
from collections.abc import Sequence

import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    AcceptFinish,
    Channel,
    InitiateFinish,
    Transport,
    TransportError,
    byte_views,
    remaining,
)

TOKEN_BYTES = 16
_REPLY = b"fake-ok"
_CPU = torch.device("cpu")


class _Link:
    """The shared state of one channel: a queue of uint8 tensors per direction."""

    def __init__(self) -> None:
        self.queues: tuple[queue.Queue, queue.Queue] = (queue.Queue(), queue.Queue())
        # Set by each side's finish; a finish returns once both are (NCCL-like).
        self.joined = (threading.Event(), threading.Event())
        self.error: str | None = None
        self._lock = threading.Lock()

    def break_(self, reason: str) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = reason
        for q in self.queues:
            q.put(None)  # wakes a receiver blocked on either side


# token -> link waiting for its acceptor; every link not yet garbage
_pending: dict[bytes, _Link] = {}
_live_links: weakref.WeakSet[_Link] = weakref.WeakSet()
_registry_lock = threading.Lock()


class FakeChannel(Channel):
    def __init__(self, link: _Link, side: int):
        self._link = link
        self._out = link.queues[side]
        self._in = link.queues[1 - side]
        #: test hooks: the next send / recv fails and breaks the link
        self.fail_next_send = False
        self.fail_next_recv = False

    def send(self, tensors: Sequence[torch.Tensor], deadline: float) -> None:
        self._check("send", deadline)
        if self.fail_next_send:
            self.fail_next_send = False
            raise self._fail("injected send failure")
        views = byte_views(tensors, _CPU)
        # A copy, so the sender may reuse its tensors at once.
        self._out.put(torch.cat(views) if views else torch.empty(0, dtype=torch.uint8))

    def recv(self, tensors: Sequence[torch.Tensor], deadline: float) -> None:
        self._check("recv", deadline)
        if self.fail_next_recv:
            self.fail_next_recv = False
            raise self._fail("injected recv failure")
        views = byte_views(tensors, _CPU)
        expected = sum(v.numel() for v in views)
        try:
            payload = self._in.get(timeout=remaining(deadline, "recv"))
        except queue.Empty:
            raise self._fail("recv: deadline passed") from None
        if payload is None or self._link.error is not None:
            raise TransportError(self._link.error or "channel closed")
        if payload.numel() != expected:
            raise self._fail(
                f"peer sent {payload.numel()} bytes, receiver expects {expected}"
            )
        offset = 0
        for v in views:
            v.copy_(payload[offset : offset + v.numel()])
            offset += v.numel()

    def close(self) -> None:
        self._link.break_("channel closed")

    def _check(self, what: str, deadline: float) -> None:
        if self._link.error is not None:
            raise TransportError(self._link.error)
        try:
            remaining(deadline, what)
        except TransportError as e:
            raise self._fail(str(e)) from None

    def _fail(self, reason: str) -> TransportError:
        self._link.break_(reason)
        return TransportError(self._link.error)


def _join(link: _Link, side: int, deadline: float) -> FakeChannel:
    link.joined[side].set()
    if not link.joined[1 - side].wait(max(0.0, deadline - time.monotonic())):
        raise TransportError("fake set-up: peer did not join by the deadline")
    return FakeChannel(link, side)


class FakeTransport(Transport):
    """Channels within this process; setup bytes are a registry token."""

    name = "fake"

    def initiate(self, peer_host: str | None = None) -> tuple[bytes, InitiateFinish]:
        token = secrets.token_bytes(TOKEN_BYTES)
        link = _Link()
        with _registry_lock:
            _pending[token] = link
            _live_links.add(link)

        def finish(reply: bytes, deadline: float) -> Channel:
            try:
                if reply != _REPLY:
                    raise TransportError(f"malformed fake reply {reply[:32]!r}")
                return _join(link, 0, deadline)
            finally:
                with _registry_lock:
                    _pending.pop(token, None)

        return token, finish

    def accept(
        self, setup: bytes, peer_host: str | None = None
    ) -> tuple[bytes, AcceptFinish]:
        if len(setup) != TOKEN_BYTES:
            raise TransportError(
                f"fake setup must be {TOKEN_BYTES} bytes, got {len(setup)}"
            )
        with _registry_lock:
            link = _pending.get(bytes(setup))
        if link is None:
            raise TransportError("unknown fake setup token")

        return _REPLY, lambda deadline: _join(link, 1, deadline)

    @staticmethod
    def break_all(reason: str = "injected failure") -> None:
        """Break every fake channel of this process, as a network outage would."""
        with _registry_lock:
            links = list(_live_links)
        for link in links:
            link.break_(reason)
