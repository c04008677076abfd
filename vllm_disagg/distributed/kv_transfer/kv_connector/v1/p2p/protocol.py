"""Control-plane messages between the P2P engines of two instances.

Every message is a msgspec struct (never pickle: the bytes come off the
network), tagged, with unknown fields forbidden, in the project's one frame
format (``vllm_disagg/wire/frames.py``: ``[payload, mac]``, the MAC under
the shared secret ``VLLM_DISAGG_P2P_SECRET``, or empty when no secret is
set). Sizes a peer claims are checked against the local KV layout by the
engine before anything is allocated.

The protocol version is checked on the first contact (``Hello``); a peer with
another version is refused with the reason.

Data itself never travels here: after an ``Offer`` is accepted, the sender
writes one data message per run of layers (``layer_groups``: consecutive
layers up to the ``message_bytes`` both Hellos agreed on; each layer's
blocks from ``skip_blocks`` on, then their checksums when the Hello named an
algorithm: checksum.py) to the data channel named in the offer.
"""

from __future__ import annotations

import array
import enum
import hashlib

import msgspec

from vllm_disagg.wire.frames import (  # noqa: F401 (re-exported)
    MAC_BYTES,
    FrameCodec,
    FrameError,
)
from vllm_disagg.wire.peers import MAX_KEY_CHARS

# Version of everything P2P instances exchange (request naming, the messages
# below); a peer with another version is refused at its Hello.
# History:
#   1: first version (kv_transfer_params p2p_* keys, the seed's request-id
#      format, Hello/Offer/Get/Reply).
#   2: Offer carries the prompt's digest; peers need a grant (p2p_grant).
#   3: Abort: a sender that gives up tells the receiver, which recomputes at once;
#      Hello.model (the model fingerprint), which prompt digests cover too;
#      Hello.checksum (kv_checksum: each layer's digests follow its pages).
#   4: a data message carries a run of layers (layer_groups), not always one.
PROTOCOL_VERSION = 4
DIGEST_BYTES = 16


def prompt_digest(token_ids, context: bytes = b"") -> bytes:
    """What both sides of a transfer compute from the request's prompt: KV is
    copied into a decode's cache only when the sender's digest equals the
    decode's own, so KV of one prompt is never filed under another's prefix.
    ``context`` is what else the KV depends on: the model fingerprint
    (fingerprint.py) and the request's LoRA adapter."""
    h = hashlib.sha256(b"p2p-prompt-v1")
    h.update(len(context).to_bytes(8, "little") + context)
    h.update(len(token_ids).to_bytes(8, "little"))
    h.update(array.array("q", token_ids).tobytes())
    return h.digest()[:DIGEST_BYTES]


def embeds_digest(embeds, context: bytes = b"") -> bytes:
    """:func:`prompt_digest` of a prompt given as embeddings (a CPU tensor)."""
    t = embeds.detach().contiguous().cpu()
    h = hashlib.sha256(b"p2p-embeds-v1")
    h.update(len(context).to_bytes(8, "little") + context)
    h.update(f"{tuple(t.shape)}|{t.dtype}".encode())
    h.update(t.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.digest()[:DIGEST_BYTES]


# A data message carries whole layers, at least this many bytes of them
# where the transfer has that many: below about 1 MiB a message's fixed cost
# (a header, a timeout set, a system call and a thread hand-off on each side,
# some 60 us of Python) outweighs its bytes on loopback
# (benchmarks/p2p_transfer.py).
LAYER_MESSAGE_BYTES = 2 << 20


def layer_groups(
    num_layers: int, layer_bytes: int, target: int | None = None
) -> list[range]:
    """The layers of one transfer as its data messages carry them, in order.

    Both sides compute it from what both know (the layer count from the
    Hello's layout, a layer's bytes from the Offer's block count and the
    answer's skip), so no message says where one ends. A layer of
    ``target`` bytes or more goes alone; smaller ones are grouped, so short
    prompts cross in a few messages rather than one per layer. PUT's sender
    waits for the last layer of a group before sending it: at most
    ``target`` bytes of layers wait for the rest of their group."""
    target = LAYER_MESSAGE_BYTES if target is None else target
    per = 1 if layer_bytes <= 0 else -(-target // layer_bytes)
    per = max(1, min(per, num_layers))
    return [range(i, min(i + per, num_layers)) for i in range(0, num_layers, per)]


MAX_FRAME_BYTES = 8192
MAX_ADDR_CHARS = 300
MAX_REASON_CHARS = 300


class _Msg(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag=True):
    pass


class LayoutSpec(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """What both sides' KV caches must agree on for blocks to be copied as bytes."""

    num_layers: int
    page_bytes: int  # bytes of one block of one layer
    block_size: int  # tokens per block
    dtype: str


class Hello(_Msg, tag="hello"):
    """First contact: set up a data channel. Sent by the side that needs one."""

    version: int
    req_no: int
    sender_addr: (
        str  # the sender's control address ("host:port"), for replies of its own
    )
    channel_id: str
    transport: str
    setup: bytes
    layout: LayoutSpec
    send_type: str
    sent_at: float  # the sender's wall clock: old Hellos (replays) are refused
    model: bytes = b""  # the sender's model fingerprint (fingerprint.py)
    # What the sender appends to every layer message on this channel:
    # checksum.py's algorithm name, or "none" (nothing appended).
    checksum: str = "none"
    # Where the data messages end: both sides compute layer_groups() with
    # it, so a channel opens only where they agree (LAYER_MESSAGE_BYTES; a
    # Hello without it is from a build of this version that used 2 MiB).
    message_bytes: int = 2 << 20


class Offer(_Msg, tag="offer", kw_only=True):
    """The sender has (or will have, layer by layer) the KV of ``key``."""

    req_no: int
    channel_id: str
    key: str
    # Reserved: always 0. Protocol 3 has the slot (array-like encoding), so
    # it stays on the wire; nobody sets or reads it.
    xfer_id: int = 0
    num_blocks: int  # blocks of the whole prompt
    prompt_digest: bytes  # prompt_digest() of the prompt whose KV this is
    request_id: str = ""  # sender's internal id, for logs only


class Get(_Msg, tag="get"):
    """Decode asks prefill to offer ``key`` now (GET mode)."""

    req_no: int
    sender_addr: str
    key: str
    skip_blocks: int


class Abort(_Msg, tag="abort"):
    """The sender gave up on the KV of ``keys`` (no reply, refused, a broken
    channel): the receiver fails those loads now, not at kv_load_timeout_s.
    Answered with an ok Reply, re-sent until answered or the keys' deadline;
    acted on only from the host of the prefill each request named."""

    req_no: int
    keys: list[str]
    reason: str = ""


MAX_ABORT_KEYS = 64


class Reply(_Msg, tag="reply"):
    """The answer to any request: ``status`` is one of the ``Status`` values;
    when it is ``REJECTED``, ``reason`` is a :class:`Refusal` kind."""

    req_no: int
    status: str  # a Status value (any string decodes: an unknown one is a failure)
    reason: str = ""
    setup: bytes = b""  # Hello: the transport's reply
    skip_blocks: int = 0  # Offer: blocks the receiver already holds


class Status(enum.StrEnum):
    """What a Reply says; a str enum, so it encodes as the bare string."""

    OK = "ok"
    REJECTED = "rejected"  # permanent: bad message, version, layout, unknown channel
    NO_SPACE = "no_space"  # receive buffer and pool full: the receiver will recompute
    NOT_READY = "not_ready"  # GET before prefill finished: ask again
    GONE = "gone"  # GET for KV that was released or never existed
    NOT_WANTED = "not_wanted"  # Offer for a request the receiver gave up on


class Refusal(enum.StrEnum):
    """Why a request was REJECTED: the kind only (the details go to the
    refusing side's log, never to a peer that may be a stranger). Sent as
    the Reply's ``reason``, and counted as ``rejected_messages`` by kind."""

    MALFORMED = "malformed"  # undecodable, out of bounds, a bad channel set-up
    ADDRESS = "address"  # names an address it did not come from
    VERSION = "version"
    TRANSPORT = "transport"
    LAYOUT = "layout"
    MODEL = "model"  # another model fingerprint
    SEND_TYPE = "send_type"
    CHECKSUM = "checksum"  # another kv_checksum
    STALE = "stale"  # a Hello too old (clock skew or a replay)
    DUPLICATE = "duplicate"  # a channel id in use, a second offer of a key
    BUSY = "busy"  # too many receive threads or keys
    UNKNOWN_CHANNEL = "unknown_channel"  # an offer on no (or a closed) channel
    OVERSIZED = "oversized"  # more blocks than the receiver's KV cache has
    DIGEST = "digest"  # the KV of another prompt
    NOT_YOURS = "not_yours"  # a Get from another host than the request named
    INTERNAL = "internal"  # the handler failed (a bug)


def refusal(reply: Reply) -> Refusal | None:
    """The kind of a REJECTED reply; None for any other (or an unknown kind)."""
    if reply.status != Status.REJECTED:
        return None
    try:
        return Refusal(reply.reason)
    except ValueError:
        return None


Message = Hello | Offer | Get | Abort | Reply

_codec = FrameCodec(b"p2p-kv", msgspec.msgpack.Decoder(Message), MAX_FRAME_BYTES)


def seal(secret: bytes | None, msg: _Msg) -> list[bytes]:
    return _codec.seal(secret, msg)


def open_frame(secret: bytes | None, frames: list[bytes]) -> Message:
    """Authenticate, bound and decode ``[payload, mac]``; raises FrameError."""
    msg = _codec.open(secret, frames)
    _check_bounds(msg)
    return msg


def _check_bounds(msg: Message) -> None:
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise FrameError("malformed", what)

    if isinstance(msg, Hello):
        need(len(msg.sender_addr) <= MAX_ADDR_CHARS, "sender_addr too long")
        need(len(msg.channel_id) <= 64, "channel_id too long")
        need(len(msg.transport) <= 16, "transport name too long")
        need(len(msg.send_type) <= 16, "send_type too long")
        need(len(msg.model) <= 64, "model fingerprint too long")
        need(len(msg.checksum) <= 16, "checksum name too long")
    elif isinstance(msg, Offer):
        need(0 < len(msg.key) <= MAX_KEY_CHARS, "key length")
        need(len(msg.channel_id) <= 64, "channel_id too long")
        need(len(msg.request_id) <= 512, "request_id too long")
        need(msg.num_blocks > 0, "num_blocks must be positive")
        need(len(msg.prompt_digest) == DIGEST_BYTES, "prompt_digest length")
    elif isinstance(msg, Get):
        need(0 < len(msg.key) <= MAX_KEY_CHARS, "key length")
        need(len(msg.sender_addr) <= MAX_ADDR_CHARS, "sender_addr too long")
        need(msg.skip_blocks >= 0, "negative skip_blocks")
    elif isinstance(msg, Abort):
        need(0 < len(msg.keys) <= MAX_ABORT_KEYS, "abort key count")
        need(all(0 < len(k) <= MAX_KEY_CHARS for k in msg.keys), "key length")
        need(len(msg.reason) <= MAX_REASON_CHARS, "reason too long")
    elif isinstance(msg, Reply):
        need(len(msg.reason) <= MAX_REASON_CHARS, "reason too long")
        need(msg.skip_blocks >= 0, "negative skip_blocks")
