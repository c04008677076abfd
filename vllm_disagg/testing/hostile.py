"""Hostile input for every port the project opens (the chaos suite's fuzzer).

Each protocol gets the same families of bad messages, built with that
protocol's own encoder so they get past the first checks and reach the
deeper ones:

* ``garbage``: random bytes in a random number of frames (0 to 4);
* ``truncated``: a well-formed message cut short, its MAC kept;
* ``oversized``: a payload just over the protocol's bound, and far over it;
* ``forged``: a well-formed message under a key the attacker guessed;
* ``replayed``: a message sealed with the real key (as if captured) that is
  stale, foreign (an id the group never saw) or repeated;
* ``confused``: the right shape with wrong types, extra fields, or nesting
  thousands deep.

ZMQ ports (discovery, the P2P control plane, step sync) get multipart
messages from DEALER sockets; TCP ports (the router's HTTP, the P2P data
channels) get byte streams. Every send is bounded in count and time, never
waits on the target, and uses loopback in tests. Nothing here needs vLLM.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
import zmq

Frames = list[bytes]
KINDS = ("garbage", "truncated", "oversized", "forged", "replayed", "confused")


@dataclass(frozen=True)
class ZmqProtocol:
    """What the fuzzer needs to know of one ZMQ protocol."""

    name: str
    max_payload: int
    # key (None: the attacker does not know it) -> a well-formed sealed message
    sample: Callable[[random.Random, bytes | None], Frames]


def _deep(depth: int) -> bytes:
    """A msgpack array nested ``depth`` deep: [[[...]]]."""
    return b"\x91" * depth + b"\xc0"


def hostile_frames(
    proto: ZmqProtocol, rng: random.Random, key: bytes | None
) -> Iterator[tuple[str, Frames]]:
    """Endless (kind, frames) of every family, in a seeded order."""
    wrong_key = bytes(rng.randrange(256) for _ in range(32))
    while True:
        kind = rng.choice(KINDS)
        if kind == "garbage":
            frames = [
                rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(0, 5))
            ]
        elif kind == "truncated":
            payload, mac = proto.sample(rng, key)
            frames = [payload[: rng.randrange(0, max(1, len(payload)))], mac]
        elif kind == "oversized":
            size = rng.choice((proto.max_payload + 1, 4 * proto.max_payload))
            frames = [rng.randbytes(size), rng.randbytes(16)]
        elif kind == "forged":
            frames = proto.sample(rng, wrong_key)
        elif kind == "replayed":
            frames = proto.sample(rng, key) if key else proto.sample(rng, wrong_key)
        else:
            payload, mac = proto.sample(rng, key)
            frames = rng.choice(
                (
                    [_deep(rng.choice((100, 5000))), mac],
                    [payload + rng.randbytes(8), mac],  # trailing bytes
                    [
                        msgspec.msgpack.encode(
                            {"type": "x", "v": [1.5, None, -(2**63)]}
                        ),
                        mac,
                    ],
                    [payload, mac, b"extra"],
                )
            )
        yield kind, frames


# --- the project's ZMQ protocols ---------------------------------------------


def discovery_protocol() -> ZmqProtocol:
    from vllm_disagg.wire import discovery as d

    def sample(rng: random.Random, key: bytes | None) -> Frames:
        port = rng.randrange(1024, 65536)
        if rng.random() < 0.5:
            msg = d.Register(
                version=d.DISCOVERY_VERSION,
                instance_id=f"fuzz-{rng.randrange(10**6)}",
                role=rng.choice(list(d.Role)),
                http_addr=f"127.0.0.1:{port}",
                kv_addr=f"127.0.0.1:{port + 1 if port < 65535 else 1024}",
                model="fuzz",
                seq=rng.randrange(0, 10),
                sent_at=time.time() - rng.choice((0, 400, 10**6)),
            )
        else:
            msg = d.Deregister(
                version=d.DISCOVERY_VERSION, instance_id=f"fuzz-{rng.randrange(10**6)}"
            )
        return d.seal(key, msg)

    return ZmqProtocol("discovery", d.MAX_FRAME_BYTES, sample)


def p2p_control_protocol() -> ZmqProtocol:
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import protocol as p

    def sample(rng: random.Random, key: bytes | None) -> Frames:
        choice = rng.randrange(3)
        if choice == 0:
            msg = p.Hello(
                version=p.PROTOCOL_VERSION,
                req_no=rng.randrange(1, 1000),
                sender_addr="127.0.0.1:1",
                channel_id=rng.randbytes(8).hex(),
                transport="tcp",
                setup=rng.randbytes(16),
                layout=p.LayoutSpec(2, 4096, 32, "float32"),
                send_type="PUT_ASYNC",
                sent_at=time.time() - rng.choice((0, 1000)),
            )
        elif choice == 1:
            msg = p.Offer(
                req_no=rng.randrange(1, 1000),
                channel_id=rng.randbytes(8).hex(),
                key=rng.randbytes(16).hex(),
                xfer_id=rng.randrange(1, 100),
                num_blocks=rng.randrange(1, 10**6),
                prompt_digest=rng.randbytes(p.DIGEST_BYTES),
            )
        else:
            msg = p.Get(
                req_no=rng.randrange(1, 1000),
                sender_addr="127.0.0.1:1",
                key=rng.randbytes(16).hex(),
                skip_blocks=rng.randrange(0, 10),
            )
        return p.seal(key, msg)

    return ZmqProtocol("p2p_control", p.MAX_FRAME_BYTES, sample)


def step_sync_protocol() -> ZmqProtocol:
    from vllm_disagg.v1.engine import step_sync as s

    def sample(rng: random.Random, key: bytes | None) -> Frames:
        if rng.random() < 0.8:
            msg = s.RankState(
                version=s.PROTOCOL_VERSION,
                dp_rank=rng.randrange(0, 4),
                dp_size=2,
                lookahead=2,
                incarnation=rng.randbytes(6).hex(),
                seq=rng.randrange(1, 100),
                requested=rng.randrange(0, 10**6),
                local_step=rng.randrange(0, 10**6),
                intent=0,
                want_pause=False,
                pause_ready=False,
                leaving=rng.random() < 0.2,
                left=False,
            )
        else:
            msg = s.Abort(
                version=s.PROTOCOL_VERSION, seq=rng.randrange(1, 100), reason="fuzz"
            )
        return s.seal(key or b"\0" * 32, s.TO_COORDINATOR, msg)

    return ZmqProtocol("step_sync", s.MAX_MESSAGE_BYTES, sample)


# --- senders ---------------------------------------------------------------------


@dataclass
class Sent:
    """What a flood did: messages sent by kind, how long it took, and how
    many went alone on a connection because a frame of theirs was over the
    protocol's bound: libzmq may drop those with their connection before the
    application sees them (a listener whose size limit has slack gets them)."""

    by_kind: dict[str, int]
    seconds: float
    alone: int = 0

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


def flood_zmq(
    address: str,
    proto: ZmqProtocol,
    *,
    count: int,
    time_s: float,
    seed: int = 0,
    key: bytes | None = None,
    per_socket: int = 50,
) -> Sent:
    """Send ``count`` hostile messages to the ZMQ ``address`` (``host:port``)
    within ``time_s``, ``per_socket`` per fresh DEALER (a new identity each
    time, as many strangers would); a full queue skips a message instead of
    waiting on the target."""
    rng = random.Random(seed)
    ctx = zmq.Context()
    # Closed sockets count until their messages left (LINGER): room for many.
    ctx.set(zmq.MAX_SOCKETS, 8192)
    by_kind = dict.fromkeys(KINDS, 0)
    started = time.monotonic()
    frames_of = hostile_frames(proto, rng, key)
    shared: zmq.Socket | None = None
    shared_sent = 0
    alone = 0

    def dealer() -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, per_socket + 10)
        # Long enough for a target starved of CPU to take what was queued:
        # what is sent is what reached it (its handshake deadline still holds).
        sock.setsockopt(zmq.LINGER, 10_000)
        sock.connect(f"tcp://{address}")
        return sock

    try:
        for _ in range(count):
            if time.monotonic() - started > time_s:
                break
            kind, frames = next(frames_of)
            if any(len(f) > proto.max_payload for f in frames):
                # libzmq drops a message over the target's size limit together
                # with its connection, and whatever was queued behind it: a
                # socket of its own, so the other messages still arrive.
                sock = dealer()
                sock.send_multipart(frames)
                sock.close()
                by_kind[kind] += 1
                alone += 1
                continue
            if shared is None or shared_sent >= per_socket:
                if shared is not None:
                    shared.close()
                shared, shared_sent = dealer(), 0
            try:
                # An empty multipart message cannot be sent: one empty frame instead.
                shared.send_multipart(frames or [b""], flags=zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.01)
                continue
            shared_sent += 1
            by_kind[kind] += 1
    finally:
        if shared is not None:
            shared.close()
        ctx.term()  # waits (LINGER) for what is queued to leave
    return Sent(by_kind, time.monotonic() - started, alone)


def _post(path: bytes, body: bytes, extra: bytes = b"") -> bytes:
    """A whole request; the server closes the connection once it answered."""
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


# Well-framed HTTP with bodies a parser or a JSON decoder must refuse, and
# framing a parser must refuse.
_CONFUSED_HTTP = (
    b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Type: application/json\r\n\r\nzz\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
    b"GET /\x00\xff HTTP/1.1\r\n\r\n",
    _post(b"/v1/completions", b"[" * 10000 + b"]" * 10000),
    _post(b"/v1/chat/completions", b'{"messages": "\\ud800\\ud800"}'),
    _post(b"/v1/completions", b'{"prompt": 1e999999, "model": NaN}'),
    _post(b"/v1/completions", b"\xff\xfe{}"),
)


def http_payloads(rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """Endless (kind, bytes) of broken HTTP/1.1 for the router's port."""
    body = b'{"model": "m", "prompt": "x"}'
    while True:
        kind = rng.choice(("garbage", "truncated", "oversized", "confused"))
        if kind == "garbage":
            data = rng.randbytes(rng.randrange(1, 2000))
        elif kind == "truncated":
            full = (
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
            )
            data = full[: rng.randrange(1, len(full))]
        elif kind == "oversized":
            data = (
                b"POST /v1/completions HTTP/1.1\r\nX-Big: "
                + b"a" * rng.choice((70_000, 300_000))
                + b"\r\n\r\n"
            )
        else:
            data = rng.choice(_CONFUSED_HTTP)
        yield kind, data


def stream_payloads(rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """Endless (kind, bytes) for a raw TCP port (the P2P data channels)."""
    while True:
        kind = rng.choice(("garbage", "truncated", "oversized"))
        if kind == "garbage":
            data = rng.randbytes(rng.randrange(1, 4096))
        elif kind == "truncated":
            data = rng.randbytes(rng.randrange(1, 16))
        else:
            # A header claiming a huge length, then little.
            data = (2**62).to_bytes(8, "little") * 4 + rng.randbytes(64)
        yield kind, data


def flood_tcp(
    host: str,
    port: int,
    payloads: Iterator[tuple[str, bytes]],
    *,
    count: int,
    time_s: float,
    read_s: float = 1.0,
    read_s_by_kind: dict[str, float] | None = None,
) -> Sent:
    """Open a connection per payload, send it, read until the target closes
    it (at most ``read_s``, or ``read_s_by_kind[kind]``), close; ``count``
    connections within ``time_s``."""
    by_kind: dict[str, int] = {}
    started = time.monotonic()
    for _ in range(count):
        if time.monotonic() - started > time_s:
            break
        kind, data = next(payloads)
        try:
            with socket.create_connection((host, port), timeout=1.0) as conn:
                until = time.monotonic() + (read_s_by_kind or {}).get(kind, read_s)
                try:
                    conn.sendall(data)
                    while (left := until - time.monotonic()) > 0:
                        conn.settimeout(left)
                        if not conn.recv(65536):
                            break
                except OSError:  # timeouts included
                    pass
        except OSError:
            continue
        by_kind[kind] = by_kind.get(kind, 0) + 1
    return Sent(by_kind, time.monotonic() - started)
