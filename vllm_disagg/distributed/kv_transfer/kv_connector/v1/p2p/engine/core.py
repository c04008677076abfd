"""The P2P engine object: its two sides, the peer threads, the listener.

:class:`P2pEngine` is composed around the transfer core (recv_state.py and
send_state.py, driven by its :class:`~.receiver.Receiver` and
:class:`~.sender.Sender`): it owns the one lock they share, the sockets and
the peer threads, and is the :class:`~.ports.PeerOwner` those threads talk
to. The listener thread authenticates each control message, checks where
it came from, hands it to its side's handler and answers; every 0.2 s it
also sweeps what expired.
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
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.layout import (
    KVLayout,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.local import (
    Local,
    Rejects,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.peer import (
    Peer,
    zmq_endpoint,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.ports import (
    IdlePeer,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.receiver import (
    Receiver,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.sender import (
    Sender,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.transfers import (
    GetJob,
    SendTransfer,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
    Abort,
    Get,
    Hello,
    Offer,
    Refusal,
    Reply,
    Status,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import (
    P2pStatsRecorder,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    Transport,
    TransportError,
    addresses_of,
)
from vllm_disagg.logger import init_logger
from vllm_disagg.wire.frames import harden_listener
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


class P2pEngine:
    """One worker's end of the P2P KV transfer network (see the package docstring).

    The worker's API is its sides' methods: ``expect``, ``poll``,
    ``copy_into_cache``, ``abandon``, ``release`` and ``occupancy`` of its
    :class:`Receiver`; ``start_send``, ``hold`` and ``take_finished_sends``
    of its :class:`Sender`."""

    def __init__(
        self,
        *,
        layout: KVLayout,
        host: str,
        port: int,
        transport: Transport,
        bind_host: str | None = None,
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
        self.local = Local(
            addr=format_addr(host, port),
            layout=layout,
            transport=transport,
            send_type=send_type,
            hold_timeout_s=hold_timeout_s,
            model_fingerprint=model_fingerprint,
            checksum=make_checksum(checksum),
            checksum_name=checksum,
        )
        self.addr, self.layout, self.transport = self.local.addr, layout, transport
        self.secret = secret or None
        self.stats = stats or P2pStatsRecorder()
        transport.on_rejected = (
            self.stats.record_rejected
        )  # its data port counts here too
        self.stopped = threading.Event()
        # Set first by close(): sends end and their receivers are told, then
        # ``stopped`` ends the threads.
        self.closing = threading.Event()
        self.zmq_ctx = zmq.Context()

        self._lock = threading.Lock()  # both sides' and the peer table's
        self._peers: dict[str, Peer] = {}
        self._rejects = Rejects(self.addr, self.stats, logger)
        self.receiver = Receiver(
            self.local,
            lock=self._lock,
            stopped=self.stopped,
            stats=self.stats,
            rejects=self._rejects,
            submit=self._submit,
            kv_buffer_size=kv_buffer_size,
            mem_pool_size_bytes=mem_pool_size_bytes,
        )
        self.sender = Sender(
            self.local,
            lock=self._lock,
            stats=self.stats,
            rejects=self._rejects,
            submit=self._submit,
            closing=self.closing,
        )
        # The worker's API is the two sides' (see their docstrings).
        receiver, sender = self.receiver, self.sender
        self.expect, self.poll = receiver.expect, receiver.poll
        self.copy_into_cache, self.abandon = self.layout.copy_slot, receiver.abandon
        self.release, self.occupancy = receiver.room.release, receiver.room.occupancy
        self.start_send, self.hold = sender.start_send, sender.hold
        self.take_finished_sends = sender.take_finished

        self._router = self.zmq_ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        harden_listener(self._router, 2 * proto.MAX_FRAME_BYTES)
        # ``host`` is what peers are told (kv_ip); ``bind_host`` where the
        # control port listens (kv_bind_ip: a NAT or forwarder in between).
        bind_addr = format_addr(bind_host or host, port)
        if ":" in (bind_host or host):
            self._router.setsockopt(zmq.IPV6, 1)
        try:
            self._router.bind(zmq_endpoint(bind_addr))
        except zmq.ZMQError as e:
            self._router.close(linger=0)
            self.zmq_ctx.term()
            transport.close()  # a fixed data port it may already hold
            raise OSError(
                f"P2pNcclConnector cannot listen on {bind_addr} ({e}): the port is "
                "taken; every worker of every DP rank needs its own port (kv_port + "
                "dp_rank * tp_size * pp_size + pp_rank * tp_size + tp_rank), so give "
                "each instance on a host a kv_port range of its own"
            ) from e
        self._listener = threading.Thread(
            target=self._listen, name="p2p-listener", daemon=True
        )
        self._listener.start()

    @property
    def model_fingerprint(self) -> bytes:
        return self.local.model_fingerprint

    @model_fingerprint.setter
    def model_fingerprint(self, value: bytes) -> None:
        self.local.model_fingerprint = value

    def close(self) -> None:
        # Sends still under way (PUT offers before the forward pass, so one may
        # wait for layers that will never be saved) end now, and each peer
        # thread tells its receiver (an Abort, and a dropped data channel for
        # one mid-transfer) before the threads stop, at most CLOSE_FLUSH_S: a
        # decode must not wait out its kv_load_timeout_s for a prefill that
        # is going away.
        self.closing.set()
        until = time.monotonic() + limits.CLOSE_FLUSH_S
        while time.monotonic() < until and any(
            p.busy() for p in list(self._peers.values())
        ):
            time.sleep(0.01)
        self.stopped.set()
        self._listener.join(timeout=2)
        for peer in list(self._peers.values()):
            peer.thread.join(timeout=2)
        self.receiver.close()
        self.transport.close()
        self.zmq_ctx.term()

    # --- what the peer threads ask (ports.PeerOwner) ---

    def finish_send(self, xfer: SendTransfer, *, ok: bool, reason: str = "") -> None:
        self.sender.finish(xfer, ok=ok, reason=reason)

    def still_expected(self, key: str) -> bool:
        return self.receiver.still_expected(key)

    def retire_peer(self, peer: IdlePeer) -> bool:
        """An idle peer thread asks to exit: yes unless a job arrived meanwhile."""
        with self._lock:
            if not peer.jobs.empty():
                return False
            if self._peers.get(peer.addr) is peer:
                del self._peers[peer.addr]
            return True

    def reject(self, kind: str, detail: str) -> None:
        self._rejects.reject(kind, detail)

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
                    self.reject(e.kind, str(e))
                    continue
                except Exception:  # noqa: BLE001 - one bad message must not stop the listener
                    logger.exception("P2P listener failed to handle a message")
                    reply = Reply(
                        req_no=getattr(msg, "req_no", 0),
                        status=Status.REJECTED,
                        reason=Refusal.INTERNAL,
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
                return self._rejects.refuse(
                    msg.req_no, Refusal.MALFORMED, f"{type(msg).__name__}: {e}"
                )
            if foreign:
                return self._rejects.refuse(
                    msg.req_no,
                    Refusal.ADDRESS,
                    f"{type(msg).__name__} from {source} names {msg.sender_addr}",
                )
        if isinstance(msg, Hello):
            return self.receiver.on_hello(msg, route)
        if isinstance(msg, Offer):
            return self.receiver.on_offer(msg, route)
        if isinstance(msg, Get):
            return self.sender.on_get(msg)
        if isinstance(msg, Abort):
            return self.receiver.on_abort(msg, source)
        self.reject("unexpected", f"{type(msg).__name__} on the listener")
        return None

    def _sweep(self, now: float) -> None:
        """Expire holds nobody pulled, receive-side keys past their deadline
        (unclaimed slots freed), and old released keys."""
        self.sender.sweep(now)
        self.receiver.sweep(now)
