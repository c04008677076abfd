"""The router's service-discovery listener: a ZMQ ROUTER socket on the
discovery port (30001) that instances' DEALER sockets send ``Register``
heartbeats and ``Deregister`` to (wire format: ``vllm_disagg/wire/discovery.py``).

It runs as an asyncio task on the router's event loop, so the registry it
updates needs no lock. Every message gets an ``Ack``. A frame that fails to
authenticate, decode or validate is answered with the reason, counted by kind
and logged at most once per kind per interval: garbage costs a counter
increment, never the listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable

import zmq
import zmq.asyncio

from vllm_disagg import envs
from vllm_disagg.router.registry import InstanceRegistry, RegistryRefused
from vllm_disagg.wire.discovery import (
    MAX_FRAME_BYTES,
    MAX_REASON_CHARS,
    MIN_DISCOVERY_VERSION,
    Ack,
    Deregister,
    DiscoveryError,
    Register,
    open_frame,
    seal,
)
from vllm_disagg.wire.frames import MAC_BYTES, harden_listener
from vllm_disagg.wire.logs import RateLimitedLog
from vllm_disagg.wire.peers import format_addr, is_loopback, source_host

logger = logging.getLogger(__name__)

REJECTION_KINDS = (
    "malformed",
    "oversized",
    "unauthenticated",
    "stale",
    "version",
    "replayed",
    "full",
    "conflict",
)
# A peer sending a larger frame is disconnected by ZMQ before it is buffered;
# up to this size a frame reaches open_frame and is counted as "oversized".
MAX_ZMQ_FRAME_BYTES = 2 * MAX_FRAME_BYTES + MAC_BYTES
UNKNOWN_SENDER = "unknown"


def _source_ip(frame) -> str | None:
    """The IP address a message came from (libzmq's Peer-Address), canonical."""
    try:
        return source_host(frame.get("Peer-Address"))
    except (zmq.ZMQError, KeyError, AttributeError):
        return None


class DiscoveryServer:
    def __init__(
        self,
        registry: InstanceRegistry,
        *,
        host: str,
        port: int,
        token: bytes | None,
        wall_clock: Callable[[], float] = time.time,
        allow_remote_unsigned: bool = False,
        loopback_only: bool = False,
    ) -> None:
        self.registry = registry
        self.allow_remote_unsigned = allow_remote_unsigned
        # The token is the local cookie (wire/cookie.py): nobody beyond
        # loopback can have it, so say so instead of "bad MAC".
        self.loopback_only = loopback_only
        self.host = host
        self.port = port  # the bound port once started (port 0: a free one)
        self._token = token
        self._wall_clock = wall_clock
        self.accepted: Counter[str] = Counter(register=0, deregister=0)
        self.rejected: Counter[str] = Counter(dict.fromkeys(REJECTION_KINDS, 0))
        self._log = RateLimitedLog(logger)
        self._ctx: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None

    @property
    def endpoint(self) -> str:
        return f"tcp://{format_addr(self.host, self.port)}"

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        harden_listener(sock, MAX_ZMQ_FRAME_BYTES)
        sock.setsockopt(zmq.IPV6, 1 if ":" in self.host else 0)
        try:
            sock.bind(f"tcp://{format_addr(self.host, self.port or '*')}")
        except zmq.ZMQError:
            sock.close()
            self._ctx.term()
            self._ctx = None
            raise
        self.port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._socket = sock
        self._task = asyncio.create_task(self._serve(), name="router-discovery")
        if self._token is None:
            logger.warning(
                "discovery on %s accepts unsigned registrations: set %s or "
                "--registration-token",
                self.endpoint,
                envs.VLLM_DISAGG_ROUTER_TOKEN,
            )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._socket is not None:
            self._socket.close()
        if self._ctx is not None:
            self._ctx.term()

    async def _serve(self) -> None:
        assert self._socket is not None
        while True:
            raw = await self._socket.recv_multipart(copy=False)
            frames = [f.bytes for f in raw]
            try:
                reply = self.handle(
                    frames[1:], _source_ip(raw[1]) if len(raw) > 1 else None
                )
            except Exception:  # a bug here must not end discovery for the fleet
                logger.exception("discovery: failed to handle a message")
                continue
            with contextlib.suppress(zmq.Again):  # the sender stopped reading: drop
                await self._socket.send_multipart(
                    [frames[0], *reply], flags=zmq.NOBLOCK
                )
            # pyzmq returns finished futures while messages are queued, so
            # without this a flood of frames would never let a request run.
            await asyncio.sleep(0)

    def handle(self, frames: list[bytes], source: str | None = None) -> list[bytes]:
        """One message (the frames after the sender's identity) -> the Ack
        frames; ``source``: the IP it came from, when known."""
        try:
            if (
                self._token is None
                and not self.allow_remote_unsigned
                and source is not None
                and not is_loopback(source)
            ):
                raise DiscoveryError(
                    "unauthenticated",
                    "unsigned registrations are accepted "
                    "from loopback only (set a registration token)",
                )
            if self.loopback_only and source is not None and not is_loopback(source):
                raise DiscoveryError(
                    "unauthenticated",
                    "this router's token is its user's local cookie, for loopback "
                    "only (give the router and the instances "
                    f"{envs.VLLM_DISAGG_ROUTER_TOKEN})",
                )
            msg = open_frame(self._token, frames, now=self._wall_clock())
            if not isinstance(msg, Register | Deregister):
                raise DiscoveryError("malformed", f"unexpected {type(msg).__name__}")
        except DiscoveryError as e:
            self.rejected[e.kind] += 1
            self._log.warning(e.kind, "discovery: rejected a frame: %s", e)
            reason = str(e)[:MAX_REASON_CHARS]
            return seal(
                # The oldest version: every instance this router takes reads it.
                self._token,
                Ack(MIN_DISCOVERY_VERSION, UNKNOWN_SENDER, False, reason),
            )
        if isinstance(msg, Register):
            try:
                self.registry.register(msg)
            except RegistryRefused as e:
                self.rejected[e.kind] += 1
                self._log.warning(
                    e.kind, "discovery: refused %s: %s", msg.instance_id, e
                )
                return seal(
                    self._token,
                    Ack(
                        msg.version,
                        msg.instance_id,
                        False,
                        f"{e.kind}: {e}"[:MAX_REASON_CHARS],
                    ),
                )
            self.accepted["register"] += 1
        else:
            self.registry.deregister(msg.instance_id)
            self.accepted["deregister"] += 1
        # Answered in the sender's version: an older instance reads it.
        return seal(self._token, Ack(msg.version, msg.instance_id, True))
