"""The fleet feeds of ``--workers N`` (``workers.py``): the supervisor's
discovery listener that forwards what it accepted, and a worker's discovery
that applies it.

Each worker has a feed of its own: a ZMQ PUSH socket of the supervisor's,
connected before the worker starts (messages queue while it boots), to the
worker's PULL on a Unix socket in the supervisor's private 0700 directory.
A feed opens with the last accepted ``Register`` of every live instance,
the discovery counts and ``KNOWN``; a worker serves no request before
``KNOWN``. Messages: ``[MESSAGE, source address, *the sender's frames]``
(the worker runs the same checks on them), ``[COUNTS, json]`` every second,
``[KNOWN]``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from vllm_disagg.router.discovery import DiscoveryServer
from vllm_disagg.router.registry import Instance, InstanceRegistry
from vllm_disagg.wire.discovery import open_frame

logger = logging.getLogger(__name__)

MESSAGE = b"m"  # [MESSAGE, source ip, *the sender's frames]
COUNTS = b"c"  # [COUNTS, json {"accepted": {...}, "rejected": {...}}]
KNOWN = b"k"  # [KNOWN]: the fleet as known when the feed opened was sent
FEED_START_TIMEOUT_S = 30.0
FEED_HWM = 100_000  # messages queued for a worker that is not reading


def feed_endpoint(directory: str, index: int) -> str:
    return f"ipc://{directory}/worker-{index}.feed"


class ForwardingDiscovery(DiscoveryServer):
    """The supervisor's discovery listener: answers as a single router's,
    and hands every accepted message to the workers' feeds."""

    def __init__(self, registry: InstanceRegistry, **kwargs: Any) -> None:
        super().__init__(registry, **kwargs)
        self._feeds: dict[int, zmq.Socket] = {}
        self._sync_ctx = zmq.Context()
        # The last accepted Register of each live instance: a new feed's start.
        self._latest: dict[str, list[bytes]] = {}
        self.dropped = 0  # messages a worker's full feed could not take
        registry.on_removed.append(self._removed)

    def handle(self, frames: list[bytes], source: str | None = None) -> list[bytes]:
        registered, total = self.accepted["register"], self.accepted.total()
        reply = super().handle(frames, source)
        if self.accepted.total() == total:
            return reply  # rejected: the workers never see it
        message = [MESSAGE, (source or "").encode(), *frames]
        if self.accepted["register"] != registered:
            msg = open_frame(self._token, frames, now=self._wall_clock())
            self._latest[msg.instance_id] = message
        for index in list(self._feeds):
            self._send(index, message)
        return reply

    def _removed(self, instance: Instance, reason: str) -> None:
        self._latest.pop(instance.instance_id, None)

    def open_feed(self, directory: str, index: int) -> None:
        """(Re)open worker ``index``'s feed before it starts: messages queue
        until it binds, the fleet as known now first."""
        self.close_feed(index)
        sock = self._sync_ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, FEED_HWM)
        sock.connect(feed_endpoint(directory, index))
        self._feeds[index] = sock
        for message in self._latest.values():
            self._send(index, message)
        self.send_counts(index)
        self._send(index, [KNOWN])

    def close_feed(self, index: int) -> None:
        sock = self._feeds.pop(index, None)
        if sock is not None:
            sock.close()

    def send_counts(self, index: int | None = None) -> None:
        payload = msgspec.json.encode(
            {"accepted": dict(self.accepted), "rejected": dict(self.rejected)}
        )
        for i in [index] if index is not None else list(self._feeds):
            self._send(i, [COUNTS, payload])

    def _send(self, index: int, message: list[bytes]) -> None:
        try:
            self._feeds[index].send_multipart(message, zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1  # a heartbeat again within seconds heals it

    async def close(self) -> None:
        for index in list(self._feeds):
            self.close_feed(index)
        self._sync_ctx.term()
        await super().close()


class FleetFeed(DiscoveryServer):
    """A worker's discovery: what the supervisor accepted, applied through
    the same checks to this worker's registry; counts are the supervisor's."""

    def __init__(self, registry: InstanceRegistry, *, feed: str, **kwargs: Any) -> None:
        super().__init__(registry, **kwargs)
        self._feed = feed

    @property
    def endpoint(self) -> str:
        return f"the supervisor's feed ({self._feed})"

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self._feed)
        self._socket = sock
        # Serve no request before the fleet is known: the kernel hands this
        # worker connections as soon as it accepts.
        try:
            async with asyncio.timeout(FEED_START_TIMEOUT_S):
                while self._apply(await sock.recv_multipart()) != KNOWN:
                    pass
        except TimeoutError:
            logger.warning(
                "router worker: the supervisor sent no fleet within %.0fs; serving "
                "with what arrives",
                FEED_START_TIMEOUT_S,
            )
        self._task = asyncio.create_task(self._serve(), name="router-fleet-feed")

    async def _serve(self) -> None:
        assert self._socket is not None
        while True:
            self._apply(await self._socket.recv_multipart())
            await asyncio.sleep(0)

    def _apply(self, frames: list[bytes]) -> bytes:
        """Apply one feed message; returns its kind."""
        try:
            if frames[0] == MESSAGE and len(frames) > 2:
                self.handle(frames[2:], frames[1].decode() or None)
            elif frames[0] == COUNTS and len(frames) == 2:
                counts = msgspec.json.decode(frames[1])
                self.accepted = Counter(counts["accepted"])
                self.rejected = Counter(counts["rejected"])
        except Exception:  # the supervisor's own messages: a bug, not an attack
            logger.exception("router worker: failed to apply a fleet message")
        return frames[0]
