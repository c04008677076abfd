"""The one authenticated frame format of every ZMQ protocol in the project:
service discovery, the P2P control plane, and step sync.

A frame is a two-part ZMQ message ``[payload, mac]``: the payload is a
msgspec MessagePack struct (tagged, unknown fields forbidden: never pickle,
the bytes come off the network), the MAC is HMAC-SHA256 over a per-protocol
domain label and the payload, truncated to 16 bytes, under the protocol's
shared key; empty when the protocol runs without one. The domain label keeps
a frame of one protocol (or one direction of it) from verifying as another.

Every way a frame can be wrong raises one :class:`FrameError` whose ``kind``
(malformed, oversized, unauthenticated, and the protocols' own: stale,
version, ...) is the label its rejection is counted under.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

import msgspec

MAC_BYTES = 16
# A connection must finish ZMQ's handshake this soon, or libzmq drops it: a
# stranger's idle TCP connections cannot pile up and use every descriptor.
HANDSHAKE_TIMEOUT_MS = 5000

_encoder = msgspec.msgpack.Encoder()


def harden_listener(sock, max_frame_bytes: int) -> None:
    """Bounds for a socket that strangers can reach (a pyzmq socket; zmq is
    imported by the caller): frames over ``max_frame_bytes`` disconnect
    their sender, connections that never finish the handshake are dropped.
    libzmq bounds each frame, not the number of frames in a message: see the
    known limits in docs/p2p_connector.md#security."""
    import zmq

    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)


class FrameError(ValueError):
    """A frame was rejected; ``kind`` is the counter label, the text says why."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


@dataclass(frozen=True)
class FrameCodec:
    """Seals and opens the frames of one protocol (or one direction of it)."""

    domain: bytes
    decoder: msgspec.msgpack.Decoder
    max_payload: int

    def mac(self, key: bytes, payload: bytes) -> bytes:
        return hmac.new(key, self.domain + payload, hashlib.sha256).digest()[:MAC_BYTES]

    def seal(self, key: bytes | None, msg: msgspec.Struct) -> list[bytes]:
        payload = _encoder.encode(msg)
        return [payload, self.mac(key, payload) if key else b""]

    def open(self, key: bytes | None, frames: list[bytes]) -> Any:
        """Bound, authenticate (when there is a key) and decode ``frames``;
        raises FrameError."""
        if len(frames) != 2:
            raise FrameError("malformed", f"{len(frames)} frames, expected 2")
        payload, mac = frames
        if len(payload) > self.max_payload:
            raise FrameError("oversized", f"{len(payload)} bytes > {self.max_payload}")
        if key and (
            len(mac) != MAC_BYTES
            or not hmac.compare_digest(mac, self.mac(key, payload))
        ):
            raise FrameError("unauthenticated", "bad or missing MAC")
        try:
            return self.decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise FrameError("malformed", str(e)[:200]) from None
