"""The data-plane interface of the P2P engine: one API, several transports.

The P2P engine moves KV bytes between two workers of two vLLM instances. It
negotiates *what* to move on its ZMQ control plane and hands the bytes to a
:class:`Transport`, which only knows how to carry an ordered stream of byte
payloads between exactly two endpoints (a :class:`Channel`):

* ``nccl``: a 2-rank NCCL communicator per peer, through vLLM's own wrapper
  (``PyNcclCommunicator``); CUDA only.
* ``tcp``: one TCP connection per peer, tensors sent and received in place
  (``sendmsg`` of the tensors' memory, ``recv_into`` the destination), the CPU
  default (measured against gloo in ``benchmarks/p2p_transport.py``).
* ``gloo``: a private 2-rank gloo group per peer (measured, selectable).
* ``fake``: in-process, for unit tests.

Channel set-up is a two-message exchange that the engine carries on its
control plane, so a transport never opens a control connection of its own:

1. the initiator calls :meth:`Transport.initiate` and sends the returned
   ``setup`` bytes to the acceptor;
2. the acceptor calls :meth:`Transport.accept` with them and sends the
   returned ``reply`` bytes back; it then calls ``finish(deadline)`` (in a
   thread of its own: for NCCL both sides block until the other joins);
3. the initiator calls ``finish(reply, deadline)``.

Rules every transport keeps (the engine relies on them):

* A channel carries two independent ordered directions. In each direction
  the n-th :meth:`Channel.send` is matched by the n-th :meth:`Channel.recv`
  on the other side, with the same total byte count. The two sides may cut
  the same bytes into different tensor lists (a sender sends block views, a
  receiver receives into one staging tensor).
* Every blocking call takes an absolute ``deadline`` (``time.monotonic()``)
  and raises :class:`TransportError` when it passes, when the peer is gone or
  when the byte counts disagree. After any error the channel is broken for
  good; the engine closes it and fails every transfer queued on it.
* Only one thread sends and one thread receives on a channel at a time.
* ``send`` returns once the source tensors may be reused (their bytes are
  on the wire or copied); ``recv`` returns once the destination holds the
  bytes (on CUDA: the transport synchronised its own stream).
"""

from __future__ import annotations

import abc
import concurrent.futures
import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Annotated, TypeVar

import msgspec
import torch

from vllm_disagg.wire.peers import canonical_host


class TransportError(RuntimeError):
    """A channel failed: timeout, peer gone, protocol mismatch. The channel is
    unusable."""


class Channel(abc.ABC):
    """An established pairwise link to one peer."""

    @abc.abstractmethod
    def send(self, tensors: Sequence[torch.Tensor], deadline: float) -> None:
        """Send the bytes of ``tensors`` (in order) as one message."""

    @abc.abstractmethod
    def recv(self, tensors: Sequence[torch.Tensor], deadline: float) -> None:
        """Receive one message into ``tensors`` (in order); sizes must add up."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the link; idempotent. Blocked calls on it raise TransportError."""

    def peer_closed(self) -> bool:
        """Without blocking: True when the peer is known to have gone (its end
        closed). Called by an idle receiver; False when it cannot tell."""
        return False


AcceptFinish = Callable[[float], Channel]
InitiateFinish = Callable[[bytes, float], Channel]


class Transport(abc.ABC):
    """Creates channels. One per P2P engine (one per worker)."""

    #: name used in configuration, logs and metrics
    name: str = ""
    #: True when ``recv`` may write into host (CPU, pinned) tensors directly;
    #: NCCL cannot, so on CUDA the engine receives into device memory first.
    receives_into_host: bool = True
    #: True when ``Channel.send`` also takes byte memoryviews of host memory
    #: (``KVLayout.read_block_bytes``), which cost less than a tensor per block.
    sends_host_bytes: bool = False

    def __init__(self, device: torch.device, bind_host: str):
        self.device = device
        self.bind_host = bind_host
        # Called with a kind for every connection a data port refuses (the
        # engine counts them with the control plane's rejected messages).
        self.on_rejected: Callable[[str], None] = lambda kind: None

    @abc.abstractmethod
    def initiate(self, peer_host: str | None = None) -> tuple[bytes, InitiateFinish]:
        """Start a channel as the initiator: (setup bytes for the peer, finish).

        ``peer_host``: the host of the control peer; a transport that
        connects to an address the peer's reply names connects only there."""

    @abc.abstractmethod
    def accept(
        self, setup: bytes, peer_host: str | None = None
    ) -> tuple[bytes, AcceptFinish]:
        """Accept a channel from ``setup``: (reply bytes for the peer, finish).

        Raises TransportError when ``setup`` is malformed (it came off the
        network: bound and check every field), or names an address on
        another host than ``peer_host`` where it makes this side connect."""

    def close(self) -> None:
        """Release listening resources; channels already made stay usable.

        Nothing by default: only transports that listen (tcp) override it."""
        return


MAX_SETUP_BYTES = 1024

T = TypeVar("T")


# --- helpers shared by the transports ---------------------------------------


def remaining(deadline: float, what: str) -> float:
    """Seconds left before ``deadline``; TransportError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportError(f"{what}: deadline passed")
    return left


def byte_views(
    tensors: Sequence[torch.Tensor], device: torch.device
) -> list[torch.Tensor]:
    """1-D uint8 views of ``tensors`` (no copy), empty ones left out.

    Each must be contiguous and on ``device``: the engine hands over
    contiguous buffers, so anything else is a caller bug worth failing on."""
    views = []
    for t in tensors:
        if t.device != device:
            raise TransportError(
                f"tensor on {t.device}, this channel moves {device} tensors"
            )
        if not t.is_contiguous():
            raise TransportError("tensors must be contiguous")
        if t.numel():
            views.append(t.detach().reshape(-1).view(torch.uint8))
    return views


def check_peer_endpoint(endpoint: Endpoint, peer_host: str | None) -> None:
    """A data endpoint a peer names must be on that peer's own host: nobody
    points this side's connections at a third machine."""
    if peer_host is None:
        return
    if canonical_host(endpoint.host) not in addresses_of(peer_host):
        raise TransportError(
            f"the peer on {peer_host} named a data endpoint on another host "
            f"({endpoint.host})"
        )


# Host name -> (resolved until, addresses): the listener checks every Hello
# and Get against it, and must not wait on the resolver each time.
_RESOLVED: dict[str, tuple[float, frozenset[str]]] = {}
RESOLVE_TTL_S = 60.0


def addresses_of(host: str) -> frozenset[str]:
    """The canonical addresses a host stands for: itself when it is an IP,
    else what it resolves to (a listener advertises the address it bound),
    cached for RESOLVE_TTL_S."""
    canonical = canonical_host(host)
    try:
        ipaddress.ip_address(canonical)
        return frozenset((canonical,))
    except ValueError:
        pass
    now = time.monotonic()
    cached = _RESOLVED.get(canonical)
    if cached is not None and now < cached[0]:
        return cached[1]
    try:
        infos = socket.getaddrinfo(canonical, None, type=socket.SOCK_STREAM)
    except OSError as e:
        raise TransportError(f"cannot resolve the peer's host {host!r}: {e}") from None
    found = frozenset({canonical} | {canonical_host(info[4][0]) for info in infos})
    if len(_RESOLVED) > 1024:
        _RESOLVED.clear()
    _RESOLVED[canonical] = (now + RESOLVE_TTL_S, found)
    return found


def check_host(bind_host: str) -> str:
    """``bind_host`` is advertised to peers as is: refuse a wildcard address."""
    try:
        unspecified = ipaddress.ip_address(bind_host.split("%", 1)[0]).is_unspecified
    except ValueError:  # a host name
        unspecified = not bind_host
    if unspecified:
        raise ValueError(
            f"bind_host {bind_host!r} is a wildcard; give an address the peer can reach"
        )
    return bind_host


class Endpoint(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """host:port of a listening socket, as carried in setup or reply bytes."""

    host: Annotated[str, msgspec.Meta(min_length=1, max_length=300)]
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> Endpoint:
        if len(data) > MAX_SETUP_BYTES:
            raise TransportError(
                f"endpoint of {len(data)} bytes (max {MAX_SETUP_BYTES})"
            )
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except msgspec.MsgspecError as e:
            raise TransportError(f"malformed endpoint: {e}") from None


def call_before(
    deadline: float, what: str, fn: Callable[[], T], discard: Callable[[T], None]
) -> T:
    """Run the blocking set-up step ``fn`` in a daemon thread, waiting until
    ``deadline``.

    For steps with no usable timeout of their own (``ncclCommInitRank``
    waits for the peer forever; gloo's rendezvous can take its timeout
    twice). On expiry the thread is left behind and TransportError raised;
    if ``fn`` completes later, ``discard`` releases what it made."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # handed to the waiting caller
            future.set_exception(e)

    threading.Thread(target=run, name=f"p2p-{what}", daemon=True).start()
    try:
        return future.result(timeout=max(0.0, deadline - time.monotonic()))
    except Exception as e:
        if not future.done():
            future.add_done_callback(
                lambda f: f.exception() is None and discard(f.result())
            )
            raise TransportError(f"{what}: peer did not join by the deadline") from None
        if isinstance(e, TransportError):
            raise
        raise TransportError(f"{what} failed: {e}") from e
