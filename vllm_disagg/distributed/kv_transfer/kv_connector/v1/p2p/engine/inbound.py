"""What arrives: room for one transfer, and the thread that fills it.

A peer's ``Hello`` makes an :class:`InboundChannel` with its own receive
thread; each accepted ``Offer`` queues a :class:`RecvSlot` on it, and the
thread fills the slots in order, one data message per layer (the n-th message
on a channel belongs to the n-th accepted offer).
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.checksum import (
    DIGEST_BYTES,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import limits
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.tensor_pool import (
    PoolAllocation,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    Channel,
    TransportError,
)

if TYPE_CHECKING:
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.core import (
        P2pEngine,
    )


class SlotState(enum.Enum):
    RECEIVING = "receiving"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass(eq=False)
class RecvSlot:
    """Room for one transfer: ``num_layers x (num_blocks - skip)`` pages."""

    key: str
    num_blocks: int  # blocks of the whole prompt on the sender
    skip_blocks: int
    page_bytes: int
    num_layers: int
    tensor: torch.Tensor  # uint8, the whole transfer, layer-major
    pool_alloc: PoolAllocation | None
    deadline: float
    prompt_digest: bytes = b""  # the sender's: the worker copies only on a match
    # kv_checksum: the sender's block digests, layer-major (checksum.py); None: off
    digests: torch.Tensor | None = None
    state: SlotState = SlotState.RECEIVING
    reason: str = ""

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @property
    def blocks_held(self) -> int:
        return self.num_blocks - self.skip_blocks

    def layer(self, i: int) -> torch.Tensor:
        n = self.blocks_held * self.page_bytes
        return self.tensor[i * n : (i + 1) * n]

    def layer_digests(self, i: int) -> torch.Tensor:
        n = self.blocks_held * DIGEST_BYTES
        return self.digests[i * n : (i + 1) * n]


class InboundChannel:
    """A channel a peer created to send to us, with its receive thread."""

    def __init__(
        self,
        engine: P2pEngine,
        channel_id: str,
        peer: str,
        finish,
        deadline: float,
        route: bytes = b"",
    ):
        self.engine = engine
        self.channel_id = channel_id
        self.peer = peer
        self.route = route  # the control connection its Hello came on: offers must too
        self.queue: queue.Queue[RecvSlot] = queue.Queue()
        self.channel: Channel | None = None
        self.broken = False
        self._finish = finish
        self._setup_deadline = deadline
        self.thread = threading.Thread(
            target=self._run, name=f"p2p-recv-{peer}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        try:
            self._receive()
        finally:
            with self.engine._lock:
                self.engine._recv_threads -= 1

    def _receive(self) -> None:
        engine = self.engine
        try:
            channel = self._finish(self._setup_deadline)
        except TransportError as e:
            self._break(f"channel set-up failed: {e}")
            return
        with engine._lock:
            broken, self.channel = self.broken, channel
            # A sender uses only its newest channel to us: an older one from
            # the same address belongs to a sender that restarted or gave up
            # on it. Replaced only now that this one is set up, so a replayed
            # Hello that cannot complete breaks nothing.
            stale = [
                c
                for c in engine._inbound.values()
                if c.peer == self.peer and c is not self
            ]
        if broken:  # replaced or closed while it was being set up
            channel.close()
            return
        for old in stale:
            old._break("the sender opened a new channel")
        next_check = time.monotonic() + limits.IDLE_CHECK_INTERVAL_S
        while not engine.stopped.is_set() and not self.broken:
            try:
                slot = self.queue.get(timeout=limits.POLL_INTERVAL_S)
            except queue.Empty:
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + limits.IDLE_CHECK_INTERVAL_S
                    if self.channel.peer_closed():
                        # The sender's process is gone (its socket closed):
                        # free the thread and the socket now, not never.
                        self._break("the sender closed the channel")
                        return
                continue
            start = time.monotonic()
            corrupt = None  # why the slot was discarded (kv_checksum), once it was
            try:
                for i in range(slot.num_layers):
                    if corrupt is not None:
                        engine._drain_layer(self.channel, slot)
                        continue
                    engine._recv_layer(self.channel, slot, i)
                    corrupt = engine._corrupt_blocks(slot, i)
                    if corrupt is not None:
                        # Failed now, not after the sender's last layer.
                        engine._discard_corrupt(slot, self.peer, corrupt)
            except TransportError as e:
                if corrupt is None:
                    engine._finish_slot(slot, ok=False, reason=f"receive failed: {e}")
                self._break(str(e))
                return
            if corrupt is not None:
                continue
            engine.stats.record_recv(
                slot.nbytes, slot.blocks_held, time.monotonic() - start
            )
            engine._finish_slot(slot, ok=True)

    def _break(self, reason: str) -> None:
        engine = self.engine
        with engine._lock:
            # Under the engine lock: an offer either sees the channel broken,
            # or is queued before the drain below and failed by it.
            self.broken = True
            if engine._inbound.get(self.channel_id) is self:
                del engine._inbound[self.channel_id]
        engine._log_limited(
            "channel_closed", f"P2P channel from {self.peer} closed: {reason}"
        )
        if self.channel is not None:
            self.channel.close()
        while True:
            try:
                slot = self.queue.get_nowait()
            except queue.Empty:
                break
            engine._finish_slot(slot, ok=False, reason=f"channel closed: {reason}")
