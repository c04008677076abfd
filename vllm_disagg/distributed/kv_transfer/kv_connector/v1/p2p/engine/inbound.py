"""What arrives: a peer's channel to us, and the thread that fills its slots.

A peer's ``Hello`` makes an :class:`InboundChannel` with its own receive
thread; each accepted ``Offer`` queues a :class:`~.transfers.RecvSlot` on
it, and the thread fills the slots in order, in data messages of one or
more layers (``protocol.layer_groups``; the n-th offer's messages follow the
(n-1)-th's on a channel). The thread
talks to the receive side only through :class:`~.ports.InboundOwner`.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.checksum import (
    DIGEST_BYTES,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import limits
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.ports import (
    InboundOwner,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.transfers import (
    RecvSlot,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
    layer_groups,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    Channel,
    TransportError,
)


class InboundChannel:
    """A channel a peer created to send to us, with its receive thread."""

    def __init__(
        self,
        owner: InboundOwner,
        channel_id: str,
        peer: str,
        finish,
        deadline: float,
        route: bytes = b"",
        peer_host: str = "",
    ):
        self.owner = owner
        self.channel_id = channel_id
        self.peer = peer
        self.peer_host = peer_host  # the host of ``peer`` (canonical)
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
            self.owner.thread_ended()

    def _receive(self) -> None:
        owner = self.owner
        try:
            channel = self._finish(self._setup_deadline)
        except TransportError as e:
            self.break_(f"channel set-up failed: {e}")
            return
        if not owner.channel_up(self, channel):  # replaced or closed meanwhile
            channel.close()
            return
        next_check = time.monotonic() + limits.IDLE_CHECK_INTERVAL_S
        while not owner.stopped.is_set() and not self.broken:
            try:
                slot = self.queue.get(timeout=limits.POLL_INTERVAL_S)
            except queue.Empty:
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + limits.IDLE_CHECK_INTERVAL_S
                    if self.channel.peer_closed():
                        # The sender's process is gone (its socket closed):
                        # free the thread and the socket now, not never.
                        self.break_("the sender closed the channel")
                        return
                continue
            start = time.monotonic()
            corrupt = None  # why the slot was discarded (kv_checksum), once it was
            try:
                for group in layer_groups(
                    slot.num_layers, slot.blocks_held * slot.page_bytes
                ):
                    if corrupt is not None:
                        self._drain(slot, group)
                        continue
                    self._recv_layers(slot, group)
                    for i in group:
                        corrupt = self._corrupt_blocks(slot, i)
                        if corrupt is not None:
                            # Failed now, not after the sender's last layer.
                            owner.discard_corrupt(slot, self.peer, corrupt)
                            break
            except TransportError as e:
                if corrupt is None:
                    owner.finish_slot(slot, ok=False, reason=f"receive failed: {e}")
                self.break_(str(e))
                return
            if corrupt is not None:
                continue
            owner.stats.record_recv(
                slot.nbytes, slot.blocks_held, time.monotonic() - start
            )
            owner.finish_slot(slot, ok=True)

    def _recv_layers(self, slot: RecvSlot, layers: range) -> None:
        """Receive the one data message that carries ``layers`` of ``slot``."""
        local = self.owner.local
        dsts, parts = [], []
        staged = slot.pool_alloc is not None and not local.transport.receives_into_host
        for layer in layers:
            dst = slot.layer(layer)
            if staged:
                staging = torch.empty(
                    dst.numel(), dtype=torch.uint8, device=local.layout.device
                )
                dsts.append((dst, staging))
                dst = staging
            parts.append(dst)
            # With kv_checksum, each layer's block digests follow its pages.
            if slot.digests is not None:
                parts.append(slot.layer_digests(layer))
        self.channel.recv(parts, slot.deadline)
        for dst, staging in dsts:
            dst.copy_(staging)

    def _corrupt_blocks(self, slot: RecvSlot, layer: int) -> str | None:
        """Why layer ``layer`` of ``slot`` (just received) must not be used:
        blocks whose checksum is not the sender's; None when all match or
        there is no checksum."""
        checksum = self.owner.local.checksum
        if checksum is None or slot.digests is None:
            return None
        bad = checksum.mismatches(
            slot.layer(layer), slot.page_bytes, slot.layer_digests(layer)
        )
        if not bad:
            return None
        shown = ", ".join(str(slot.skip_blocks + i) for i in bad[:8])
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        return (
            f"checksum mismatch ({checksum.name}): layer {layer}, block "
            f"{shown}{more} of the prompt"
        )

    def _drain(self, slot: RecvSlot, layers: range) -> None:
        """Receive one more data message of a discarded transfer and drop it,
        so the channel's next message belongs to the next offer (the slot's
        own memory is no longer this thread's)."""
        held = slot.blocks_held
        scratch = torch.empty(
            len(layers) * held * (slot.page_bytes + DIGEST_BYTES), dtype=torch.uint8
        )
        self.channel.recv([scratch], slot.deadline)

    def break_(self, reason: str) -> None:
        """Close the channel and fail every slot queued on it: after
        ``channel_down`` no offer is queued here, and the ones queued before
        are failed by the drain below."""
        self.owner.channel_down(self, reason)
        if self.channel is not None:
            self.channel.close()
        while True:
            try:
                slot = self.queue.get_nowait()
            except queue.Empty:
                break
            self.owner.finish_slot(slot, ok=False, reason=f"channel closed: {reason}")
