"""This worker as its engine's parts see it, and how it refuses a message.

:class:`Local` is what every part reads (the address,
the KV layout, the transport, the options both ends must agree on);
:func:`hello_mismatch` is whether a peer's ``Hello`` agrees with it;
:class:`Rejects` counts, logs and answers what this side refuses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import protocol as proto
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.checksum import Checksum
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import limits
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.layout import (
    KVLayout,
    check_compatible,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
    Hello,
    Refusal,
    Reply,
    Status,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import (
    P2pStatsRecorder,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    Transport,
)
from vllm_disagg.wire.logs import RateLimitedLog


@dataclass(eq=False)
class Local:
    """This worker's end of the network (core.py makes it once; every part
    reads this one object)."""

    addr: str  # the listener's "host:port"
    layout: KVLayout
    transport: Transport
    send_type: str
    hold_timeout_s: float
    model_fingerprint: bytes
    checksum: Checksum | None  # kv_checksum; None: "none"
    checksum_name: str

    def hello(self, req_no: int, channel_id: str, setup: bytes) -> Hello:
        """This side's Hello for a new channel to a peer."""
        return Hello(
            version=proto.PROTOCOL_VERSION,
            req_no=req_no,
            sender_addr=self.addr,
            channel_id=channel_id,
            transport=self.transport.name,
            setup=setup,
            layout=self.layout.spec,
            send_type=self.send_type,
            sent_at=time.time(),
            model=self.model_fingerprint,
            checksum=self.checksum_name,
            message_bytes=proto.LAYER_MESSAGE_BYTES,
        )


def hello_mismatch(local: Local, msg: Hello) -> tuple[Refusal, str] | None:
    """Why a peer's Hello cannot open a channel to ``local`` (the kind, and
    the details for this side's log); None when both ends agree."""
    if msg.version != proto.PROTOCOL_VERSION:
        return Refusal.VERSION, (
            f"protocol version {msg.version}, expected {proto.PROTOCOL_VERSION}"
        )
    if msg.transport != local.transport.name:
        return Refusal.TRANSPORT, (
            f"peer uses transport {msg.transport}, this worker {local.transport.name}"
        )
    mismatch = check_compatible(local.layout.spec, msg.layout)
    if mismatch:
        return Refusal.LAYOUT, mismatch
    if msg.model != local.model_fingerprint:
        # Same shapes, other weights or settings: its KV would give wrong
        # answers here. Both values in one line (each instance logs what
        # its fingerprint covers at start).
        return Refusal.MODEL, (
            f"peer {msg.sender_addr} serves model fingerprint "
            f"{msg.model.hex()[:12] or 'none'}, this worker "
            f"{local.model_fingerprint.hex()[:12] or 'none'}: other weights, "
            "config, tokenizer, dtype or parallel layout"
        )
    if msg.send_type != local.send_type:
        return Refusal.SEND_TYPE, (
            f"peer uses send_type {msg.send_type}, this worker {local.send_type}"
        )
    if msg.checksum != local.checksum_name:
        # Both ends must agree on what a layer message holds.
        return Refusal.CHECKSUM, (
            f"peer attaches kv_checksum {msg.checksum}, this worker checks "
            f"{local.checksum_name}"
        )
    if msg.message_bytes != proto.LAYER_MESSAGE_BYTES:
        # Both ends cut a transfer's layers into the same data messages.
        return Refusal.LAYOUT, (
            f"peer groups layers into data messages of up to {msg.message_bytes} "
            f"bytes, this worker {proto.LAYER_MESSAGE_BYTES}"
        )
    skew = time.time() - msg.sent_at
    if abs(skew) > limits.MAX_HELLO_AGE_S:
        return Refusal.STALE, (
            f"Hello sent {skew:.0f} s ago (clock skew "
            f"or a replay; at most {limits.MAX_HELLO_AGE_S:.0f} s)"
        )
    return None


class Rejects:
    """What this side refuses: counted by kind, logged rate-limited."""

    def __init__(self, addr: str, stats: P2pStatsRecorder, logger):
        self.addr = addr
        self.stats = stats
        self._log = RateLimitedLog(logger, limits.LOG_INTERVAL_S)

    def reject(self, kind: str, detail: str) -> None:
        self.stats.record_rejected(kind)
        self.log_limited(
            kind, f"P2P engine {self.addr} rejected a message ({kind}): {detail}"
        )

    def refuse(self, req_no: int, kind: Refusal, detail: str) -> Reply:
        """Refuse with the kind only: the details (the local layout, say) go
        to this side's log, never to a peer that may be a stranger."""
        self.reject(kind, detail)
        return Reply(req_no=req_no, status=Status.REJECTED, reason=kind)

    def log_limited(self, kind: str, line: str) -> None:
        self._log.warning(kind, "%s", line)
