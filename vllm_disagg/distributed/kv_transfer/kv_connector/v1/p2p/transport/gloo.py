"""Gloo transport: a private 2-rank gloo group per channel.

Built with vLLM's ``stateless_init_torch_distributed_process_group`` (no
global process group involved). The initiator is rank 0 and hosts the
group's store on a socket it binds in ``initiate`` (its address is the setup
bytes, so there is no port race); the acceptor joins as rank 1.

Gloo matches a send with a receive of the same size, while the two sides
may cut a message differently, so a message is a size header then one flat
uint8 tensor: the sender gathers several parts into a buffer, the receiver
receives into a buffer and scatters (a single contiguous part on either side
is used directly). The buffers are kept per channel, grown to the largest
message: reallocating them would page-fault every message in again.

Gloo cannot interrupt a wait from another thread (neither ``abort`` nor
``shutdown`` wakes it), but a wait that times out closes the connection,
which fails every pending operation on both ends. ``close`` relies on that.

Gloo picks the interface of its own connections from the host name (or
``GLOO_SOCKET_IFNAME``); only the store listens on ``bind_host``. Gloo
aborts the process when a message is larger than the buffer posted for it,
so a peer that sends more data than its own header announced (which this
code never does) can crash the receiver: tcp has no such failure mode.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence
from datetime import timedelta

import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    AcceptFinish,
    Channel,
    Endpoint,
    InitiateFinish,
    Transport,
    TransportError,
    byte_views,
    call_before,
    check_host,
    check_peer_endpoint,
    remaining,
)

_HEADER_TAG = 0
_DATA_TAG = 1
_POISON_TAG = 2
_CPU = torch.device("cpu")


def _init_group(
    endpoint: Endpoint, rank: int, deadline: float, listen: socket.socket | None
):
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    timeout = timedelta(seconds=remaining(deadline, "gloo group set-up"))
    return call_before(
        deadline,
        "gloo group set-up",
        lambda: stateless_init_torch_distributed_process_group(
            endpoint.host,
            endpoint.port,
            rank,
            2,
            "gloo",
            listen_socket=listen,
            timeout=timeout,
        ),
        lambda pg: pg.shutdown(),
    )


class GlooChannel(Channel):
    def __init__(self, pg, peer: int):
        self._pg = pg
        self._peer = peer
        self._send_header = torch.zeros(1, dtype=torch.int64)
        self._recv_header = torch.zeros(1, dtype=torch.int64)
        self._send_buf = torch.empty(0, dtype=torch.uint8)
        self._recv_buf = torch.empty(0, dtype=torch.uint8)
        self._error: str | None = None
        self._closed = False

    def send(self, tensors: Sequence[torch.Tensor], deadline: float) -> None:
        self._check()
        parts = byte_views(tensors, _CPU)
        total = sum(p.numel() for p in parts)
        with self._failing("send"):
            self._send_header[0] = total
            works = [self._pg.send([self._send_header], self._peer, _HEADER_TAG)]
            if len(parts) == 1:
                works.append(self._pg.send(parts, self._peer, _DATA_TAG))
            elif parts:
                if self._send_buf.numel() < total:
                    self._send_buf = torch.empty(total, dtype=torch.uint8)
                flat = torch.cat(parts, out=self._send_buf[:total])
                works.append(self._pg.send([flat], self._peer, _DATA_TAG))
            for work in works:
                self._wait(work, deadline)

    def recv(self, tensors: Sequence[torch.Tensor], deadline: float) -> None:
        self._check()
        parts = byte_views(tensors, _CPU)
        expected = sum(p.numel() for p in parts)
        with self._failing("recv"):
            self._wait(
                self._pg.recv([self._recv_header], self._peer, _HEADER_TAG), deadline
            )
            total = int(self._recv_header[0])
            if total != expected:
                raise TransportError(
                    f"peer sent {total} bytes, receiver expects {expected}"
                )
            # Only now is the data receive posted: gloo aborts the whole
            # process when a message is larger than the buffer posted for it.
            if len(parts) == 1:
                self._wait(self._pg.recv(parts, self._peer, _DATA_TAG), deadline)
            elif parts:
                if self._recv_buf.numel() < total:
                    self._recv_buf = torch.empty(total, dtype=torch.uint8)
                flat = self._recv_buf[:total]
                self._wait(self._pg.recv([flat], self._peer, _DATA_TAG), deadline)
                offset = 0
                for p in parts:
                    p.copy_(flat[offset : offset + p.numel()])
                    offset += p.numel()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._error is None:
            self._error = "channel closed"
            self._break_connection()
        self._pg.shutdown()

    @staticmethod
    def _wait(work, deadline: float) -> None:
        work.wait(timedelta(seconds=remaining(deadline, "gloo")))

    @contextlib.contextmanager
    def _failing(self, what: str):
        """Any error inside (gloo raises RuntimeError subclasses, on posting
        as well as waiting) breaks the channel."""
        try:
            yield
        except Exception as e:
            raise self._fail(f"{what} failed: {e}") from e

    def _check(self) -> None:
        if self._error is not None:
            raise TransportError(self._error)

    def _fail(self, reason: str) -> TransportError:
        if self._error is None:
            self._error = reason
            self._break_connection()
        return TransportError(self._error)

    def _break_connection(self) -> None:
        """Close the gloo connection: wakes waits here and on the peer."""
        # An exception is the expected outcome: "timed out", the pair is closed.
        with contextlib.suppress(Exception):
            self._pg.recv([torch.empty(1)], self._peer, _POISON_TAG).wait(
                timedelta(milliseconds=1)
            )


class GlooTransport(Transport):
    """Channels over private gloo groups (CPU; measured against tcp)."""

    name = "gloo"

    def __init__(self, device: torch.device, bind_host: str):
        super().__init__(device, check_host(bind_host))

    def initiate(self, peer_host: str | None = None) -> tuple[bytes, InitiateFinish]:
        family, _, _, _, addr = socket.getaddrinfo(
            self.bind_host, 0, type=socket.SOCK_STREAM
        )[0]
        listen = socket.socket(family, socket.SOCK_STREAM)
        try:
            listen.bind(addr)
            listen.listen(8)
            endpoint = Endpoint(*listen.getsockname()[:2])
        except OSError as e:
            listen.close()
            raise TransportError(f"cannot listen on {self.bind_host}: {e}") from e

        def finish(reply: bytes, deadline: float) -> Channel:
            if reply:
                listen.close()
                raise TransportError(f"unexpected gloo reply of {len(reply)} bytes")
            # The store takes the socket over (even when set-up fails later).
            return GlooChannel(_init_group(endpoint, 0, deadline, listen), peer=1)

        return endpoint.encode(), finish

    def accept(
        self, setup: bytes, peer_host: str | None = None
    ) -> tuple[bytes, AcceptFinish]:
        endpoint = Endpoint.decode(setup)
        check_peer_endpoint(endpoint, peer_host)
        return b"", lambda deadline: GlooChannel(
            _init_group(endpoint, 1, deadline, None), peer=0
        )
