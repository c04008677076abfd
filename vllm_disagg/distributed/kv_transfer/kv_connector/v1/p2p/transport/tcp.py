"""TCP transport: one connection per channel, tensors moved in place.

``send`` hands the tensors' own memory to ``sendmsg`` (scatter-gather, no
staging copy) and ``recv`` reads straight into the destination with
``recvmsg_into``; a message on the wire is an 8-byte length header and the
bytes. The kernel's loopback/NIC copy is the only one, which is what lets
this transport reach the plain-socket ceiling (``benchmarks/p2p_transport.py``).

Set-up: the initiator's setup bytes are a random token; the acceptor answers
with the address of its data port (one listening socket per transport,
opened on the first ``accept``); the initiator connects and presents the
token, and the acceptor hands the connection to the channel that expects
it. Connections presenting anything else are closed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.host_memory import (
    storage_view,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    AcceptFinish,
    Channel,
    Endpoint,
    InitiateFinish,
    Transport,
    TransportError,
    check_host,
    check_peer_endpoint,
    remaining,
)
from vllm_disagg.logger import init_logger
from vllm_disagg.wire.peers import format_addr

logger = init_logger(__name__)

TOKEN_BYTES = 16
_HEADER = struct.Struct("!Q")
_TIMEVAL = struct.Struct("@ll")
_ACK = b"\x06"
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
# A connection must present its token this soon after connecting, and at most
# this many may be presenting at once (the oldest is dropped beyond it).
_GREETING_TIMEOUT_S = 10.0
_MAX_GREETINGS = 256
_POLL_S = 0.2


def _memoryviews(tensors: Sequence[torch.Tensor | memoryview]) -> list[memoryview]:
    """Writable byte memoryviews of the tensors' memory, no copy.

    The caller keeps the tensors alive while the views are in use. One view
    per underlying storage, sliced per tensor, and tensors adjacent in
    memory merged into one slice: a message can carry thousands of KV block
    views of one storage, and a torch/numpy view per block would cost more
    CPU than the loopback copy of a 32 KiB block."""
    bases: dict[int, memoryview] = {}
    ranges: list[list] = []  # [base, begin, end]
    for t in tensors:
        if isinstance(t, memoryview):  # host bytes already (send only)
            if t.nbytes:
                ranges.append([t, 0, t.nbytes])
            continue
        if not t.is_cpu:
            raise TransportError(
                f"tensor on {t.device}: the tcp transport moves CPU tensors"
            )
        if not t.is_contiguous():
            raise TransportError("tensors must be contiguous")
        size = t.nbytes
        if not size:
            continue
        base, offset = storage_view(t, bases)
        if ranges and ranges[-1][0] is base and ranges[-1][2] == offset:
            ranges[-1][2] = offset + size
        else:
            ranges.append([base, offset, offset + size])
    return [base[begin:end] for base, begin, end in ranges]


def _advance(bufs: list[memoryview], i: int, n: int) -> int:
    """Consume ``n`` bytes from ``bufs[i:]``; return the first unfinished index."""
    while n:
        size = bufs[i].nbytes
        if n < size:
            bufs[i] = bufs[i][n:]
            return i
        n -= size
        i += 1
    return i


class TcpChannel(Channel):
    """Both directions over one blocking connection.

    Receiving: a blocking ``recvmsg_into`` with MSG_WAITALL, one system call
    per message, bounded by the kernel's receive timeout (SO_RCVTIMEO) set
    from the deadline before every call. Sending: ``sendmsg`` with
    MSG_DONTWAIT, and ``poll`` for room (bounded by the deadline) when the
    socket's buffer is full. A blocking ``sendmsg`` of megabytes stays in
    the kernel for the whole copy; calls that return when the buffer is full
    moved 64 MiB over loopback in 21 ms where one blocking ``sendall`` took
    27, and the channel's own messages about 5 % faster at 16-64 MiB
    (docs/p2p_connector.md, "Where the rest goes, phase by phase").
    The sending and the receiving thread never share a direction.

    Socket buffers are left to Linux's autotuning: setting SO_SNDBUF or
    SO_RCVBUF turns it off and caps the buffer at net.core.[rw]mem_max
    (208 KiB on many hosts, below what autotuning reaches), and a fixed
    4 MiB buffer cost the receiver more CPU per byte on loopback (cache
    misses) in benchmarks/p2p_transport.py's setting.
    """

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(True)
        self._sock = sock
        self._writable = select.poll()
        self._writable.register(sock.fileno(), select.POLLOUT)
        self._send_header = bytearray(_HEADER.size)
        self._recv_header = bytearray(_HEADER.size)
        self._error: str | None = None

    def send(
        self, tensors: Sequence[torch.Tensor | memoryview], deadline: float
    ) -> None:
        self._check()
        views = _memoryviews(tensors)
        _HEADER.pack_into(self._send_header, 0, sum(v.nbytes for v in views))
        bufs = [memoryview(self._send_header), *views]
        i = 0
        try:
            while i < len(bufs):
                try:
                    n = self._sock.sendmsg(
                        bufs[i : i + _IOV_MAX], (), socket.MSG_DONTWAIT
                    )
                except BlockingIOError:  # the buffer is full: wait for room
                    left = remaining(deadline, "send")
                    self._writable.poll(max(1, int(left * 1000)))
                    continue
                i = _advance(bufs, i, n)
        except (OSError, TransportError) as e:
            raise self._fail(f"send failed: {e}") from e

    def recv(self, tensors: Sequence[torch.Tensor], deadline: float) -> None:
        self._check()
        views = _memoryviews(tensors)
        expected = sum(v.nbytes for v in views)
        try:
            self._recv_into([memoryview(self._recv_header)], deadline)
            (total,) = _HEADER.unpack(self._recv_header)
            if total != expected:
                raise TransportError(
                    f"peer sent {total} bytes, receiver expects {expected}"
                )
            self._recv_into(views, deadline)
        except (OSError, TransportError) as e:
            raise self._fail(f"recv failed: {e}") from e

    def _recv_into(self, bufs: list[memoryview], deadline: float) -> None:
        i = 0
        while i < len(bufs):
            self._arm(socket.SO_RCVTIMEO, deadline, "recv")
            try:
                n = self._sock.recvmsg_into(
                    bufs[i : i + _IOV_MAX], 0, socket.MSG_WAITALL
                )[0]
            except BlockingIOError:  # timed out; the deadline is checked above
                continue
            if n == 0:
                raise TransportError("connection closed by peer")
            i = _advance(bufs, i, n)

    def _arm(self, option: int, deadline: float, what: str) -> None:
        """Bound the next blocking call by the time left (0 would mean forever)."""
        left = remaining(deadline, what)
        seconds = int(left)
        micros = max(int((left - seconds) * 1e6), 0 if seconds else 1)
        self._sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(seconds, micros))

    def close(self) -> None:
        if self._error is None:
            self._error = "channel closed"
        self._shutdown()

    def peer_closed(self) -> bool:
        # Only an idle receiver asks, so nothing else reads the socket now;
        # a peek neither consumes bytes nor blocks.
        if self._error is not None:
            return True
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def _check(self) -> None:
        if self._error is not None:
            raise TransportError(self._error)

    def _fail(self, reason: str) -> TransportError:
        """Break the channel for good; the peer sees the connection drop."""
        if self._error is None:
            self._error = reason
        self._shutdown()
        return TransportError(self._error)

    def _shutdown(self) -> None:
        # shutdown() wakes the calls blocked on this connection, here and on
        # the peer; close() alone would not.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class _Expected:
    """A channel the acceptor waits for; filled by the listener thread."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.sock: socket.socket | None = None


class _Listener:
    """The data port. A thread accepts connections, reads each one's token
    without blocking on any of them, and hands it to the channel that
    expects that token; everything else is closed."""

    def __init__(
        self,
        host: str,
        on_rejected: Callable[[str], None] = lambda kind: None,
        *,
        port: int = 0,
        advertise_host: str | None = None,
    ):
        self._on_rejected = on_rejected
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[
            0
        ]
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind(addr)
            self._sock.listen(128)
            self._sock.setblocking(False)
            bound_host, bound_port = self._sock.getsockname()[:2]
            # Peers are told the advertised host (kv_ip) with the bound port: a
            # NAT forwards kv_data_port there unchanged.
            self.endpoint = Endpoint(advertise_host or bound_host, bound_port)
        except OSError:
            self._sock.close()
            raise
        logger.info(
            "P2P tcp data port listening on %s",
            format_addr(*self._sock.getsockname()[:2]),
        )
        self._expected: dict[bytes, _Expected] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="p2p-tcp-listener", daemon=True
        )
        self._thread.start()

    def expect(self, token: bytes) -> _Expected:
        with self._lock:
            if self._stopped.is_set():
                raise TransportError("transport closed")
            if token in self._expected:
                raise TransportError("setup token already in use")
            entry = self._expected[token] = _Expected()
        return entry

    def take(self, token: bytes, entry: _Expected, deadline: float) -> socket.socket:
        entry.arrived.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._expected.pop(token, None)
            sock, entry.sock = entry.sock, None
        if sock is None:
            reason = "transport closed" if self._stopped.is_set() else "deadline passed"
            raise TransportError(f"peer did not connect to the data port: {reason}")
        return sock

    def close(self) -> None:
        with self._lock:
            self._stopped.set()
            for entry in self._expected.values():
                entry.arrived.set()  # take() raises "transport closed"
        self._thread.join(timeout=2 * _POLL_S + 1.0)

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._sock, selectors.EVENT_READ)
        # connection -> (token bytes so far, greeting deadline), oldest first
        greeting: dict[socket.socket, tuple[bytearray, float]] = {}

        def drop(conn: socket.socket) -> None:
            selector.unregister(conn)
            del greeting[conn]
            conn.close()
            self._on_rejected("data_no_token")

        try:
            while not self._stopped.is_set():
                for key, _ in selector.select(_POLL_S):
                    if key.fileobj is self._sock:
                        self._accept_all(selector, greeting, drop)
                    elif key.fileobj in greeting:  # not dropped earlier in this round
                        self._read_token(key.fileobj, greeting, selector, drop)
                now = time.monotonic()
                for conn in [c for c, (_, until) in greeting.items() if until < now]:
                    drop(conn)
        finally:
            for conn in list(greeting):
                drop(conn)
            selector.close()
            self._sock.close()

    def _accept_all(self, selector, greeting, drop) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. EMFILE; retried on the next readiness
                return
            conn.setblocking(False)
            if len(greeting) >= _MAX_GREETINGS:
                drop(next(iter(greeting)))
            greeting[conn] = (bytearray(), time.monotonic() + _GREETING_TIMEOUT_S)
            selector.register(conn, selectors.EVENT_READ)

    def _read_token(self, conn, greeting, selector, drop) -> None:
        buf = greeting[conn][0]
        try:
            data = conn.recv(TOKEN_BYTES - len(buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            drop(conn)
            return
        buf += data
        if len(buf) < TOKEN_BYTES:
            return
        selector.unregister(conn)
        del greeting[conn]
        with self._lock:
            entry = self._expected.get(bytes(buf))
            if entry is not None and entry.sock is None and not entry.arrived.is_set():
                entry.sock = conn
                entry.arrived.set()
                return
        conn.close()
        self._on_rejected("data_unknown_token")


class TcpTransport(Transport):
    """Channels over plain TCP; the CPU default."""

    name = "tcp"
    sends_host_bytes = True

    def __init__(
        self,
        device: torch.device,
        bind_host: str,
        *,
        advertise_host: str | None = None,
        data_port: int = 0,
    ):
        # The bind host may be a wildcard when peers are told another one.
        super().__init__(device, bind_host if advertise_host else check_host(bind_host))
        self.advertise_host = check_host(advertise_host) if advertise_host else None
        self.data_port = data_port
        self._listener: _Listener | None = None
        self._lock = threading.Lock()
        self._closed = False
        if data_port:
            # A fixed port (kv_data_port) that is taken fails at start, not
            # at the first transfer.
            self._get_listener()

    def initiate(self, peer_host: str | None = None) -> tuple[bytes, InitiateFinish]:
        token = secrets.token_bytes(TOKEN_BYTES)
        return token, lambda reply, deadline: self._connect(
            token, reply, deadline, peer_host
        )

    def accept(
        self, setup: bytes, peer_host: str | None = None
    ) -> tuple[bytes, AcceptFinish]:
        if len(setup) != TOKEN_BYTES:
            raise TransportError(
                f"tcp setup must be {TOKEN_BYTES} bytes, got {len(setup)}"
            )
        listener = self._get_listener()
        token = bytes(setup)
        entry = listener.expect(token)

        def finish(deadline: float) -> Channel:
            sock = listener.take(token, entry, deadline)
            try:
                sock.settimeout(remaining(deadline, "tcp channel set-up"))
                sock.sendall(_ACK)
            except (OSError, TransportError) as e:
                sock.close()
                raise TransportError(f"tcp channel set-up failed: {e}") from e
            return TcpChannel(sock)

        return listener.endpoint.encode(), finish

    def close(self) -> None:
        with self._lock:
            self._closed = True
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    def _get_listener(self) -> _Listener:
        with self._lock:
            if self._closed:
                raise TransportError("transport closed")
            if self._listener is None:
                try:
                    self._listener = _Listener(
                        self.bind_host,
                        self.on_rejected,
                        port=self.data_port,
                        advertise_host=self.advertise_host,
                    )
                except OSError as e:
                    where = format_addr(self.bind_host, self.data_port)
                    raise TransportError(f"cannot listen on {where}: {e}") from e
            return self._listener

    @staticmethod
    def _connect(
        token: bytes, reply: bytes, deadline: float, peer_host: str | None
    ) -> Channel:
        endpoint = Endpoint.decode(reply)
        check_peer_endpoint(endpoint, peer_host)
        try:
            # AI_NUMERICHOST: the acceptor advertises the address it bound,
            # so no name lookup (which has no timeout) happens here.
            family, _, _, _, addr = socket.getaddrinfo(
                endpoint.host,
                endpoint.port,
                type=socket.SOCK_STREAM,
                flags=socket.AI_NUMERICHOST,
            )[0]
        except OSError as e:
            raise TransportError(f"bad data port address {endpoint.host!r}: {e}") from e
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(remaining(deadline, "tcp connect"))
            sock.connect(addr)
            sock.settimeout(remaining(deadline, "tcp connect"))
            sock.sendall(token)
            sock.settimeout(remaining(deadline, "tcp connect"))
            if sock.recv(1) != _ACK:
                raise TransportError("the acceptor closed the connection")
        except (OSError, TransportError) as e:
            sock.close()
            where = f"{endpoint.host}:{endpoint.port}"
            raise TransportError(f"tcp connect to {where} failed: {e}") from e
        return TcpChannel(sock)
