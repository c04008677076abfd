"""Service discovery between instances and routers (ZMQ, msgspec, versioned).

An instance (the P2pNcclConnector's registration client, in the engine-core
process of every DP rank) sends ``Register`` to every router named in
``proxy_ip`` every ``interval_s`` (3 s), from one DEALER socket per router, to
the router's ROUTER socket on ``proxy_port`` (30001). Each ``Register`` is the
instance's whole state, so a lost one heals with the next heartbeat and a
restarted router learns the fleet within one interval. The router answers
every message with ``Ack`` (accepted or the reason it was refused). On a clean
shutdown the instance sends ``Deregister``.

A frame is ``[payload, mac]``: the MAC is HMAC-SHA256 (16 bytes) over the
payload under the shared registration token (``VLLM_DISAGG_ROUTER_TOKEN``),
empty when no token is set. ``sent_at`` (wall clock) bounds replays of a
captured, signed frame to ``MAX_CLOCK_SKEW_S``. Never pickle: msgspec structs,
tagged, unknown fields forbidden, every string bounded.

This module imports neither vLLM nor quart: the router and the connector both
use it.
"""

from __future__ import annotations

import enum
import math
import re
import time

import msgspec

from vllm_disagg.wire.frames import FrameCodec, FrameError

# History:
#   1: first version (Register / Deregister / Ack).
#   2: Register.aliases (vllm serve --served-model-name's other names).
#   3: Register.stalled_s (seconds the engine held requests without a step).
DISCOVERY_VERSION = 3

DEFAULT_DISCOVERY_PORT = 30001
DEFAULT_HTTP_PORT = 10001
HEARTBEAT_INTERVAL_S = 3.0

MAX_FRAME_BYTES = 4096
MAX_ADDR_CHARS = 261  # a host name (253) + brackets + ":" + port
MAX_ID_CHARS = 128
MAX_MODEL_CHARS = 256
MAX_ALIASES = 8
MAX_REASON_CHARS = 300
MAX_CLOCK_SKEW_S = 300.0
MAX_SEQ = 2**53  # heartbeats every 50 ms for longer than the universe has existed

_ADDR_RE = re.compile(r"^(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253}):[0-9]{1,5}$")
_ID_RE = re.compile(r"^[A-Za-z0-9._:@\[\]-]{1,128}$")


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"  # kv_both: may serve either side

    @classmethod
    def from_kv_role(cls, kv_role: str) -> Role:
        return {
            "kv_producer": cls.PREFILL,
            "kv_consumer": cls.DECODE,
            "kv_both": cls.BOTH,
        }[kv_role]


class _Msg(msgspec.Struct, forbid_unknown_fields=True, tag=True):
    pass


class Register(_Msg, tag="register"):
    """The whole state of one instance (one DP rank of one `vllm serve`)."""

    version: int
    instance_id: str  # unique per process incarnation
    role: Role
    http_addr: str  # "host:port" of its OpenAI server
    kv_addr: str  # "host:port" of its P2P control plane (TP rank 0)
    model: str  # served model name (the first of --served-model-name)
    aliases: tuple[str, ...] = ()  # its other names, also accepted in requests
    dp_rank: int = 0
    dp_size: int = 1
    seq: int = 0  # heartbeat counter of this incarnation
    interval_s: float = HEARTBEAT_INTERVAL_S
    sent_at: float = 0.0  # sender's time.time()
    # Seconds its engine has held requests without scheduling a step (0:
    # stepping, or idle): the router stops sending work past its limit.
    stalled_s: float = 0.0


class Deregister(_Msg, tag="deregister"):
    version: int
    instance_id: str
    sent_at: float = 0.0


class Ack(_Msg, tag="ack"):
    version: int
    instance_id: str
    accepted: bool
    reason: str = ""


Message = Register | Deregister | Ack

_codec = FrameCodec(
    b"vllm-disagg-discovery", msgspec.msgpack.Decoder(Message), MAX_FRAME_BYTES
)
# One error type for every protocol's frames (wire/frames.py).
DiscoveryError = FrameError


def seal(token: bytes | None, msg: Message) -> list[bytes]:
    return _codec.seal(token, msg)


def open_frame(
    token: bytes | None, frames: list[bytes], *, now: float | None = None
) -> Message:
    """Authenticate, bound, decode and validate ``[payload, mac]``.

    Raises FrameError (kinds: malformed, oversized, unauthenticated, stale,
    version).
    """
    try:
        msg = _codec.open(token, frames)
    except FrameError as e:
        if e.kind == "unauthenticated":  # what an operator must fix
            raise FrameError(e.kind, "bad or missing registration token") from None
        raise
    if msg.version != DISCOVERY_VERSION:
        raise FrameError(
            "version",
            f"discovery protocol {msg.version}, this side speaks {DISCOVERY_VERSION}",
        )
    validate(msg)
    if not isinstance(msg, Ack):
        # A sender clock decides which incarnation holds an address, so one
        # from the future would lock it: bounded with or without a token.
        # With one, the past is bounded too (replays of captured frames);
        # without, an old clock only loses every contest.
        now = time.time() if now is None else now
        ahead = msg.sent_at - now
        if ahead > MAX_CLOCK_SKEW_S or (token and -ahead > MAX_CLOCK_SKEW_S):
            raise FrameError("stale", f"sent_at is {-ahead:.0f}s off")
    return msg


def validate(msg: Message) -> None:
    """Bounds every field a peer controls; raises FrameError("malformed")."""

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise FrameError("malformed", what)

    need(
        bool(_ID_RE.match(msg.instance_id)),
        "instance_id must be 1-128 of [A-Za-z0-9._:@[]-]",
    )
    if not isinstance(msg, Ack):
        need(
            math.isfinite(msg.sent_at) and msg.sent_at >= 0,
            "sent_at must be a finite time",
        )
    if isinstance(msg, Register):
        for name in ("http_addr", "kv_addr"):
            value = getattr(msg, name)
            need(
                len(value) <= MAX_ADDR_CHARS and bool(_ADDR_RE.match(value)),
                f"{name} must be host:port",
            )
            need(0 < int(value.rsplit(":", 1)[1]) < 65536, f"{name} port out of range")
        need(len(msg.aliases) <= MAX_ALIASES, f"more than {MAX_ALIASES} aliases")
        for name in (msg.model, *msg.aliases):
            need(0 < len(name) <= MAX_MODEL_CHARS, "model name length")
            need(
                name.isprintable(),
                "model names must be printable (no control characters)",
            )
        need(
            1 <= msg.dp_size <= 1024 and 0 <= msg.dp_rank < msg.dp_size,
            "dp_rank/dp_size",
        )
        need(0 <= msg.seq <= MAX_SEQ, f"seq out of [0, {MAX_SEQ}]")
        need(0.05 <= msg.interval_s <= 600, "interval_s out of [0.05, 600]")
        need(
            math.isfinite(msg.stalled_s) and 0 <= msg.stalled_s <= 1e9,
            "stalled_s out of [0, 1e9]",
        )
    elif isinstance(msg, Ack):
        need(len(msg.reason) <= MAX_REASON_CHARS, "reason too long")
