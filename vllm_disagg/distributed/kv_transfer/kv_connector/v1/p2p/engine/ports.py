"""What the engine's threads may ask of it: two narrow, typed interfaces.

A :class:`~.peer.Peer` thread (what this side asks of one peer) talks to
the engine through :class:`PeerOwner`; an :class:`~.inbound.InboundChannel`
receive thread to the engine's receive side through :class:`InboundOwner`.
Neither touches the engine's lock or tables: each call below takes what
lock it needs. Protocols only, importing neither side, so the modules that
implement them (core.py, receiver.py) and the ones that use them (peer.py,
inbound.py) import each other in one direction only.
"""

from __future__ import annotations

import queue
import threading
from typing import Protocol

import zmq

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.local import Local
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.transfers import (
    RecvSlot,
    SendTransfer,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import (
    P2pStatsRecorder,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    Channel,
)


class IdlePeer(Protocol):
    """A peer thread that asks to retire."""

    addr: str
    jobs: queue.Queue


class PeerOwner(Protocol):
    """What a peer thread reads and asks of the engine (core.py)."""

    local: Local
    secret: bytes | None
    zmq_ctx: zmq.Context
    stopped: threading.Event
    closing: threading.Event  # set before ``stopped``: end sends, tell receivers
    stats: P2pStatsRecorder

    def finish_send(self, xfer: SendTransfer, *, ok: bool, reason: str = "") -> None:
        """The send of ``xfer`` ended (once; a second end is ignored)."""

    def still_expected(self, key: str) -> bool:
        """GET: the decode still waits for an offer of ``key``."""

    def retire_peer(self, peer: IdlePeer) -> bool:
        """An idle peer thread may exit: yes unless a job arrived meanwhile."""

    def reject(self, kind: str, detail: str) -> None:
        """A bad message from a peer: counted, logged (rate-limited)."""


class ChannelEnd(Protocol):
    """An inbound channel as its owner sees it (inbound.py)."""

    channel_id: str
    peer: str
    broken: bool
    channel: Channel | None

    def break_(self, reason: str) -> None: ...


class InboundOwner(Protocol):
    """What a receive thread asks of the engine's receive side (receiver.py)."""

    local: Local
    stopped: threading.Event
    stats: P2pStatsRecorder

    def channel_up(self, inbound: ChannelEnd, channel: Channel) -> bool:
        """``inbound``'s data channel is set up: False if it was closed
        meanwhile; older channels of its sender are broken."""

    def channel_down(self, inbound: ChannelEnd, reason: str) -> None:
        """``inbound`` broke: no offer is queued on it from now on."""

    def thread_ended(self) -> None:
        """A receive thread exits (they are counted)."""

    def discard_corrupt(self, slot: RecvSlot, peer: str, reason: str) -> None:
        """Fail ``slot`` now: a block is not what its sender hashed."""

    def finish_slot(
        self, slot: RecvSlot, *, ok: bool, reason: str = "", quiet: bool = False
    ) -> None:
        """The receive of ``slot`` ended."""
