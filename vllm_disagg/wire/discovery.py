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
empty when no token is set. ``sent_at`` (wall clock) must be within
``MAX_CLOCK_SKEW_S`` of the router's clock, ahead or behind: that bounds
replays of a captured, signed frame, and it is the fleet's one clock rule
(``wire/clocks.py``), so any two instances a router accepts can open a P2P
channel to each other. A ``Register``'s ``seq`` must grow with every frame
(``router/registry.py``). Addresses follow the one ``host:port`` grammar of
``wire/peers.py``: what discovery accepts, the router and the P2P plane
accept too. Never pickle: msgspec structs, tagged, unknown fields forbidden,
every string bounded.

This module imports neither vLLM nor quart: the router and the connector both
use it.
"""

from __future__ import annotations

import enum
import math
import re
import time

import msgspec

from vllm_disagg.wire.clocks import MAX_CLOCK_SKEW_S, clock_offset_problem
from vllm_disagg.wire.frames import FrameCodec, FrameError
from vllm_disagg.wire.peers import PeerInfoError, split_addr

# History:
#   1: first version (Register / Deregister / Ack).
#   2: Register.aliases (vllm serve --served-model-name's other names).
#   3: Register.stalled_s (seconds the engine held requests without a step),
#      Register.fingerprint (the model fingerprint: pairs form only within one).
#   4: Register.dp_group (the DP group whose ranks step together). A router
#      speaking 4 takes 3 too (and answers in the sender's version); an
#      instance sends 3 unless it has a group to name, so a DP=1 instance
#      still registers with a router speaking 3. Fields a version does not
#      have are omitted from its frames (omit_defaults), never sent empty.
DISCOVERY_VERSION = 4
MIN_DISCOVERY_VERSION = 3  # the oldest this side still takes

DEFAULT_DISCOVERY_PORT = 30001
DEFAULT_HTTP_PORT = 10001
HEARTBEAT_INTERVAL_S = 3.0

MAX_FRAME_BYTES = 4096
MAX_ID_CHARS = 128
MAX_MODEL_CHARS = 256
MAX_ALIASES = 8
MAX_REASON_CHARS = 300
MAX_MODEL_LEN = 2**31 - 1  # vLLM's context lengths are int32 token counts
MAX_DP_GROUP_CHARS = 32
MAX_SEQ = 2**53  # heartbeats every 50 ms for longer than the universe has existed

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


class _Msg(msgspec.Struct, forbid_unknown_fields=True, tag=True, omit_defaults=True):
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
    seq: int = 0  # heartbeat counter of this incarnation, grows every frame
    interval_s: float = HEARTBEAT_INTERVAL_S
    sent_at: float = 0.0  # sender's time.time()
    # Seconds its engine has held requests without scheduling a step (0:
    # stepping, or idle): the router stops sending work past its limit.
    stalled_s: float = 0.0
    # Its model fingerprint (hex; p2p/fingerprint.py): the router pairs a
    # prefill and a decode only when theirs are equal ("": not known).
    fingerprint: str = ""
    # Its --max-model-len (0: not known): the router sends a request whose
    # output limit vLLM refuses against it to the decode alone, at no
    # prefill's cost.
    max_model_len: int = 0
    # Version 4: the DP group whose ranks step together (hex, the same on
    # every rank of one group; ""  when dp_size is 1). The router places a
    # request on the rank that keeps the group's busiest rank least loaded.
    dp_group: str = ""


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
    if not MIN_DISCOVERY_VERSION <= msg.version <= DISCOVERY_VERSION:
        raise FrameError(
            "version",
            f"discovery protocol {msg.version}, this side speaks "
            f"{MIN_DISCOVERY_VERSION} to {DISCOVERY_VERSION}",
        )
    validate(msg)
    if not isinstance(msg, Ack):
        # Both ways, with or without a token: a clock from the future would
        # lock an address (a sender clock decides which incarnation holds
        # it), an old frame is a replay, and an instance too far off either
        # way could not open a P2P channel to the others (wire/clocks.py).
        now = time.time() if now is None else now
        problem = clock_offset_problem(msg.sent_at - now, MAX_CLOCK_SKEW_S, "router")
        if problem is not None:
            raise FrameError("stale", problem)
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
            # The project's one grammar: an address the router names in a
            # request (kv_transfer_params, grants) must parse there too.
            try:
                split_addr(getattr(msg, name), name)
            except PeerInfoError as e:
                raise FrameError("malformed", str(e)) from None
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
        need(
            len(msg.dp_group) <= MAX_DP_GROUP_CHARS
            and all(c in "0123456789abcdef" for c in msg.dp_group),
            f"dp_group must be at most {MAX_DP_GROUP_CHARS} lower-case hex digits",
        )
        need(
            not msg.dp_group or (msg.version >= 4 and msg.dp_size > 1),
            "dp_group needs discovery version 4 and dp_size above 1",
        )
        need(
            len(msg.fingerprint) <= 64
            and all(c in "0123456789abcdef" for c in msg.fingerprint),
            "fingerprint must be at most 64 lower-case hex digits",
        )
        need(
            0 <= msg.max_model_len <= MAX_MODEL_LEN,
            f"max_model_len out of [0, {MAX_MODEL_LEN}]",
        )
    elif isinstance(msg, Ack):
        need(len(msg.reason) <= MAX_REASON_CHARS, "reason too long")
