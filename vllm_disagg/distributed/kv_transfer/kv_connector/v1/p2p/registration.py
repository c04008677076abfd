"""Registration with the router(s): the instance side of service discovery.

The scheduler-side connector starts one :class:`RegistrationClient` per
engine core, so one per DP rank: with one ``vllm serve`` per rank (external
load balancing) every rank is an instance a router can address (behind one
API server only its first rank registers, see
:func:`registers_for_its_api_server`). Its daemon
thread sends every router named in ``proxy_ip`` a ``Register`` (the whole
state of the instance, see ``vllm_disagg/wire/discovery.py``) every
``interval_s``, from one DEALER socket per router, and a ``Deregister`` on
:meth:`RegistrationClient.close`.

Nothing here may hold up or break the engine core: sockets never block
(``IMMEDIATE``: nothing is queued for a router that is not connected; a small
``SNDHWM`` for one that is connected but stuck; ``NOBLOCK`` sends, a dropped
heartbeat is healed by the next one), the thread only polls with timeouts,
and ``close()`` is bounded. A router that restarts is registered with again
by the next heartbeat after ZMQ reconnects (within about a second).
"""

from __future__ import annotations

import atexit
import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import zmq

from vllm_disagg import envs
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.api_address import (
    advertised_http_problems,
    api_listen_addr,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import dp_rank_of
from vllm_disagg.errors import ConfigError
from vllm_disagg.logger import init_logger
from vllm_disagg.wire.discovery import (
    DISCOVERY_VERSION,
    HEARTBEAT_INTERVAL_S,
    MAX_FRAME_BYTES,
    MAX_ID_CHARS,
    MIN_DISCOVERY_VERSION,
    Ack,
    Deregister,
    DiscoveryError,
    Register,
    Role,
    open_frame,
    seal,
    validate,
)
from vllm_disagg.wire.groups import dp_group_of
from vllm_disagg.wire.logs import RateLimitedLog
from vllm_disagg.wire.peers import format_addr, split_addr

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import P2pConfig
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.progress import (
        EngineProgress,
    )

logger = init_logger(__name__)

DEREGISTER_TIMEOUT_S = 0.5  # close(): how long Deregister may take to leave
WARN_INTERVAL_S = 60.0  # at most one warning per router per minute
SILENT_HEARTBEATS = (
    5  # heartbeats unanswered, or intervals unconnected, before a warning
)
HTTP_WAIT_S = 120.0  # register anyway when the API server stays unreachable
HTTP_RETRY_S = 0.5
POLL_S = 0.1  # how soon close() is noticed, and how soon a heartbeat to a
# router that was not connected yet is retried (a fresh socket connects
# asynchronously: without the retry the first Register would wait an interval)
SNDHWM = 4
RECONNECT_IVL_MAX_MS = 1000


def make_instance_id(kv_addr: str) -> str:
    """Unique per process incarnation; readable where it fits."""
    suffix = uuid.uuid4().hex[:12]
    readable = f"{kv_addr}@{suffix}"
    return readable if len(readable) <= MAX_ID_CHARS else suffix


@dataclass
class _Router:
    addr: str
    sock: zmq.Socket
    seq: int = 0  # heartbeats handed to this router's socket
    due: float = 0.0  # monotonic time of its next heartbeat
    down_since: float | None = None  # not connected since
    registered: bool = False  # its last answer accepted us
    unanswered: int = 0  # heartbeats sent since its last answer


class RegistrationClient:
    """Keeps one instance registered with every router; see the module docstring."""

    def __init__(
        self,
        *,
        routers: Sequence[tuple[str, int]],
        role: Role,
        http_addr: str,
        kv_addr: str,
        model: str,
        aliases: Sequence[str] = (),
        dp_rank: int = 0,
        dp_size: int = 1,
        token: bytes | None = None,
        interval_s: float = HEARTBEAT_INTERVAL_S,
        wait_for_http: bool = True,
        progress: EngineProgress | None = None,
        fingerprint: str = "",
        max_model_len: int = 0,
        listen_addr: str | None = None,
        dp_group: str = "",
    ):
        if not routers:
            raise ValueError("no router to register with")
        self.routers = [format_addr(host, port) for host, port in routers]
        self.token = token or None
        self.interval_s = interval_s
        self.instance_id = make_instance_id(kv_addr)
        self._template = Register(
            version=DISCOVERY_VERSION if dp_group else MIN_DISCOVERY_VERSION,
            instance_id=self.instance_id,
            role=role,
            http_addr=http_addr,
            kv_addr=kv_addr,
            model=model,
            aliases=tuple(aliases),
            dp_rank=dp_rank,
            dp_size=dp_size,
            interval_s=interval_s,
            fingerprint=fingerprint,
            max_model_len=max_model_len,
            dp_group=dp_group,
        )
        try:
            validate(self._template)
        except DiscoveryError as e:
            raise ConfigError(f"cannot register with the router: {e}") from None
        # The router forwards requests to http_addr as soon as it knows us, so
        # the first Register waits until the API server accepts connections:
        # where it listens (``listen_addr``), which behind a NAT is not the
        # advertised http_addr this host may not reach (no hairpin).
        probe = listen_addr or http_addr
        self._http_probe = split_addr(probe, "listen_addr") if wait_for_http else None
        # Once the API server answered, it is asked again before each round
        # of heartbeats: an engine core whose API server died (killed; the
        # engine core outlives it) must not keep the instance listed.
        self._api_probe: tuple[str, int] | None = None
        self._api_gone = False
        self._api_checked_at = -float("inf")
        self._progress = progress
        self._stop = threading.Event()
        self._closed = False
        self._log = RateLimitedLog(logger, WARN_INTERVAL_S)
        self._thread = threading.Thread(
            target=self._run, name=f"p2p-registration-dp{dp_rank}", daemon=True
        )

    def start(self) -> RegistrationClient:
        self._thread.start()
        # Fallback for an engine that is never shut down: at interpreter exit,
        # bounded like every close(); close() unregisters it.
        atexit.register(self.close)
        return self

    def close(self) -> None:
        """Deregister from every router (best effort, within
        DEREGISTER_TIMEOUT_S) and stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=DEREGISTER_TIMEOUT_S + 0.5)

    # --- the thread ---

    def _run(self) -> None:
        ctx = zmq.Context()
        routers: list[_Router] = []
        try:
            routers = [_Router(addr, self._socket(ctx, addr)) for addr in self.routers]
            poller = zmq.Poller()
            for router in routers:
                poller.register(router.sock, zmq.POLLIN)
            by_sock = {router.sock: router for router in routers}
            started = time.monotonic()
            next_due = started
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_due:
                    if self._http_ready(now - started) and self._api_alive():
                        for router in routers:
                            if now >= router.due:
                                self._heartbeat(router, now)
                        next_due = min(router.due for router in routers)
                    elif self._api_gone:
                        next_due = now + self.interval_s
                    else:
                        next_due = now + HTTP_RETRY_S
                timeout_s = min(max(next_due - time.monotonic(), 0.0), POLL_S)
                for sock, _ in poller.poll(int(timeout_s * 1000)):
                    self._read_answers(by_sock[sock])
            self._deregister(routers)
        except Exception:
            logger.exception(
                "router registration of %s stopped; routers will drop this instance "
                "when its heartbeats stop",
                self.instance_id,
            )
        finally:
            # What is still queued (the Deregister) gets DEREGISTER_TIMEOUT_S
            # to leave: ctx.term() waits that long at most.
            linger_ms = int(DEREGISTER_TIMEOUT_S * 1000)
            for router in routers:
                router.sock.close(linger=linger_ms)
            ctx.term()

    def _socket(self, ctx: zmq.Context, addr: str) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queue for a router that is not connected
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, SNDHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_FRAME_BYTES)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        # ZMTP heartbeats drop a connection whose router vanished without a
        # TCP reset (host down), so a restarted router is reconnected to.
        interval_ms = max(int(self.interval_s * 1000), 100)
        sock.setsockopt(zmq.HEARTBEAT_IVL, interval_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * interval_ms)
        if addr.startswith("["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(f"tcp://{addr}")
        return sock

    def _api_alive(self) -> bool:
        """False while connections to the API server are refused (nothing
        listens: it is gone); a slow answer is a busy server, alive."""
        if self._api_probe is None:
            return True
        now = time.monotonic()
        if now - self._api_checked_at < self.interval_s / 2:
            return not self._api_gone
        self._api_checked_at = now
        try:
            with socket.create_connection(self._api_probe, timeout=0.5):
                pass
        except ConnectionRefusedError:
            if not self._api_gone:
                logger.warning(
                    "this instance's API server %s refuses connections: no more "
                    "heartbeats until it listens again (routers drop the instance)",
                    self._template.http_addr,
                )
            self._api_gone = True
            return False
        except OSError:
            pass
        if self._api_gone:
            logger.info("API server %s listens again", self._template.http_addr)
        self._api_gone = False
        return True

    def _http_ready(self, waited_s: float) -> bool:
        if self._http_probe is None:
            return True
        try:
            with socket.create_connection(self._http_probe, timeout=0.2):
                pass
            self._api_probe = self._http_probe
        except OSError as e:
            if waited_s < HTTP_WAIT_S:
                return False
            logger.warning(
                "this instance's API server %s (http_ip, http_port) does not accept "
                "connections from here after %.0f s (%s); registering with the routers "
                "anyway",
                self._template.http_addr,
                waited_s,
                e,
            )
        self._http_probe = None
        return True

    def _heartbeat(self, router: _Router, now: float) -> None:
        stalled = self._progress.stalled_s() if self._progress is not None else 0.0
        msg = msgspec.structs.replace(
            self._template,
            seq=router.seq,
            sent_at=time.time(),
            stalled_s=round(min(stalled, 1e9), 1),
        )
        try:
            router.sock.send_multipart(seal(self.token, msg), flags=zmq.NOBLOCK)
        except zmq.Again:  # not connected (or stuck): nothing is queued, retry soon
            router.registered = False
            router.due = now + min(POLL_S, self.interval_s)
            if router.down_since is None:
                router.down_since = now
            elif now - router.down_since >= SILENT_HEARTBEATS * self.interval_s:
                self._warn(
                    router,
                    "router %s is not reachable; still trying every %g s",
                    router.addr,
                    self.interval_s,
                )
            return
        router.down_since = None
        router.seq += 1
        router.due = now + self.interval_s
        router.unanswered += 1
        if router.unanswered > SILENT_HEARTBEATS:
            self._warn(
                router,
                "router %s has not answered %d registrations; is it a router's "
                "discovery port, and does it use the same %s?",
                router.addr,
                router.unanswered - 1,
                envs.VLLM_DISAGG_ROUTER_TOKEN,
            )

    def _read_answers(self, router: _Router) -> None:
        while True:
            try:
                frames = router.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                # Answers only feed these logs, so their MAC is not checked: a
                # router with another token can still say why it refused us.
                msg = open_frame(None, frames)
            except DiscoveryError as e:
                self._warn(
                    router, "unreadable answer from router %s: %s", router.addr, e
                )
                continue
            # Only we send on this socket, so every Ack answers us; a router
            # that could not open our frame (token, clock) cannot name us.
            if not isinstance(msg, Ack):
                continue
            router.unanswered = 0
            if msg.accepted:
                if not router.registered:
                    logger.info(
                        "registered with router %s as %s (%s, http %s, kv %s, DP rank "
                        "%d/%d)",
                        router.addr,
                        self.instance_id,
                        self._template.role.value,
                        self._template.http_addr,
                        self._template.kv_addr,
                        self._template.dp_rank,
                        self._template.dp_size,
                    )
                router.registered = True
            else:
                router.registered = False
                reason = msg.reason or "no reason given"
                self._warn(
                    router,
                    "router %s refused the registration of %s: %s",
                    router.addr,
                    self.instance_id,
                    reason,
                )

    def _deregister(self, routers: list[_Router]) -> None:
        frames = seal(
            self.token,
            Deregister(
                version=MIN_DISCOVERY_VERSION,
                instance_id=self.instance_id,
                sent_at=time.time(),
            ),
        )
        for router in routers:
            if not router.seq:
                continue  # never registered there
            # zmq.Again: not connected; it drops us when the heartbeats stop.
            with contextlib.suppress(zmq.Again):
                router.sock.send_multipart(frames, flags=zmq.NOBLOCK)

    def _warn(self, router: _Router, fmt: str, *args) -> None:
        self._log.warning(router.addr, fmt, *args)  # one per router per interval


def registers_for_its_api_server(parallel_config) -> bool:
    """One registration per API server, since a router knows an instance by
    its HTTP address (a new registration at a known address replaces the old
    one). With one ``vllm serve`` per DP rank (external LB) that is every
    rank; where one API server fronts several ranks (internal LB, and hybrid
    LB per node; only the combinations config.check_dp_load_balancing allows,
    which work whatever rank the request lands on) it is the first rank it
    fronts. ``data_parallel_index``: vLLM resets ``data_parallel_rank`` to 0
    in the engine cores of a dense (non-MoE) model."""
    if parallel_config.data_parallel_external_lb:
        return True
    if parallel_config.data_parallel_hybrid_lb:
        return not parallel_config.data_parallel_rank_local
    return dp_rank_of(parallel_config) == 0


def start_registration(
    vllm_config: VllmConfig,
    config: P2pConfig,
    kv_addr: str,
    progress: EngineProgress | None = None,
    fingerprint: str = "",
) -> RegistrationClient | None:
    """Start registering this DP rank (its control address ``kv_addr``) with
    the routers named in ``proxy_ip``; None when none is, or when another
    rank registers for this API server."""
    if not config.routers or not registers_for_its_api_server(
        vllm_config.parallel_config
    ):
        return None
    names = vllm_config.model_config.served_model_name
    names = list(names) if isinstance(names, list | tuple) else [names] if names else []
    model = names[0] if names else None
    parallel = vllm_config.parallel_config
    for problem in advertised_http_problems(
        config.http_addr, envs.serve_host(), envs.serve_port()
    ):
        logger.warning(
            "%s: routers will send this instance's requests where its API server does "
            "not listen (unless a port mapping or NAT is in between); set "
            "kv_connector_extra_config.http_ip / http_port to the address clients of "
            "this server use",
            problem,
        )
    return RegistrationClient(
        routers=config.routers,
        role=Role.from_kv_role(config.role),
        http_addr=config.http_addr,
        kv_addr=kv_addr,
        model=model or vllm_config.model_config.model,
        aliases=names[1:],
        dp_rank=dp_rank_of(parallel),
        dp_size=parallel.data_parallel_size,
        # The connector's token: the environment's, or the local cookie's.
        token=config.grant_token or envs.router_token(),
        progress=progress,
        fingerprint=fingerprint,
        max_model_len=vllm_config.model_config.max_model_len or 0,
        listen_addr=api_listen_addr(
            config.http_addr, envs.serve_host(), envs.serve_port()
        ),
        dp_group=dp_group_of(parallel),
    ).start()
