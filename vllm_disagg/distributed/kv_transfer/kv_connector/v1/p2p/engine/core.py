"""The P2P engine object: its state, the listener thread and the sweep.

:class:`P2pEngine` owns the locks, tables and sockets; its receive side
(receiver.py) and send side (sender.py) are mixed in. The listener thread
authenticates each control message, checks where it came from, hands it to
its side's handler and answers; every 0.2 s it also sweeps what expired.
"""

from __future__ import annotations

import threading
import time

import zmq

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import protocol as proto
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.checksum import (
    NONE,
    ChecksumUnavailable,
    make_checksum,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import limits
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.inbound import (
    InboundChannel,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.layout import (
    KVLayout,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.peer import (
    Peer,
    zmq_endpoint,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.receiver import (
    ReceiverMixin,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.sender import (
    GetJob,
    Hold,
    HoldState,
    SenderMixin,
    SendTransfer,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
    Abort,
    Get,
    Hello,
    Offer,
    Reply,
    Status,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.recv_state import (
    RecvTable,
    Timeouts,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import (
    P2pStatsRecorder,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.tensor_pool import (
    TensorMemoryPool,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    Transport,
    TransportError,
    addresses_of,
)
from vllm_disagg.logger import init_logger
from vllm_disagg.wire.frames import harden_listener
from vllm_disagg.wire.logs import RateLimitedLog
from vllm_disagg.wire.peers import (
    PeerInfoError,
    canonical_addr,
    canonical_host,
    format_addr,
    source_host,
    split_addr,
)

# One logger for the engine package, named as the module it was split from.
logger = init_logger(__package__)


def _source_ip(frame: zmq.Frame) -> str | None:
    """The IP address a message came from (libzmq's Peer-Address), canonical."""
    try:
        return source_host(frame.get("Peer-Address"))
    except (zmq.ZMQError, KeyError, AttributeError):
        return None


class P2pEngine(ReceiverMixin, SenderMixin):
    """One worker's end of the P2P KV transfer network (see the package docstring)."""

    def __init__(
        self,
        *,
        layout: KVLayout,
        host: str,
        port: int,
        transport: Transport,
        send_type: str,
        kv_buffer_size: int,
        mem_pool_size_bytes: int,
        hold_timeout_s: float,
        secret: bytes | None = None,
        stats: P2pStatsRecorder | None = None,
        model_fingerprint: bytes = b"",
        checksum: str = NONE,
    ):
        if checksum != NONE and (
            layout.device.type != "cpu" or not transport.receives_into_host
        ):
            raise ChecksumUnavailable(
                f"kv_checksum {checksum} hashes KV in host memory (the tcp and gloo "
                f"transports); this worker's KV cache is on {layout.device} and its "
                f"transport is {transport.name}: set kv_checksum to none"
            )
        self.checksum = make_checksum(checksum)
        self.checksum_name = checksum
        self.layout = layout
        self.addr = format_addr(host, port)
        self.transport = transport
        self.send_type = send_type
        self.kv_buffer_size = kv_buffer_size
        self.mem_pool_size_bytes = mem_pool_size_bytes
        self.hold_timeout_s = hold_timeout_s
        self.secret = secret or None
        self.model_fingerprint = model_fingerprint
        self.stats = stats or P2pStatsRecorder()
        transport.on_rejected = (
            self.stats.record_rejected
        )  # its data port counts here too
        self.stopped = threading.Event()
        self.zmq_ctx = zmq.Context()

        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        self._inbound: dict[str, InboundChannel] = {}
        self._recv_threads = 0  # receive threads alive (at most MAX_INBOUND_CHANNELS)
        self._seen_channels: dict[
            str, float
        ] = {}  # channel id -> forget after (replays)
        self._early_aborts: dict[str, tuple[str, str, float]] = {}
        # Receive side: one explicit state per key (recv_state.py).
        self._recv = RecvTable(
            Timeouts(hold_s=hold_timeout_s, closed_s=limits.TOMBSTONE_TTL_S)
        )
        # GET, send side: one HoldState per key (HELD -> SENDING -> RELEASED).
        self._holds: dict[str, Hold] = {}
        self._finished_sends: list[SendTransfer] = []
        self._buffer_used = 0
        self._pool: TensorMemoryPool | None = None
        self._limited_log = RateLimitedLog(logger, limits.LOG_INTERVAL_S)

        self._router = self.zmq_ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        harden_listener(self._router, 2 * proto.MAX_FRAME_BYTES)
        if ":" in host:
            self._router.setsockopt(zmq.IPV6, 1)
        try:
            self._router.bind(zmq_endpoint(self.addr))
        except zmq.ZMQError as e:
            self._router.close(linger=0)
            self.zmq_ctx.term()
            raise OSError(
                f"P2pNcclConnector cannot listen on {self.addr} ({e}): the port is "
                "taken; every worker of every DP rank needs its own port (kv_port + "
                "dp_rank * tp_size * pp_size + pp_rank * tp_size + tp_rank), so give "
                "each instance on a host a kv_port range of its own"
            ) from e
        self._listener = threading.Thread(
            target=self._listen, name="p2p-listener", daemon=True
        )
        self._listener.start()

    def close(self) -> None:
        self.stopped.set()
        self._listener.join(timeout=2)
        for peer in list(self._peers.values()):
            peer.thread.join(timeout=2)
        for inbound in list(self._inbound.values()):
            if inbound.channel is not None:
                inbound.channel.close()
        self.transport.close()
        self.zmq_ctx.term()

    # --- internals ---

    def _submit(self, addr: str, job: SendTransfer | GetJob) -> None:
        """Queue ``job`` on the thread of peer ``addr`` (started if there is none).
        Under the lock, so a peer thread retiring at this moment cannot drop it.
        One thread (and channel) per peer whatever the spelling of its address."""
        addr = format_addr(*canonical_addr(addr))
        with self._lock:
            peer = self._peers.get(addr)
            if peer is None:
                peer = self._peers[addr] = Peer(self, addr)
            peer.jobs.put(job)

    def _retire_peer(self, peer: Peer) -> bool:
        """An idle peer thread asks to exit: yes unless a job arrived meanwhile."""
        with self._lock:
            if not peer.jobs.empty():
                return False
            if self._peers.get(peer.addr) is peer:
                del self._peers[peer.addr]
            return True

    def _reject(self, kind: str, detail: str) -> None:
        self.stats.record_rejected(kind)
        self._log_limited(
            kind, f"P2P engine {self.addr} rejected a message ({kind}): {detail}"
        )

    def _log_limited(self, kind: str, line: str) -> None:
        self._limited_log.warning(kind, "%s", line)

    # the listener thread

    def _listen(self) -> None:
        router = self._router
        last_sweep = time.monotonic()
        while not self.stopped.is_set():
            if router.poll(int(limits.POLL_INTERVAL_S * 1000)):
                try:
                    frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue
                if len(frames) < 2:
                    continue
                source = _source_ip(frames[1])
                route, body = frames[0].bytes, [f.bytes for f in frames[1:]]
                msg = None
                try:
                    msg = proto.open_frame(self.secret, body)
                    reply = self._handle(msg, route, source)
                except proto.FrameError as e:
                    self._reject(e.kind, str(e))
                    continue
                except Exception:  # noqa: BLE001 - one bad message must not stop the listener
                    logger.exception("P2P listener failed to handle a message")
                    reply = Reply(
                        req_no=getattr(msg, "req_no", 0),
                        status=Status.REJECTED,
                        reason="internal",
                    )
                if reply is not None:
                    router.send_multipart([route, *proto.seal(self.secret, reply)])
            now = time.monotonic()
            if now - last_sweep > 0.2:
                last_sweep = now
                self._sweep(now)
        router.close(linger=0)

    def _handle(
        self, msg, route: bytes = b"", source: str | None = None
    ) -> Reply | None:
        if isinstance(msg, (Hello, Get)) and source is not None:
            # The address a Hello or Get names for replies and data must be
            # the machine it came from: a peer cannot send this side's data
            # connections or pulled KV to a third one.
            try:
                named = canonical_host(split_addr(msg.sender_addr, "sender_addr")[0])
                foreign = source not in addresses_of(named)
            except (PeerInfoError, TransportError) as e:
                return self._refuse(
                    msg.req_no, "malformed", f"{type(msg).__name__}: {e}"
                )
            if foreign:
                return self._refuse(
                    msg.req_no,
                    "address",
                    f"{type(msg).__name__} from {source} names {msg.sender_addr}",
                )
        if isinstance(msg, Hello):
            return self._on_hello(msg, route)
        if isinstance(msg, Offer):
            return self._on_offer(msg, route)
        if isinstance(msg, Get):
            return self._on_get(msg)
        if isinstance(msg, Abort):
            return self._on_abort(msg, source)
        self._reject("unexpected", f"{type(msg).__name__} on the listener")
        return None

    def _refuse(self, req_no: int, kind: str, reason: str) -> Reply:
        """Refuse with the kind only: the details (the local layout, say) go
        to this side's log, never to a peer that may be a stranger."""
        self._reject(kind, reason)
        return Reply(req_no=req_no, status=Status.REJECTED, reason=kind)

    def _sweep(self, now: float) -> None:
        """Expire holds nobody pulled, receive-side keys past their deadline
        (unclaimed slots freed), and old released keys."""
        expired_holds = []
        with self._lock:
            for cid, until in list(self._seen_channels.items()):
                if now > until:
                    del self._seen_channels[cid]
            for key, (_, _, until) in list(self._early_aborts.items()):
                if now > until:
                    del self._early_aborts[key]
            for key, hold in list(self._holds.items()):
                if now <= hold.until:
                    continue
                if hold.state is HoldState.HELD:  # nobody pulled it
                    hold.state, hold.until = (
                        HoldState.RELEASED,
                        now + limits.TOMBSTONE_TTL_S,
                    )
                    expired_holds.append(hold.xfer)
                elif hold.state is HoldState.RELEASED:
                    del self._holds[key]
                else:  # SENDING past its send's deadline: end it if its send did not
                    hold.state, hold.until = (
                        HoldState.RELEASED,
                        now + limits.TOMBSTONE_TTL_S,
                    )
                    expired_holds.append(hold.xfer)
            expired = self._recv.expire(now)
            orphans = []
            for entry in expired:
                if entry.slot is not None:
                    orphans.append((entry.expected, entry.slot))
                    entry.slot = None
        for xfer in expired_holds:
            self._finish_send(
                xfer, ok=False, reason="not pulled and sent before kv_hold_timeout_s"
            )
        for expected, slot in orphans:
            if not expected:
                logger.warning(
                    "P2P: freeing KV of %s that no request claimed", slot.key
                )
            self.release(slot)
